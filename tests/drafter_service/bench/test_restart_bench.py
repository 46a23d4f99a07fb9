"""The Draft prober of `drafter bench serve`: a process of its own, timing every call against a real service."""

import os
import time

import numpy as np

from drafter_service.bench.restart_bench import Prober
from drafter_service.core.config import DrafterConfig
from drafter_service.datasets.request_files import Request
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig

VOCAB = 1000


def test_the_prober_times_draft_calls_from_its_own_process_until_stopped():
    server, port = create_server(ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB),
                                 "127.0.0.1:0")
    try:
        rng = np.random.default_rng(2)
        held = [Request(f"h{i}", rng.integers(0, VOCAB, 10, dtype=np.int32), rng.integers(0, VOCAB, 40,
                                                                                          dtype=np.int32))
                for i in range(2)]
        prober = Prober(f"127.0.0.1:{port}", held, budget=8).start()
        assert prober._process.pid is not None and prober._process.pid != os.getpid()
        began = time.monotonic()
        time.sleep(0.5)
        ended = time.monotonic()
        times = prober.stop()
        assert not prober._process.is_alive()
        assert len(times.between(began, ended)) > 10  # every call timed, on the parent's clock
        assert len(times.ms) == len(times.started) and all(0 < m < 5000 for m in times.ms)
    finally:
        server.stop(0)
