"""One namespace at run time: its drafting core, its persistence, its statistics."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from drafter_service.config import DrafterConfig
from drafter_service.drafter import Drafter
from drafter_service.errors import InvalidArgument, Unavailable
from drafter_service.tree import EMPTY_TREE, DraftTree
from store.ngram_table import FrozenNGramTable

if TYPE_CHECKING:
    from drafter_service.card import DraftModelDrafts
    from store.persistence import RedisPersistence

logger = logging.getLogger(__name__)


@dataclass
class DraftCounters:
    """Draft statistics of a namespace since the service started."""

    drafts: int = 0
    drafted_tokens: int = 0
    scored_steps: int = 0
    confirmed_tokens: int = 0
    reused_steps: int = 0
    reported_steps: int = 0
    step_seconds_total: float = 0.0
    latencies_ns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8192))

    def percentile_us(self, q: float) -> float:
        """Latency percentile of the recent drafts, in microseconds (0 when none)."""
        return float(np.percentile(np.fromiter(self.latencies_ns, dtype=np.int64), q)) / 1e3 \
            if self.latencies_ns else 0.0


class Namespace:
    """A namespace's core plus the durable log and snapshots behind it.

    Every completed request is written to the persistence layer before it is acknowledged and before it
    enters the in-memory store, so a failed write changes nothing.
    """

    def __init__(self, name: str, config: DrafterConfig, persistence: "RedisPersistence | None",
                 draft_model: "DraftModelDrafts | None" = None) -> None:
        self.name = name
        self.drafter = Drafter(config, draft_model)
        self.persistence = persistence
        self.counters = DraftCounters()
        self.built_at = time.monotonic()
        self._write_lock = threading.Lock()  # keeps the durable log and the ring buffer in the same order

    @classmethod
    def create(cls, name: str, base: DrafterConfig, vocab_size: int, persistence: "RedisPersistence | None",
               draft_model: "DraftModelDrafts | None" = None) -> "Namespace":
        """A namespace whose core uses ``base`` with this namespace's vocabulary size."""
        return cls(name, replace(base, vocab_size=vocab_size), persistence, draft_model)

    # -- restore and save -----------------------------------------------------------------------------

    def restore(self, progress: Callable[[int], None] | None = None) -> int:
        """Reload everything persisted: snapshots, frozen tables, then every stored request; rebuild the index.

        Returns:
            Number of requests restored.
        """
        p = self.persistence
        if p is None:
            return 0
        snapshot = p.load_table_snapshot()
        after = "0-0"
        if snapshot is not None:
            items, header = snapshot
            after = header.get("last_request_id") or "0-0"
            self.drafter.dynamic.load(items)
        stats = p.load_model()
        if stats:
            self.drafter.model.load(stats)
        cfg = self.drafter.config
        for table_name in p.list_frozen():
            entries = p.load_frozen(table_name)
            self.drafter.add_frozen(table_name, FrozenNGramTable(cfg.leader_len, cfg.follower_len, entries))
        n = 0
        for stream_id, doc, _ in p.iter_requests():
            self.drafter.add_document(doc, learn=_after(stream_id, after))
            n += 1
            if progress is not None and n % 1000 == 0:
                progress(n)
        self.rebuild("main")
        return n

    def snapshot(self) -> None:
        """Save the dynamic table and the acceptance statistics."""
        p = self.persistence
        if p is None:
            return
        with self._write_lock:  # the table then matches the log up to last_id
            last = p.last_id()
            items = list(self.drafter.dynamic.items())
        p.save_table(items, last)
        p.save_model(self.drafter.model.snapshot())
        p.trim_requests(self.drafter.config.capacity)  # the log never outgrows what the ring buffer holds

    def rebuild(self, kind: str | None = None) -> str | None:
        """Rebuild the suffix index that is due (or ``kind``)."""
        done = self.drafter.store.rebuild(kind)
        if done:
            self.built_at = time.monotonic()
            self.drafter.refresh_draft_vocabulary()
        return done

    # -- requests -------------------------------------------------------------------------------------

    def draft(self, session_id: str, accepted: Sequence[int], max_nodes: int, report_only: bool = False,
              step_seconds: float = 0.0) -> tuple[DraftTree, int]:
        """Extend the session with ``accepted``, then propose; returns the tree and the confirmed count.

        With ``report_only`` nothing is proposed (the engine drafts from an earlier tree) and the tree is empty.
        """
        t0 = time.perf_counter_ns()
        d = self.drafter
        confirmed = d.extend(session_id, accepted) if len(accepted) else 0
        c = self.counters
        if step_seconds > 0:
            c.reported_steps += 1
            c.step_seconds_total += step_seconds
        if report_only:
            c.reused_steps += 1
            c.confirmed_tokens += confirmed
            return EMPTY_TREE, confirmed
        tree = d.propose(session_id, max_nodes)
        c.latencies_ns.append(time.perf_counter_ns() - t0)
        c.drafts += 1
        c.drafted_tokens += len(tree)
        if len(accepted):
            c.scored_steps += 1
            c.confirmed_tokens += confirmed
        return tree, confirmed

    def end_session(self, session_id: str, accepted: Sequence[int]) -> int:
        """Store the request durably, then close the session; returns the tokens stored."""
        doc = self.drafter.closing_document(session_id, accepted)
        with self._write_lock:
            self._persist([(doc, session_id)])
            self.drafter.end(session_id, accepted)
        return int(doc.size)

    def ingest(self, requests: Sequence[tuple[Sequence[int], Sequence[int], str]]) -> tuple[int, int]:
        """Validate every request first (one bad request refuses the call), persist them all, then store them."""
        docs = []
        for i, (prompt, output, request_id) in enumerate(requests):
            try:
                docs.append((self.drafter.document(prompt, output), request_id or None))
            except InvalidArgument as exc:
                raise InvalidArgument(f"request {i}: {exc}") from None
        with self._write_lock:
            self._persist(docs)
            for doc, _ in docs:
                self.drafter.add_document(doc)
        return len(docs), sum(int(doc.size) for doc, _ in docs)

    def _persist(self, docs: list[tuple[np.ndarray, str | None]]) -> None:
        if self.persistence is None:
            return
        try:
            self.persistence.append_requests(docs)
        except Exception as exc:  # the store is unchanged: nothing is acknowledged
            logger.error("namespace %s: could not persist %d requests: %s", self.name, len(docs), exc)
            raise Unavailable(f"could not store the request durably: {exc}") from exc

    def stats(self) -> dict[str, object]:
        """Figures for GetStats and the metrics."""
        d = self.drafter
        s = d.store.stats()
        c = self.counters
        healthy = True
        if self.persistence is not None:
            try:
                healthy = bool(self.persistence.ping())
            except Exception:  # reported, not raised: stats must answer while Redis is down
                healthy = False
        return {
            "namespace": self.name, "vocab_size": d.config.vocab_size, "stored_tokens": s["tokens"],
            "stored_requests": s["documents"], "indexed_tokens": s["indexed_tokens"],
            "unindexed_tokens": s["unindexed_tokens"], "memory_bytes": s["ring_bytes"] + s["index_bytes"],
            "index_age_seconds": time.monotonic() - self.built_at, "dynamic_leaders": len(d.dynamic),
            "frozen_tables": sorted(d.frozen), "active_sessions": len(d.sessions), "drafts": c.drafts,
            "drafted_tokens": c.drafted_tokens, "confirmed_tokens": c.confirmed_tokens,
            "mean_accepted_length": (c.confirmed_tokens / c.scored_steps + 1.0) if c.scored_steps else 0.0,
            "draft_latency_p50_us": c.percentile_us(50), "draft_latency_p99_us": c.percentile_us(99),
            "persistence_healthy": healthy, "reported_steps": c.reported_steps,
            "mean_step_ms": 1e3 * c.step_seconds_total / c.reported_steps if c.reported_steps else 0.0,
            "reused_steps": c.reused_steps, "repeat_hits": d.repeats.hits, **self._model_stats(),
        }

    def _model_stats(self) -> dict[str, object]:
        m = self.drafter.draft_model
        if m is None:
            return {"draft_model_sessions": 0, "draft_model_steps": 0, "draft_model_hits": 0}
        return {"draft_model_sessions": m.open_sessions, "draft_model_steps": m.steps, "draft_model_hits": m.hits}


def _after(stream_id: str, snapshot_id: str) -> bool:
    """Whether a stream entry came after the one a table snapshot covers (ids are "ms-seq")."""
    a, _, b = stream_id.partition("-")
    c, _, d = snapshot_id.partition("-")
    return (int(a), int(b or 0)) > (int(c), int(d or 0))
