"""Metric points of a namespace in a capped Redis stream, so the dashboard's history survives restarts."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, cast

import redis

from store.redis_common import StreamEntry
from store.redis_common import redis_errors as _redis_errors
from store.redis_connect import RedisClient

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

logger = logging.getLogger(__name__)

METRICS_HISTORY = 7 * 24 * 3600 // 5
"""Metric points kept per namespace by default: a week at one point every 5 seconds."""


class MetricLog:
    """The metric-point part of ``RedisPersistence`` (which sets ``client``, ``metrics_key``, ``metrics_history``)."""

    client: RedisClient
    metrics_key: str
    metrics_history: int

    # -- metric points ---------------------------------------------------------------------------------------

    def append_metric_point(self, point: dict) -> int:
        """Append one metric point (a JSON-serialisable dict) at its time ``point["t"]`` (ms; now when absent).

        The entry id is ``<t>-*``; when the stream already holds a later id (the clock went back) it is the
        server's next id instead. The stream is trimmed to about ``metrics_history`` entries.

        Returns:
            The time (ms) the point is stored under: its entry id's time.

        Raises:
            PersistenceUnavailable: the server cannot be reached or failed the command.
        """
        t_ms = int(point.get("t") or time.time() * 1000)
        fields: dict[FieldT, EncodableT] = {"p": json.dumps(point, separators=(",", ":"), allow_nan=False)}
        with _redis_errors("append a metric point"):
            try:
                sid = self.client.xadd(self.metrics_key, fields, id=f"{t_ms}-*", maxlen=self.metrics_history,
                                       approximate=True)
            except redis.ResponseError:  # a later id exists, or a server before Redis 7 (no "<ms>-*")
                sid = self.client.xadd(self.metrics_key, fields, maxlen=self.metrics_history, approximate=True)
        return int(cast(bytes, sid).split(b"-")[0])

    def read_metric_points(self, since_ms: int = 0, limit: int = 10000) -> list[dict]:
        """The newest ``limit`` metric points stored after time ``since_ms`` (exclusive), oldest first.

        Each point's ``t`` is its entry id's time in ms.

        Raises:
            PersistenceUnavailable: the server cannot be reached or failed the command.
        """
        if limit < 1:
            return []
        with _redis_errors("read metric points"):
            entries = cast("list[StreamEntry]", self.client.xrevrange(self.metrics_key, "+",
                                                                      f"{max(0, int(since_ms)) + 1}", count=limit))
        points = []
        for sid, fields in reversed(entries):
            try:
                point = json.loads(fields[b"p"])
            except (KeyError, ValueError):
                logger.warning("skipping the unreadable metric point %s", sid)
                continue
            point["t"] = int(sid.split(b"-")[0])
            points.append(point)
        return points

    def metric_point_count(self) -> int:
        """Metric points held."""
        with _redis_errors("count metric points"):
            return int(self.client.xlen(self.metrics_key))
