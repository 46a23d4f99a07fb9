"""The metric point stream in a real Redis-protocol server: order, `since` and `limit`, bounded history."""

import pytest

from store.persistence import METRICS_HISTORY, PersistenceUnavailable, RedisPersistence


def test_points_come_back_in_time_order_after_since_newest_first_cut(redis_server):
    p = RedisPersistence(redis_server.url, "ns")
    for i, t in enumerate((1000, 2000, 2000, 3000)):
        assert p.append_metric_point({"t": t, "drafts": i, "by": {"store": i}, "speedup": None}) == t
    got = p.read_metric_points()
    assert [(q["t"], q["drafts"]) for q in got] == [(1000, 0), (2000, 1), (2000, 2), (3000, 3)]
    assert got[0]["by"] == {"store": 0} and got[0]["speedup"] is None
    assert [q["drafts"] for q in p.read_metric_points(since_ms=1000)] == [1, 2, 3]  # since is exclusive
    assert [q["drafts"] for q in p.read_metric_points(since_ms=2000)] == [3]
    assert [q["drafts"] for q in p.read_metric_points(limit=2)] == [2, 3]  # the newest two
    assert p.read_metric_points(limit=0) == [] and p.metric_point_count() == 4
    assert RedisPersistence(redis_server.url, "other").read_metric_points() == []  # per namespace


def test_a_clock_that_went_back_still_appends_after_the_newest_point(redis_server):
    p = RedisPersistence(redis_server.url, "ns")
    p.append_metric_point({"t": 5000, "n": 1})
    assert p.append_metric_point({"t": 4000, "n": 2}) >= 5000
    assert [q["n"] for q in p.read_metric_points()] == [1, 2]


def test_history_is_bounded_and_keeps_the_newest(redis_server):
    assert METRICS_HISTORY == 7 * 24 * 720  # a week of 5 s points
    p = RedisPersistence(redis_server.url, "ns", metrics_history=50)
    for t in range(1, 601):
        p.append_metric_point({"t": t})
    held = p.metric_point_count()
    assert 50 <= held <= 150  # trimmed by whole stream nodes (100 entries each), never below the bound
    assert p.read_metric_points(limit=1)[0]["t"] == 600
    with pytest.raises(ValueError):
        RedisPersistence(redis_server.url, "ns", metrics_history=0)
    assert p.drop() >= 1 and p.metric_point_count() == 0


def test_a_server_that_is_gone_raises_persistence_unavailable(redis_server):
    p = RedisPersistence(redis_server.url, "ns")
    redis_server.stop()
    with pytest.raises(PersistenceUnavailable):
        p.append_metric_point({"t": 1})
    with pytest.raises(PersistenceUnavailable):
        p.read_metric_points()
