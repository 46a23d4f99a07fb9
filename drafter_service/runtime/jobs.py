"""Background jobs (APScheduler): suffix index rebuilds, index files, snapshots, metric rollups, folder warming."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from apscheduler.schedulers.background import BackgroundScheduler

from drafter_service.service.service import DrafterService

if TYPE_CHECKING:
    from drafter_service.ingest.warm_watch import FolderWatch

logger = logging.getLogger(__name__)


def _logged(name: str, fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception:  # a failed run is retried at the next interval
            logger.exception("background job %s failed", name)
    return run


def start_jobs(service: DrafterService, rebuild_interval_s: float, snapshot_interval_s: float,
               metrics: Callable[[], object] | None = None, metrics_interval_s: float = 5.0,
               warm: FolderWatch | None = None, index_files: Callable[[], object] | None = None) -> BackgroundScheduler:
    """Start the scheduler: rebuild due suffix indexes, snapshot tables, roll up metrics (persistence health runs on
    a thread of its own, ``PersistenceHealth``).

    ``index_files`` (``DrafterService.save_index_files``), when given, runs every ``rebuild_interval_s`` seconds in
    a job of its own, so writing a large index file never holds up the rebuilds.

    Each job runs at most once at a time and coalesces missed runs. ``metrics`` (``MetricsRollup.roll``), when
    given, runs every ``metrics_interval_s`` seconds. ``warm`` (``drafter serve --warm-dir``) scans its
    folder at once and then every ``warm.interval_s``.
    """
    scheduler = BackgroundScheduler(daemon=True, job_defaults={"max_instances": 1, "coalesce": True,
                                                                "misfire_grace_time": None})
    scheduler.add_job(_logged("rebuild", service.rebuild_due), "interval", seconds=rebuild_interval_s,
                      id="rebuild")
    scheduler.add_job(_logged("snapshot", service.snapshot), "interval", seconds=snapshot_interval_s,
                      id="snapshot")
    if index_files is not None:
        scheduler.add_job(_logged("index-file", index_files), "interval", seconds=rebuild_interval_s, id="index-file")
    if metrics is not None:
        scheduler.add_job(_logged("metrics", metrics), "interval", seconds=metrics_interval_s, id="metrics")
    if warm is not None:
        warm.schedule(scheduler)
    scheduler.start()
    return scheduler
