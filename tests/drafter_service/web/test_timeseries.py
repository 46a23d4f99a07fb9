"""Metric points by hand: deltas and rates of one interval, merging runs of points, downsampling."""

import pytest

from drafter_service.namespaces.stats import DraftCounters, estimated_speedup
from drafter_service.web.timeseries import downsample, make_point, merge_points

GAUGES = {"stored_tokens": 500, "stored_requests": 7, "memory_bytes": 4096, "index_age_seconds": 2.5,
          "active_sessions": 3, "persistence_healthy": True}


def counters(**values):
    c = DraftCounters()
    for key, value in values.items():
        setattr(c, key, value)
    return c.snapshot()


def test_a_point_holds_the_changes_since_the_last_and_the_rates_they_give():
    before = counters(drafts=10, drafted_tokens=100, confirmed_tokens=40, accepted_steps=9, accepted_tokens=30,
                      drafted_by_source={"store": 60, "session": 40}, confirmed_by_source={"store": 30, "session": 10},
                      speedup_steps=5, speedup_tokens=20, speedup_step_seconds=0.5, speedup_plain_seconds=0.25)
    after = counters(drafts=14, drafted_tokens=132, confirmed_tokens=52, accepted_steps=13, accepted_tokens=46,
                     drafted_by_source={"store": 80, "session": 40, "dynamic": 12},
                     confirmed_by_source={"store": 38, "session": 10, "dynamic": 4},
                     speedup_steps=9, speedup_tokens=36, speedup_step_seconds=0.9, speedup_plain_seconds=0.45)
    point = make_point("ns", 1_000, 2.0, before, after, [3000, 1000, 2000, 4000], GAUGES)
    assert point["t"] == 1000 and point["namespace"] == "ns" and point["interval_s"] == 2.0
    assert (point["drafts"], point["drafted_tokens"], point["confirmed_tokens"]) == (4, 32, 12)
    assert point["drafted_by_source"] == {"dynamic": 12, "store": 20}  # session did not change: left out
    assert point["confirmed_by_source"] == {"dynamic": 4, "store": 8}
    assert point["drafts_per_s"] == 2.0
    assert point["mat"] == 16 / 4  # 16 tokens over 4 steps
    assert point["acceptance"] == 12 / 32
    assert point["acceptance_by_source"] == {"dynamic": 4 / 12, "store": 8 / 20}
    # 16 tokens in .4 s = 40 tokens/s; plain steps of .2 / 4 = .05 s, 20 tokens/s: twice as fast
    assert point["speedup"] == pytest.approx(2.0)
    assert point["latency_p50_us"] == 2.5 and point["latency_p99_us"] == pytest.approx(3.97)
    assert (point["stored_tokens"], point["stored_requests"], point["index_age_s"]) == (500, 7, 2.5)
    assert point["healthy"] is True and point["active_sessions"] == 3


def test_an_idle_interval_has_no_rates_rather_than_zero_ones():
    same = counters(drafts=3, drafted_tokens=9)
    point = make_point("ns", 5, 5.0, same, same, [], GAUGES)
    assert point["drafts"] == 0 and point["drafts_per_s"] == 0.0
    assert point["mat"] is None and point["acceptance"] is None and point["speedup"] is None
    assert point["latency_p50_us"] is None and point["acceptance_by_source"] == {}


def test_estimated_speedup_definition():
    assert estimated_speedup(0, 0, 0.0, 0.0) == 0.0
    assert estimated_speedup(2, 6, 0.3, 0.2) == pytest.approx(6 / 0.3 * 0.1)  # 20 tokens/s over 10 tokens/s


def _point(t, drafts, drafted, confirmed, steps, tokens, p50, p99, stored, healthy=True, interval=5.0):
    base = counters()
    after = counters(drafts=drafts, drafted_tokens=drafted, confirmed_tokens=confirmed, accepted_steps=steps,
                     accepted_tokens=tokens, speedup_steps=steps, speedup_tokens=tokens,
                     speedup_step_seconds=0.01 * steps, speedup_plain_seconds=0.005 * steps,
                     drafted_by_source={"store": drafted}, confirmed_by_source={"store": confirmed})
    lat = [] if p50 is None else [p50 * 1000] * 98 + [p99 * 1000] * 2
    point = make_point("ns", t, interval, base, after, lat, dict(GAUGES, stored_tokens=stored,
                                                                 persistence_healthy=healthy))
    return point


def test_merging_sums_the_deltas_and_derives_the_rates_again():
    a = _point(1000, 2, 20, 10, 2, 8, 100.0, 300.0, 50)
    b = _point(2000, 6, 40, 10, 6, 12, 200.0, 250.0, 80, healthy=False)
    m = merge_points([a, b])
    assert m["t"] == 2000 and m["interval_s"] == 10.0
    assert (m["drafts"], m["drafted_tokens"], m["confirmed_tokens"]) == (8, 60, 20)
    assert m["drafted_by_source"] == {"store": 60} and m["confirmed_by_source"] == {"store": 20}
    assert m["drafts_per_s"] == 0.8 and m["mat"] == 20 / 8 and m["acceptance"] == 20 / 60
    assert m["speedup"] == pytest.approx(20 / 0.08 * 0.005)
    assert m["latency_p50_us"] == pytest.approx((100 * 2 + 200 * 6) / 8) and m["latency_p99_us"] == 300.0
    assert m["stored_tokens"] == 80 and m["healthy"] is False


def test_downsampling_merges_runs_and_keeps_the_newest_runs_whole():
    points = [_point(1000 * i, 1, 4, 2, 1, 3, 10.0, 20.0, i) for i in range(1, 8)]
    assert downsample(points, 0) == points and downsample(points, 7) == points
    three = downsample(points, 3)  # runs of 3: [1], [2 3 4], [5 6 7]
    assert [p["t"] for p in three] == [1000, 4000, 7000]
    assert [p["drafts"] for p in three] == [1, 3, 3]
    assert sum(p["interval_s"] for p in three) == 35.0
