"""Metrics after a scripted sequence of drafts (real gRPC channel, real Redis): GetStats, /metrics, the rollup
point in Redis, its history across a restart, and a Redis outage that must not stop serving."""

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_topologies import wait_until

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig
from store.embedded_redis import EmbeddedRedis

VOCAB = 1000
DOC = pb.Sequence(prompt=list(range(10, 20)), output=list(range(20, 30)))  # 20 distinct tokens, stored first

# The script: (session, accepted, request options, tree the reply must hold, its sources, confirmed).
# Step times are powers of two, exact in the proto's float32.
SCRIPT = [
    ("a", [], {}, [13, 14, 15, 16], ["store"] * 4, 0),                      # the stored document continues
    ("a", [13, 14, 15, 16, 17], dict(step_seconds=0.25, plain_step_seconds=0.0625),
     [18, 19, 20, 21], ["store"] * 4, 4),                                   # all 4 confirmed, 17 the target's
    ("a", [18, 7], dict(step_seconds=0.125, plain_step_seconds=0.0625), [], [], 1),  # 7: nothing known after it
    ("a", [3], dict(report_only=True, step_seconds=0.5), [], [], 0),       # a step time without a plain one
    ("b", [], {}, [502, 503, 500, 501], ["session"] * 4, 0),                # prompt lookup inside b's prompt
    ("b", [502, 503, 999], dict(step_seconds=0.25, plain_step_seconds=0.125), [], [], 2),
    ("c", [], {}, [500, 501, 502, 503], ["dynamic"] * 4, 0),                # the dynamic table learnt b's prompt
    ("c", [500, 501, 4], dict(report_only=True), [], [], 2),               # confirmed on a report-only step
]
PROMPTS = {"a": [10, 11, 12], "b": [500, 501, 502, 503, 500, 501], "c": [7, 503]}

# By hand, from the script:
DRAFTS = 6                                          # the six calls that were not report-only
DRAFTED = {"store": 8, "session": 4, "dynamic": 4}  # nodes served, by source: 16 in all
CONFIRMED = {"store": 5, "session": 2, "dynamic": 2}  # a: 4 + 1, b: 2, c: 2 = 9
ACCEPTED_STEPS, ACCEPTED_TOKENS = 5, 5 + 2 + 1 + 3 + 3  # calls that carried accepted tokens
MAT = 14 / 5                                        # 2.8 tokens per verification step
ACCEPTANCE = 9 / 16
REPORTED_STEPS, MEAN_STEP_MS = 4, (0.25 + 0.125 + 0.5 + 0.25) / 4 * 1e3  # 281.25
# Steps with both times: a2 (5 tokens, .25 s, plain .0625), a3 (2, .125, .0625), b2 (3, .25, .125):
# 10 tokens in .625 s = 16 tokens/s; mean plain step .25 / 3 s, so plain decoding runs 12 tokens/s.
SPEEDUP_STEPS, SPEEDUP = 3, (10 / 0.625) * (0.25 / 3)  # 4/3
STORED_TOKENS = 20 + 1                              # the document and its separator


def start_runtime(redis_url: str, data_dir: Path) -> Runtime:
    cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_url, http_address="127.0.0.1:0", data_dir=str(data_dir),
                        default_vocab_size=VOCAB, drafter=DrafterConfig(capacity=1 << 16),
                        rebuild_in_subprocess=False, rebuild_interval_s=3600, snapshot_interval_s=3600,
                        metrics_interval_s=3600)  # the test rolls up by hand
    return Runtime(cfg).start()


def get(runtime: Runtime, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{runtime.http_port}{path}", timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def scrape(runtime: Runtime) -> dict[tuple[str, tuple], float]:
    status, body = get(runtime, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def run_script(stub) -> None:
    stub.Ingest(pb.IngestRequest(requests=[DOC]))
    for sid, prompt in PROMPTS.items():
        stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=prompt))
    for sid, accepted, options, tokens, sources, confirmed in SCRIPT:
        reply = stub.Draft(pb.DraftRequest(session_id=sid, accepted=accepted, max_nodes=4, **options))
        assert list(reply.token_ids) == tokens, (sid, accepted)
        assert [pb.Source.Name(s)[len("SOURCE_"):].lower() for s in reply.sources] == sources
        assert reply.confirmed == confirmed


@pytest.fixture
def running(redis_server, tmp_path):
    runtime = start_runtime(redis_server.url, tmp_path / "data")
    channel = grpc.insecure_channel(f"127.0.0.1:{runtime.port}")
    yield runtime, pb_grpc.DrafterStub(channel)
    channel.close()
    runtime.stop()


def test_stats_and_prometheus_figures_equal_the_hand_computed_ones(running):
    runtime, stub = running
    run_script(stub)
    stats = stub.GetStats(pb.GetStatsRequest())
    assert (stats.drafts, stats.drafted_tokens, stats.confirmed_tokens) == (DRAFTS, 16, 9)
    assert dict(stats.drafted_by_source) == DRAFTED and dict(stats.confirmed_by_source) == CONFIRMED
    assert stats.mean_accepted_length == pytest.approx(MAT)
    assert (stats.reported_steps, stats.reused_steps) == (REPORTED_STEPS, 2)
    assert stats.mean_step_ms == pytest.approx(MEAN_STEP_MS)
    assert stats.speedup_steps == SPEEDUP_STEPS and stats.estimated_speedup == pytest.approx(SPEEDUP)
    assert stats.estimated_speedup == pytest.approx(4 / 3)

    m = scrape(runtime)
    ns = (("namespace", "default"),)
    assert m[("drafter_drafts_total", ns)] == DRAFTS
    assert m[("drafter_drafted_tokens_total", ns)] == 16 and m[("drafter_confirmed_tokens_total", ns)] == 9
    for source in DRAFTED:
        key = (("namespace", "default"), ("source", source))
        assert m[("drafter_source_drafted_tokens_total", key)] == DRAFTED[source]
        assert m[("drafter_source_confirmed_tokens_total", key)] == CONFIRMED[source]
    assert m[("drafter_mean_accepted_length", ns)] == pytest.approx(MAT)
    assert m[("drafter_acceptance_rate", ns)] == pytest.approx(ACCEPTANCE)
    assert m[("drafter_estimated_speedup", ns)] == pytest.approx(SPEEDUP)
    assert m[("drafter_accepted_steps_total", ns)] == ACCEPTED_STEPS
    assert m[("drafter_accepted_tokens_total", ns)] == ACCEPTED_TOKENS
    assert m[("drafter_speedup_steps_total", ns)] == SPEEDUP_STEPS
    assert m[("drafter_reported_steps_total", ns)] == REPORTED_STEPS
    assert m[("drafter_store_tokens", ns)] == STORED_TOKENS and m[("drafter_store_requests", ns)] == 1
    assert m[("drafter_active_sessions", ns)] == 3 and m[("drafter_persistence_healthy", ns)] == 1
    p50 = m[("drafter_draft_latency_seconds", ns + (("quantile", "0.5"),))]
    p99 = m[("drafter_draft_latency_seconds", ns + (("quantile", "0.99"),))]
    assert 0 < p50 <= p99 < 1.0
    assert ("drafter_index_age_seconds", ns) in m and ("drafter_store_memory_bytes", ns) in m


def test_rollup_points_hold_the_interval_deltas_and_survive_a_restart(redis_server, tmp_path):
    runtime = start_runtime(redis_server.url, tmp_path / "data")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{runtime.port}") as channel:
            stub = pb_grpc.DrafterStub(channel)
            run_script(stub)
            (first,) = runtime.rollup.roll()
            # one more step: b appends [7] in .5 s while a plain step takes .25 s
            reply = stub.Draft(pb.DraftRequest(session_id="b", accepted=[7], max_nodes=4, step_seconds=0.5,
                                               plain_step_seconds=0.25))
            (second,) = runtime.rollup.roll()
            for sid in PROMPTS:
                stub.EndSession(pb.EndSessionRequest(session_id=sid))
        assert first["namespace"] == "default" and first["interval_s"] > 0
        assert (first["drafts"], first["drafted_tokens"], first["confirmed_tokens"]) == (DRAFTS, 16, 9)
        assert first["drafted_by_source"] == DRAFTED and first["confirmed_by_source"] == CONFIRMED
        assert (first["accepted_steps"], first["accepted_tokens"]) == (ACCEPTED_STEPS, ACCEPTED_TOKENS)
        assert first["mat"] == pytest.approx(MAT) and first["acceptance"] == pytest.approx(ACCEPTANCE)
        assert first["acceptance_by_source"] == pytest.approx({"store": 5 / 8, "session": 2 / 4, "dynamic": 2 / 4})
        assert (first["speedup_steps"], first["speedup_tokens"]) == (SPEEDUP_STEPS, 10)
        assert first["speedup_step_seconds"] == 0.625 and first["speedup_plain_seconds"] == 0.25
        assert first["speedup"] == pytest.approx(SPEEDUP)
        assert (first["reported_steps"], first["reused_steps"]) == (REPORTED_STEPS, 2)
        assert first["drafts_per_s"] == pytest.approx(DRAFTS / first["interval_s"])
        assert 0 < first["latency_p50_us"] <= first["latency_p99_us"]
        assert (first["stored_tokens"], first["stored_requests"], first["active_sessions"]) == (STORED_TOKENS, 1, 3)
        assert first["healthy"] is True and first["index_age_s"] >= 0

        # The second point holds only what happened after the first: one step, one token, 1 / .5 * .25.
        drafted = len(reply.token_ids)
        assert (second["drafts"], second["drafted_tokens"], second["accepted_steps"]) == (1, drafted, 1)
        assert second["confirmed_tokens"] == 0 and second["confirmed_by_source"] == {}
        assert second["mat"] == 1.0 and second["speedup_steps"] == 1
        assert second["speedup"] == pytest.approx(1 / 0.5 * 0.25)
        assert second["t"] >= first["t"]

        status, body = get(runtime, "/api/series?namespace=default")
        assert status == 200
        assert json.loads(body)["points"] == [first, second]
    finally:
        runtime.stop()  # rolls up the last partial interval: the EndSession calls, no drafts

    restarted = start_runtime(redis_server.url, tmp_path / "data")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{restarted.port}") as channel:
            assert pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest()).drafts == 0  # counters restart
        status, body = get(restarted, "/api/series?namespace=default")
        points = json.loads(body)["points"]
        assert status == 200 and len(points) == 3  # the history did not
        assert points[:2] == [first, second]
        assert points[2]["drafts"] == 0 and points[2]["stored_requests"] == 4
        status, body = get(restarted, f"/api/series?namespace=default&since={first['t']}")
        assert [p["t"] for p in json.loads(body)["points"]] == [p["t"] for p in points[1:]]
    finally:
        restarted.stop()


def test_a_redis_outage_drops_points_with_a_warning_and_serving_goes_on(running, redis_server, caplog):
    runtime, stub = running
    run_script(stub)
    assert runtime.rollup.roll()[0]["healthy"] is True
    port = redis_server.port
    redis_server.stop()
    wait_until(lambda: not runtime.persistence_health.healthy, 10, "the health check to notice")  # every 1 s
    with caplog.at_level(logging.WARNING, logger="drafter_service.web.timeseries"):
        (point,) = runtime.rollup.roll()
    assert point["healthy"] is False and point["drafts"] == 0
    assert any("metric point dropped" in r.getMessage() for r in caplog.records)
    assert runtime.rollup.dropped == 1
    reply = stub.Draft(pb.DraftRequest(session_id="a", accepted=[1], max_nodes=4))  # drafting goes on
    assert reply is not None
    assert stub.GetStats(pb.GetStatsRequest()).persistence_healthy is False
    assert scrape(runtime)[("drafter_persistence_healthy", (("namespace", "default"),))] == 0
    status, body = get(runtime, "/api/series?namespace=default")
    assert status == 200 and [p["healthy"] for p in json.loads(body)["points"]] == [True, False]  # from memory
    status, body = get(runtime, "/healthz")
    assert status == 200 and json.loads(body)["persistence_healthy"] == {"default": False}

    with EmbeddedRedis(redis_server.data_dir, port=port):  # Redis is back with its data
        wait_until(lambda: runtime.persistence_health.healthy, 10, "the health check to notice")
        (point,) = runtime.rollup.roll()
        assert point["healthy"] is True and point["drafts"] == 1
        status, body = get(runtime, "/api/series?namespace=default")
        assert [p["healthy"] for p in json.loads(body)["points"]] == [True, True]  # the dropped one is gone
        runtime.stop()
