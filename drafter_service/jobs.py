"""Background jobs (APScheduler): suffix index rebuilds, snapshots, persistence health."""

from __future__ import annotations

import logging
from typing import Callable

from apscheduler.schedulers.background import BackgroundScheduler

from drafter_service.service import DrafterService

logger = logging.getLogger(__name__)


def _logged(name: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception:  # a failed run is retried at the next interval
            logger.exception("background job %s failed", name)
    return run


def start_jobs(service: DrafterService, rebuild_interval_s: float, snapshot_interval_s: float,
               health: Callable[[], None] | None = None) -> BackgroundScheduler:
    """Start the scheduler: rebuild due suffix indexes, snapshot tables, check health.

    Each job runs at most once at a time and coalesces missed runs.
    """
    scheduler = BackgroundScheduler(daemon=True, job_defaults={"max_instances": 1, "coalesce": True,
                                                                "misfire_grace_time": None})
    scheduler.add_job(_logged("rebuild", service.rebuild_due), "interval", seconds=rebuild_interval_s,
                      id="rebuild")
    scheduler.add_job(_logged("snapshot", service.snapshot), "interval", seconds=snapshot_interval_s,
                      id="snapshot")
    if health is not None:
        scheduler.add_job(_logged("health", health), "interval", seconds=2.0, id="health")
    scheduler.start()
    return scheduler
