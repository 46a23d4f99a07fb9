"""A running service: storage (embedded or external Redis), restore, gRPC server, background jobs, shut-down."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import grpc

from drafter_service.jobs import start_jobs
from drafter_service.server import create_server
from drafter_service.service import DrafterService
from drafter_service.service_config import ServiceConfig
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
        self.server: grpc.Server | None = None
        self.port = 0
        self._scheduler = None
        self._worker: IndexWorker | None = None
        self._stopped = threading.Event()

    def start(self) -> "Runtime":
        """Connect storage, restore every namespace, start serving and the background jobs."""
        cfg = self.config
        url = cfg.redis_url
        if not url:
            self.redis = EmbeddedRedis(Path(cfg.data_dir))
            self.redis.start()
            url = self.redis.url
            logger.info("embedded Redis on %s, data in %s", url, cfg.data_dir)
        self.service = DrafterService(cfg, lambda name, vocab: RedisPersistence(url, name, vocab_size=vocab))
        if cfg.rebuild_in_subprocess:
            self._worker = IndexWorker()
            for ns in self.service.namespaces.values():
                ns.drafter.store.builder = self._worker.build_arrays
        t0 = time.perf_counter()
        restored = self.service.restore()
        logger.info("restored %s in %.2f s", restored, time.perf_counter() - t0)
        self.server, self.port = create_server(cfg, cfg.address, self.service)
        self._scheduler = start_jobs(self.service, cfg.rebuild_interval_s, cfg.snapshot_interval_s)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop taking requests, let running ones finish, save tables, stop storage. Safe to call twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.server is not None:
            self.server.stop(grace).wait()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
        if self.service is not None:
            self.service.close()
            self.service.snapshot()
        if self._worker is not None:
            self._worker.close()
        if self.redis is not None:
            self.redis.stop()
        logger.info("stopped")

    def wait(self) -> None:
        """Block until ``stop`` is called (from a signal handler or another thread)."""
        self._stopped.wait()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
