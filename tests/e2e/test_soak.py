"""A short soak of a real `drafter serve` process: concurrent sessions on DraftStreams and a stream of ingests,
with no errors and memory that does not grow (`drafter bench soak` runs the same load for longer)."""

import tempfile
from pathlib import Path

import grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.bench.serve_bench import ServiceProcess, _fill
from drafter_service.bench.soak import MIB, rss_bytes, soak
from drafter_service.datasets.loaders import load_dataset


def test_a_short_soak_has_no_errors_and_stable_memory():
    requests = load_dataset("sharegpt", 400)
    held, feed = requests[-60:], requests[:-60]
    with tempfile.TemporaryDirectory(prefix="drafter-soak-test-") as tmp:
        svc = ServiceProcess(Path(tmp) / "data", capacity=200_000, extra_args=["--workers", "16"])
        svc.start()
        try:
            with grpc.insecure_channel(svc.address) as channel:
                _fill(pb_grpc.DrafterStub(channel), feed, 300_000)  # past the capacity: the ring buffer wraps
            result = soak(svc.address, svc.proc.pid, held, feed, sessions=8, seconds=5, warmup=2, budget=16,
                          ingest_batch=8, ingest_interval=0.1)
            with grpc.insecure_channel(svc.address) as channel:
                stats = pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(), timeout=30)
            now, high_water = rss_bytes(svc.proc.pid)
            assert high_water >= now > 0
        finally:
            svc.stop()
    print("\n" + "\n".join(result.lines()))
    assert result.errors == {}, result.errors
    assert result.drafts > 100 and result.sessions_done > 0 and result.ingest_calls > 0
    assert stats.active_sessions == 0 and stats.stored_tokens <= 200_000
    assert result.second_half_growth < 24 * MIB, result.lines()
    assert result.rss_end - result.rss_start < 48 * MIB, result.lines()
    assert result.draft_p99_us > 0 and result.rss_start > 0
    # The peak is the largest sample (the kernel's VmHWM is refreshed only on some events and may lag a sample).
    assert result.rss_peak >= max(result.rss_start, result.rss_end)
