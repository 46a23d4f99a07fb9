"""A running service: storage (embedded or external Redis), restore, gRPC and HTTP servers, background jobs."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from grpc_health.v1 import health

from drafter_service.ingest.warm_watch import FolderWatch, service_watch
from drafter_service.namespaces.log_follower import LogFollower, default_replica_id
from drafter_service.rpc.loop_server import LoopServer
from drafter_service.rpc.persistence_health import PersistenceHealth
from drafter_service.rpc.server import create_server
from drafter_service.runtime.index_folder import attach_index_files, check_index_files_ahead
from drafter_service.runtime.jobs import start_jobs
from drafter_service.runtime.spools import attach_spools
from drafter_service.service.auth import HttpAuth
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService
from drafter_service.web.http_server import DashboardServer
from drafter_service.web.timeseries import MetricsRollup
from store.embedded_redis import EmbeddedRedis
from store.index_worker import IndexWorker
from store.persistence import RedisPersistence

logger = logging.getLogger(__name__)


class Runtime:
    """Starts everything ``drafter serve`` runs, in order, and stops it in reverse, saving state first."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.service: DrafterService | None = None
        self.server: LoopServer | None = None
        self.port = 0
        self.rollup: MetricsRollup | None = None
        self.http: DashboardServer | None = None
        self._scheduler = None
        self.warm: FolderWatch | None = None
        self._worker: IndexWorker | None = None
        self.replica_id = config.replica_id or default_replica_id()
        self.followers: list[LogFollower] = []
        self.persistence_health: PersistenceHealth | None = None
        self._stopped = threading.Event()

    def start(self) -> Runtime:
        """Connect storage, restore every namespace, start serving and the background jobs."""
        cfg = self.config
        url = cfg.redis_url
        checked = check_index_files_ahead(cfg)  # while Redis loads its data
        if not url:
            self.redis = EmbeddedRedis(Path(cfg.data_dir))
            self.redis.start()
            url = self.redis.url
            logger.info("embedded Redis on %s, data in %s", url, cfg.data_dir)
        self.service = DrafterService(cfg, lambda name, vocab: RedisPersistence(
            url, name, vocab_size=vocab, metrics_history=cfg.metrics_history, replica_acks=cfg.redis_replica_acks,
            write_timeout_s=cfg.redis_write_timeout_s))
        if cfg.rebuild_in_subprocess:
            self._worker = IndexWorker()
            for ns in self.service.namespaces.values():
                ns.drafter.store.builder = self._worker.build_arrays
        attach_index_files(self.service, cfg, checked)
        adopted = attach_spools(self.service, cfg)  # a stopped process's spooled requests go into the log first
        if adopted:
            logger.info("%d requests spooled by a stopped process moved to Redis", adopted)
        t0 = time.perf_counter()
        restored = self.service.restore()
        logger.info("restored %s in %.2f s", restored, time.perf_counter() - t0)
        if cfg.following:  # other replicas' requests and frozen tables, from where the restore ended
            self.followers = [LogFollower(ns.log, self.replica_id).start() for ns in self.service.namespaces.values()]
        servicer = health.HealthServicer()
        self.persistence_health = PersistenceHealth(self.service, servicer, cfg.spool_drain_interval_s).start()
        self.server, self.port = create_server(cfg, cfg.address, self.service, servicer)
        self.rollup = MetricsRollup(self.service)
        if cfg.http_address:
            self.http = DashboardServer(self.service, self.rollup, cfg.http_address,
                                        interval_s=cfg.metrics_interval_s,
                                        auth=HttpAuth(cfg.http_token, cfg.admin_token, bool(cfg.namespace_tokens)))
            try:
                self.http.start()
            except OSError as exc:
                self.http = None
                raise OSError(f"cannot listen on {cfg.http_address} for the dashboard and /metrics ({exc}); "
                              "choose another --http-address, or '' for no HTTP") from exc
        self.warm = service_watch(self.service, cfg)
        self._scheduler = start_jobs(self.service, cfg.rebuild_interval_s, cfg.snapshot_interval_s,
                                     metrics=self.rollup.roll, metrics_interval_s=cfg.metrics_interval_s,
                                     warm=self.warm,
                                     index_files=self.service.save_index_files)
        return self

    @property
    def http_port(self) -> int:
        """Port of the dashboard and /metrics (0 when HTTP is off or not started)."""
        return self.http.port if self.http is not None else 0

    def stop(self, grace: float = 5.0) -> None:
        """Stop taking requests, let running ones finish, save tables, stop storage. Safe to call twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.server is not None:
            self.server.stop(grace).wait()
        if self.http is not None:
            self.http.stop()
        if self.warm is not None:  # a running scan ends after its current batch
            self.warm.stop()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
        if self.persistence_health is not None:  # a last drain; spools still holding requests stay for next start
            self.persistence_health.close()
        for follower in self.followers:  # its blocking read ends on its own
            follower.stop(wait=False)
        if self.rollup is not None:
            try:  # the last partial interval goes into the history too
                self.rollup.roll()
            except Exception:
                logger.exception("final metric rollup failed")
        if self.service is not None:
            self.service.close()
            self.service.snapshot()
            self.service.save_index_files(behind=True)  # the next start reads what is indexed now
        if self._worker is not None:
            self._worker.close()
        if self.redis is not None:
            self.redis.stop()
        logger.info("stopped")

    def wait(self) -> None:
        """Block until ``stop`` is called (from a signal handler or another thread).

        Sleeps in short slices and reads the flag without its lock: a signal the kernel delivers to another thread
        only sets a flag, and the main thread runs the Python handler when it next executes bytecode (which a wait
        with no timeout may never do); and a handler that calls ``stop`` sets ``_stopped``, whose lock
        ``Event.wait`` holds for a moment after each timeout: a handler run then deadlocked the process.
        """
        while not self._stopped.is_set():
            time.sleep(0.25)

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
