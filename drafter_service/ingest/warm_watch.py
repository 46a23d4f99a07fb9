"""Folder watching for cache warming: an APScheduler job that warms new and grown log files."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from apscheduler.schedulers.base import BaseScheduler

from drafter_service.ingest.warm import Warmer, WarmStats

if TYPE_CHECKING:
    from drafter_service.service.config import ServiceConfig
    from drafter_service.service.service import DrafterService

logger = logging.getLogger(__name__)


class FolderWatch:
    """Warms the log files of some paths every ``interval_s``: new files, and files that grew, from their checkpoint.

    A last line without a newline is taken only once its file has not changed for an interval. ``stop()``
    ends a running scan after the batch being sent.
    """

    def __init__(self, warmer: Warmer, paths: Sequence[str | Path], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"the watch interval must be positive, got {interval_s}")
        self.warmer, self.paths, self.interval_s = warmer, [Path(p) for p in paths], float(interval_s)
        self.total = WarmStats()
        self._lock = threading.Lock()

    def scan(self) -> WarmStats:
        """Warm whatever is new once; returns what this scan did (also added to ``total``)."""
        with self._lock:
            found = self.warmer.warm_paths(self.paths, settled_s=self.interval_s)
            self.total.merge(found)
            self.total.seconds += found.seconds
        if found.files:
            logger.info("warm scan: %s", found.summary())
        return found

    def schedule(self, scheduler: BaseScheduler, job_id: str = "warm") -> None:
        """Add the scan to ``scheduler`` every interval, first at once; one scan at a time, missed runs coalesced."""
        scheduler.add_job(self._scan_logged, "interval", seconds=self.interval_s, id=job_id,
                          next_run_time=datetime.now(), max_instances=1, coalesce=True)

    def _scan_logged(self) -> None:
        try:
            self.scan()
        except Exception:  # the next scan resumes from the checkpoints
            logger.exception("warm scan of %s failed", ", ".join(map(str, self.paths)))

    def stop(self) -> None:
        """Make a running scan end after its current batch, and later ones return at once."""
        self.warmer.stop.set()


def service_watch(service: DrafterService, config: ServiceConfig) -> FolderWatch | None:
    """The folder watch ``drafter serve --warm-dir`` runs inside the service (None without ``warm_dir``).

    It calls the service directly, skips duplicates, and keeps its checkpoints in ``<data_dir>/warm-state``.

    Raises:
        TokenizerError: ``warm_tokenizer`` cannot be loaded.
    """
    if not config.warm_dir:
        return None
    from drafter_service.ingest.text_tokenizer import TextTokenizer
    from drafter_service.ingest.warm_sinks import ServiceSink
    from drafter_service.ingest.warm_state import CheckpointStore

    tokenizer = TextTokenizer.load(config.warm_tokenizer) if config.warm_tokenizer else None
    sink = ServiceSink(service, config.warm_namespace)
    state = CheckpointStore(Path(config.data_dir) / "warm-state", sink.target)
    warmer = Warmer(sink, tokenizer, state, progress=False)
    Path(config.warm_dir).mkdir(parents=True, exist_ok=True)
    logger.info("warming namespace %s from new log files in %s every %.1f s", sink.namespace, config.warm_dir,
                config.warm_interval_s)
    return FolderWatch(warmer, [config.warm_dir], config.warm_interval_s)
