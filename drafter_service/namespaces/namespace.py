"""One namespace at run time: its drafting core, its persistence, its statistics."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from drafter_service.api.errors import InvalidArgument, Unavailable
from drafter_service.api.tree import EMPTY_TREE, DraftTree
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.namespaces.frozen_tables import FrozenTables
from store.request_log import SeenKeys

if TYPE_CHECKING:
    from drafter_service.model.card import DraftModelDrafts
    from drafter_service.namespaces.log_follower import LogFollower
    from drafter_service.namespaces.spooling import SpoolingLog
    from store.persistence import RedisPersistence

logger = logging.getLogger(__name__)


def estimated_speedup(steps: int, tokens: int, step_seconds: float, plain_seconds: float) -> float:
    """Decode rate with drafts over the plain decode rate, from engine-reported step times (0 when undefined).

    Over ``steps`` verification steps that reported both times: ``tokens`` emitted (every token each step
    appended: accepted draft tokens plus the target's own), ``step_seconds`` their summed verification times
    and ``plain_seconds`` the summed plain decode step times reported with them. The speedup is
    ``(tokens / step_seconds) / (1 / mean plain step) = tokens / step_seconds * plain_seconds / steps``.
    """
    if steps <= 0 or step_seconds <= 0.0:
        return 0.0
    return tokens / step_seconds * (plain_seconds / steps)


@dataclass
class DraftCounters:
    """Draft statistics of a namespace since the service started (cumulative; the rollup takes differences).

    ``drafted_by_source`` counts served nodes by the source that proposed them (their sum is ``drafted_tokens``,
    "unspecified" for nodes without a source name); ``confirmed_by_source`` counts the confirmed ones the same
    way (sum ``confirmed_tokens``). ``accepted_steps`` counts the Draft calls (report-only ones included) that
    carried accepted tokens and ``accepted_tokens`` sums their lengths: each is one verification step and the
    tokens it emitted, so their ratio is the mean accepted length, right even when the engine verified only part
    of a served tree or drafted from an earlier one. ``speedup_*`` sum the steps that reported both
    ``step_seconds`` and ``plain_step_seconds`` (see ``estimated_speedup``).
    """

    drafts: int = 0
    drafted_tokens: int = 0
    scored_steps: int = 0
    confirmed_tokens: int = 0
    reused_steps: int = 0
    reported_steps: int = 0
    step_seconds_total: float = 0.0
    accepted_steps: int = 0
    accepted_tokens: int = 0
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    confirmed_by_source: dict[str, int] = field(default_factory=dict)
    speedup_steps: int = 0
    speedup_tokens: int = 0
    speedup_step_seconds: float = 0.0
    speedup_plain_seconds: float = 0.0
    latencies_ns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8192))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def percentile_us(self, q: float) -> float:
        """Latency percentile of the recent drafts, in microseconds (0 when none)."""
        return float(np.percentile(np.fromiter(self.latencies_ns, dtype=np.int64), q)) / 1e3 \
            if self.latencies_ns else 0.0

    @staticmethod
    def count_sources(into: dict[str, int], sources: Sequence[str], n: int) -> None:
        """Add ``n`` nodes whose source names are ``sources`` (one per node; missing ones "unspecified")."""
        if n <= 0:
            return
        counts = collections.Counter(sources[:n])
        counts[""] += n - min(n, len(sources))
        for name, k in counts.items():
            if k:
                name = name or "unspecified"
                into[name] = into.get(name, 0) + k

    def record_step(self, tokens: int, step_seconds: float, plain_step_seconds: float) -> None:
        """Count a step that appended ``tokens`` and reported its verification and plain step times (0: not)."""
        if tokens:
            self.accepted_steps += 1
            self.accepted_tokens += tokens
        if step_seconds > 0:
            self.reported_steps += 1
            self.step_seconds_total += step_seconds
            if plain_step_seconds > 0 and tokens:
                self.speedup_steps += 1
                self.speedup_tokens += tokens
                self.speedup_step_seconds += step_seconds
                self.speedup_plain_seconds += plain_step_seconds

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted draft tokens plus the target's own); 0 before any."""
        return self.accepted_tokens / self.accepted_steps if self.accepted_steps else 0.0

    @property
    def estimated_speedup(self) -> float:
        """``estimated_speedup`` over every step since the start."""
        return estimated_speedup(self.speedup_steps, self.speedup_tokens, self.speedup_step_seconds,
                                 self.speedup_plain_seconds)

    def snapshot(self) -> dict[str, object]:
        """A copy of the cumulative counters (for the metrics rollup); latencies are not included."""
        return {"drafts": self.drafts, "drafted_tokens": self.drafted_tokens, "scored_steps": self.scored_steps,
                "confirmed_tokens": self.confirmed_tokens, "reused_steps": self.reused_steps,
                "reported_steps": self.reported_steps, "step_seconds_total": self.step_seconds_total,
                "accepted_steps": self.accepted_steps, "accepted_tokens": self.accepted_tokens,
                "drafted_by_source": dict(self.drafted_by_source),
                "confirmed_by_source": dict(self.confirmed_by_source), "speedup_steps": self.speedup_steps,
                "speedup_tokens": self.speedup_tokens, "speedup_step_seconds": self.speedup_step_seconds,
                "speedup_plain_seconds": self.speedup_plain_seconds}


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
        self.frozen_tables = FrozenTables(name, self.drafter, persistence)
        self.counters = DraftCounters()
        self.built_at = time.monotonic()
        self._write_lock = threading.Lock()  # keeps the durable log and the ring buffer in the same order
        self._memory_seen = SeenKeys()  # duplicate keys when there is no persistence
        self.log_position = "0-0"  # stream id of the newest logged request the store holds (all before it too)
        self.event_position = "0-0"  # id of the newest event seen (frozen-table changes by other replicas)
        self.follower: "LogFollower | None" = None  # set when this replica follows the shared log
        self.spool: "SpoolingLog | None" = None  # set by attach_spools: holds requests while Redis cannot

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
        self.event_position = p.last_event_id()  # tables changed after this are picked up by a follower
        self.frozen_tables.restore()
        n = 0
        for rec in p.iter_request_records():
            self.drafter.add_document(rec.tokens, learn=_after(rec.stream_id, after), prompt_len=rec.prompt_len)
            self.log_position = rec.stream_id
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
        with self._write_lock:  # the table then matches the log up to the position
            if self.spool is not None and self.spool.holding:
                return  # the table holds requests the log does not hold yet: snapshot once they are in
            last = self.log_position if self.follower is not None else p.last_id()
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
              step_seconds: float = 0.0, plain_step_seconds: float = 0.0) -> tuple[DraftTree, int]:
        """Extend the session with ``accepted``, then propose; returns the tree and the confirmed count.

        With ``report_only`` nothing is proposed (the engine drafts from an earlier tree) and the tree is empty.
        ``step_seconds`` (the verification step that produced ``accepted``) and ``plain_step_seconds`` (the
        engine's plain decode step now) feed the statistics only; see ``estimated_speedup``.
        """
        t0 = time.perf_counter_ns()
        d = self.drafter
        confirmed = d.extend(session_id, accepted) if len(accepted) else 0
        by_source = self._confirmed_sources(session_id) if confirmed else ()
        c = self.counters
        if report_only:
            with c.lock:
                c.record_step(len(accepted), step_seconds, plain_step_seconds)
                c.reused_steps += 1
                c.confirmed_tokens += confirmed
                c.count_sources(c.confirmed_by_source, by_source, confirmed)
            return EMPTY_TREE, confirmed
        tree = d.propose(session_id, max_nodes)
        latency_ns = time.perf_counter_ns() - t0
        with c.lock:
            c.record_step(len(accepted), step_seconds, plain_step_seconds)
            c.latencies_ns.append(latency_ns)
            c.drafts += 1
            c.drafted_tokens += len(tree)
            c.count_sources(c.drafted_by_source, tree.sources, len(tree))
            if len(accepted):
                c.scored_steps += 1
                c.confirmed_tokens += confirmed
                c.count_sources(c.confirmed_by_source, by_source, confirmed)
        return tree, confirmed

    def _confirmed_sources(self, session_id: str) -> tuple[str, ...]:
        sess = self.drafter.sessions.get(session_id)
        return sess.last_confirmed_sources if sess is not None else ()

    def end_session(self, session_id: str, accepted: Sequence[int], request_id: str | None = None) -> int:
        """Store the request durably, then close the session; returns the tokens stored.

        The stored request id is ``request_id`` (the session id when None).
        """
        with self._write_lock:  # two EndSession calls of one session: the second finds it gone (NOT_FOUND)
            doc = self.drafter.closing_document(session_id, accepted)
            prompt_len = self.drafter.session(session_id).prompt_len
            self._persist([(doc, request_id or session_id)], [prompt_len])
            self.drafter.end(session_id, accepted, document=doc)
        return int(doc.size)

    def ingest(self, requests: Sequence[tuple[Sequence[int], Sequence[int], str]],
               skip_duplicates: bool = False) -> tuple[int, int, int]:
        """Validate every request first (one bad request refuses the call), persist them all, then store them.

        Args:
            requests: (prompt ids, output ids, request id or "") per request.
            skip_duplicates: leave out requests already stored (same request id, or same prompt and output),
                found atomically with the append; see ``RedisPersistence.append_requests``.

        Returns:
            (requests stored, their tokens, duplicates skipped).
        """
        docs, prompt_lens = [], []
        for i, (prompt, output, request_id) in enumerate(requests):
            try:
                docs.append((self.drafter.document(prompt, output), request_id or None))
            except InvalidArgument as exc:
                raise InvalidArgument(f"request {i}: {exc}") from None
            prompt_lens.append(len(prompt))
        with self._write_lock:
            appended = self._persist(docs, prompt_lens, skip_duplicates)
            stored = tokens = 0
            for (doc, _), plen, sid in zip(docs, prompt_lens, appended):
                if sid is not None:
                    self.drafter.add_document(doc, prompt_len=plen)
                    stored += 1
                    tokens += int(doc.size)
        return stored, tokens, len(docs) - stored

    def _persist(self, docs: list[tuple[np.ndarray, str | None]], prompt_lens: list[int],
                 skip_duplicates: bool = False) -> list[str | None]:
        """Append ``docs`` durably; returns their stream ids (None for each duplicate left out).

        With a spool, requests Redis cannot take are fsynced there instead and get placeholder ids.
        """
        if self.persistence is None:
            return self._memory_seen.append(docs, prompt_lens, skip_duplicates)
        if self.spool is not None:
            ids, spooled = self.spool.append(docs, prompt_lens, skip_duplicates)  # Unavailable when neither can
            if spooled:
                return ids  # the log position passes them when the spool drains
        else:
            try:
                ids = self.persistence.append_requests(docs, prompt_lens, skip_duplicates)
            except Exception as exc:  # the store is unchanged: nothing is acknowledged
                logger.error("namespace %s: could not persist %d requests: %s", self.name, len(docs), exc)
                raise Unavailable(f"could not store the request durably: {exc}") from exc
        self.logged(ids, docs)
        return ids

    def logged(self, ids: Sequence[str | None], docs: Sequence[tuple[np.ndarray, str | None]]) -> None:
        """Move the log position past own requests just appended with stream ids ``ids`` (write lock held)."""
        if self.follower is not None:  # what other replicas logged just before goes into the store first
            self.follower.before_own(ids, docs)
        else:
            self.log_position = next((i for i in reversed(ids) if i is not None), self.log_position)

    def persistence_ok(self) -> bool:
        """Whether Redis answers and no acknowledged request waits in the spool (else the namespace is degraded)."""
        if self.persistence is None:
            return True
        if self.spool is not None and self.spool.holding:
            return False
        try:
            return bool(self.persistence.ping())
        except Exception:  # reported, not raised: stats must answer while Redis is down
            return False

    def stats(self) -> dict[str, object]:
        """Figures for GetStats and the metrics."""
        d = self.drafter
        s = d.store.stats()
        c = self.counters
        healthy = self.persistence_ok()
        return {
            "namespace": self.name, "vocab_size": d.config.vocab_size, "stored_tokens": s["tokens"],
            "stored_requests": s["documents"], "indexed_tokens": s["indexed_tokens"],
            "unindexed_tokens": s["unindexed_tokens"], "memory_bytes": s["ring_bytes"] + s["index_bytes"],
            "index_age_seconds": time.monotonic() - self.built_at, "dynamic_leaders": len(d.dynamic),
            "frozen_tables": sorted(d.frozen), "active_sessions": len(d.sessions), "drafts": c.drafts,
            "drafted_tokens": c.drafted_tokens, "confirmed_tokens": c.confirmed_tokens,
            "mean_accepted_length": c.mean_accepted_length,
            "draft_latency_p50_us": c.percentile_us(50), "draft_latency_p99_us": c.percentile_us(99),
            "persistence_healthy": healthy, "reported_steps": c.reported_steps,
            "mean_step_ms": 1e3 * c.step_seconds_total / c.reported_steps if c.reported_steps else 0.0,
            "speedup_steps": c.speedup_steps, "estimated_speedup": c.estimated_speedup,
            "drafted_by_source": dict(c.drafted_by_source), "confirmed_by_source": dict(c.confirmed_by_source),
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
