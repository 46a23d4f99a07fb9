"""One namespace at run time: its drafting core, its persistence, its statistics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from drafter_service.api.errors import InvalidArgument, NotFound, Unavailable
from drafter_service.api.tree import EMPTY_TREE, DraftTree, TokenIds
from drafter_service.core.batch_steps import StepsOutcome
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.core.model_drafts import ModelDrafts
from drafter_service.core.session import NOTHING_CONFIRMED, DraftSession
from drafter_service.namespaces.durable_log import DurableLog
from drafter_service.namespaces.frozen_tables import FrozenTables
from drafter_service.namespaces.index_files import IndexFiles
from drafter_service.namespaces.persistence_status import PersistenceStatus, persistence_status
from drafter_service.namespaces.spooling import SpoolingLog
from drafter_service.namespaces.stats import DraftCounters, NamespaceStats
from store.index_file import IndexFileError
from store.request_log import Duplicates, SeenKeys
from store.table_codec import encode_table

if TYPE_CHECKING:
    from store.persistence import RedisPersistence

logger = logging.getLogger(__name__)


class Namespace:
    """A namespace's core plus the durable log and snapshots behind it.

    Every completed request is written to the persistence layer before it is acknowledged and before it
    enters the in-memory store, so a failed write changes nothing.
    """

    def __init__(self, name: str, config: DrafterConfig, persistence: RedisPersistence | None,
                 draft_model: ModelDrafts | None = None) -> None:
        self.name = name
        self.drafter = Drafter(config, draft_model, name)
        self.persistence = persistence
        self.frozen_tables = FrozenTables(name, self.drafter, persistence)
        self.counters = DraftCounters()
        self.built_at = time.monotonic()
        self._memory_seen = SeenKeys()  # duplicate keys when there is no persistence
        self.log = DurableLog(name, persistence, self._store_logged, self.frozen_tables.sync)
        self.spool: SpoolingLog | None = None  # set at start-up: holds requests while Redis cannot
        self.index_files: IndexFiles | None = None  # set at start-up: the index file, read at restore

    @classmethod
    def create(cls, name: str, base: DrafterConfig, vocab_size: int, persistence: RedisPersistence | None,
               draft_model: ModelDrafts | None = None) -> Namespace:
        """A namespace whose core uses ``base`` with this namespace's vocabulary size."""
        return cls(name, replace(base, vocab_size=vocab_size), persistence, draft_model)

    # -- restore and save -----------------------------------------------------------------------------

    def restore(self, progress: Callable[[int], None] | None = None) -> int:
        """Reload everything persisted: snapshots, frozen tables, then the stored requests.

        With a usable index file (``index_files``) the store and the repeated-prompt cache come from it and only
        the requests logged after it are read and stored (the index is brought up to date in the background);
        otherwise every stored request is read and the main index is rebuilt. The dynamic table comes from its
        snapshot plus the requests logged after the snapshot either way.

        Returns:
            Number of requests restored (those the index file holds included).
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
        self.log.event_position = p.last_event_id()  # tables changed after this are picked up by a follower
        self.frozen_tables.restore()
        covered = self._restore_index_file()  # None: every request is read and stored
        n = self.drafter.store.ring.documents
        for rec in p.iter_request_records(after="0-0" if covered is None else min(covered, after, key=_stream_key)):
            learn = _after(rec.stream_id, after)
            if covered is None or _after(rec.stream_id, covered):
                self.drafter.add_document(rec.tokens, learn=learn, prompt_len=rec.prompt_len)
                self.log.position = rec.stream_id
                n += 1
                if progress is not None and n % 1000 == 0:
                    progress(n)
            elif learn:  # stored by the index file; the table snapshot is older
                self.drafter.learn(rec.tokens)
        if covered is None:
            self.rebuild("main")
        return n

    def _restore_index_file(self) -> str | None:
        """Take the store from the index file when it is usable; returns the stream id it covers, else None."""
        files = self.index_files
        found = files.load() if files is not None else None
        if files is None or found is None:
            return None
        try:
            files.restore(found)
        except IndexFileError as exc:
            logger.warning("namespace %s: index file not used (%s); rebuilding the index from the log", self.name,
                           exc)
            return None
        self.built_at = time.monotonic()
        return found.header.stream_id

    def snapshot(self) -> None:
        """Save the dynamic table and the acceptance statistics."""
        p = self.persistence
        if p is None:
            return
        with self.log.write_lock:  # the table then matches the log up to the position
            if self.spool is not None and self.spool.holding:
                return  # the table holds requests the log does not hold yet: snapshot once they are in
            last = self.log.position if self.log.follower is not None else p.last_id()
            header, arrays = encode_table(self.drafter.dynamic, p.vocab_limit)  # the native table: one C call
        p.save_encoded_table(header, arrays, last)
        p.save_model(self.drafter.model.snapshot())
        p.trim_requests(self.drafter.config.capacity)  # the log never outgrows what the ring buffer holds

    def rebuild(self, kind: str | None = None) -> str | None:
        """Rebuild the suffix index that is due (or ``kind``); the index file is then written again when due."""
        t0 = time.perf_counter()
        done = self.drafter.store.rebuild(kind)
        if done == "main":
            logger.info("namespace %s: main index over %d tokens built in %.2f s", self.name,
                        self.drafter.store.indexed_end - self.drafter.store.ring.oldest, time.perf_counter() - t0)
        if done:
            self.built_at = time.monotonic()
            self.drafter.refresh_draft_vocabulary()
            if self.index_files is not None:
                self.index_files.rebuilt(done)
        return done

    def save_index(self, behind: bool = False) -> None:
        """Write the index file when it is due (background job), or with ``behind`` whenever the indexes cover
        more than it does (shut-down)."""
        if self.index_files is not None:
            self.index_files.save(behind)

    # -- requests -------------------------------------------------------------------------------------

    def draft(self, sess: DraftSession, accepted: np.ndarray, max_nodes: int, report_only: bool = False,
              step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
              cut: Callable[[DraftTree], DraftTree] | None = None) -> tuple[DraftTree, int]:
        """Correct the session with ``accepted``, then draft; returns the tree and the draft tokens confirmed.

        Args:
            sess: one of this namespace's sessions.
            accepted: (k,) int32 validated token ids appended since the last call.
            max_nodes: the budget (0: the session's).
            report_only: nothing is drafted (the engine drafts from an earlier tree) and the tree is empty.
            step_seconds: the verification step that produced ``accepted`` (statistics only; 0: not reported).
            plain_step_seconds: the engine's plain decode step now (statistics only; see ``estimated_speedup``).
            cut: what the caller does to the tree before the engine verifies it (see ``Drafter.draft``).

        Raises:
            NotFound: the session has ended.
        """
        if sess.closed:
            raise NotFound("the session has ended")
        t0 = time.perf_counter_ns()
        d = self.drafter
        confirmed = d.correct(sess, accepted) if accepted.size else NOTHING_CONFIRMED
        steps = int(accepted.size)
        c = self.counters
        if report_only:
            with c.lock:
                c.record_step(steps, step_seconds, plain_step_seconds)
                c.reused_steps += 1
                c.confirmed_tokens += confirmed.tokens
                c.count_sources(c.confirmed_by_source, confirmed.sources, confirmed.tokens)
            return EMPTY_TREE, confirmed.tokens
        tree = d.draft(sess, max_nodes, cut)
        latency_ns = time.perf_counter_ns() - t0
        with c.lock:
            c.record_step(steps, step_seconds, plain_step_seconds)
            c.latencies_ns.append(latency_ns)
            c.drafts += 1
            c.drafted_tokens += len(tree)
            c.count_sources(c.drafted_by_source, tree.sources, len(tree))
            if steps:
                c.scored_steps += 1
                c.confirmed_tokens += confirmed.tokens
                c.count_sources(c.confirmed_by_source, confirmed.sources, confirmed.tokens)
        return tree, confirmed.tokens

    def draft_steps(self, sessions: Sequence[DraftSession], accepted: np.ndarray, offsets: list[int],
                    limits: list[int], report: list[bool], step_seconds: float = 0.0,
                    plain_step_seconds: float = 0.0) -> StepsOutcome:
        """``draft`` for many sessions the drafter can batch (``Drafter.batchable``), in one native call.

        Args:
            sessions: distinct open sessions of this namespace.
            accepted: (total,) int32 validated tokens of every session, one after another.
            offsets: session i's tokens are ``accepted[offsets[i]:offsets[i + 1]]``.
            limits: each session's budget (the step's, or else the session's ``max_nodes``).
            report: sessions whose tokens are only recorded (their trees are empty).
            step_seconds: the batched verification step (statistics only; 0: not reported).
            plain_step_seconds: the engine's plain decode step now (statistics only).
        """
        out = self.drafter.draft_steps(sessions, accepted, offsets, limits, report)
        self.counters.record_batch(offsets, report, out, step_seconds, plain_step_seconds)
        return out

    def end_session(self, sess: DraftSession, accepted: np.ndarray, request_id: str | None = None) -> int:
        """Store the request (the session's tokens and ``accepted``) durably, then close the session.

        Args:
            sess: one of this namespace's sessions.
            accepted: (k,) int32 validated token ids appended since the last Draft.
            request_id: the stored request's id (the session id when None).

        Returns:
            The tokens stored.

        Raises:
            NotFound: the session has already ended (two EndSession calls of one session: the second).
        """
        with self.log.write_lock:
            if sess.closed:
                raise NotFound("the session has ended")
            doc = np.concatenate([sess.tokens, accepted])
            self._persist([(doc, request_id or sess.session_id)], [sess.prompt_len])
            self.drafter.finish(sess, accepted, document=doc)
        return int(doc.size)

    def ingest(self, requests: Sequence[tuple[TokenIds, TokenIds, str]],
               skip_duplicates: Duplicates | bool = False) -> tuple[int, int, int]:
        """Validate every request first (one bad request refuses the call), persist them all, then store them.

        Args:
            requests: (prompt ids, output ids, request id or "") per request.
            skip_duplicates: leave out requests already stored (True: same request id, or same prompt and
                output; ``Duplicates.SKIP_SAME_ID``: same request id only),
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
        with self.log.write_lock:
            appended = self._persist(docs, prompt_lens, skip_duplicates)
            stored = tokens = 0
            for (doc, _), plen, sid in zip(docs, prompt_lens, appended, strict=True):
                if sid is not None:
                    self.drafter.add_document(doc, prompt_len=plen)
                    stored += 1
                    tokens += int(doc.size)
                    time.sleep(0)  # hands the interpreter lock to a waiting draft between requests
        return stored, tokens, len(docs) - stored

    def _persist(self, docs: list[tuple[np.ndarray, str | None]], prompt_lens: list[int],
                 skip_duplicates: Duplicates | bool = False) -> list[str | None]:
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
        self.log.logged(ids, docs)
        return ids

    def _store_logged(self, doc: np.ndarray, prompt_len: int | None) -> None:
        """A request another replica logged, into memory (write lock held)."""
        self.drafter.add_document(doc, prompt_len=prompt_len)

    def persistence_ok(self) -> bool:
        """Whether Redis answers (with enough replicas) and no acknowledged request waits in the spool (else the
        namespace is degraded), as of the last health check."""
        return self.persistence_status().healthy

    def persistence_status(self) -> PersistenceStatus:
        """Health, replicas, spooled requests and why degraded, as of the last health check (no wait on Redis)."""
        return persistence_status(self.persistence, self.spool)

    def stats(self) -> NamespaceStats:
        """Figures for GetStats and the metrics."""
        d = self.drafter
        s = d.store.stats()
        c = self.counters
        m = d.draft_model
        gate = d.model_gate.figures() if d.model_gate is not None and m is not None else None
        status = self.persistence_status()
        return NamespaceStats(
            namespace=self.name, vocab_size=d.config.vocab_size, stored_tokens=s["tokens"],
            stored_requests=s["documents"], indexed_tokens=s["indexed_tokens"],
            unindexed_tokens=s["unindexed_tokens"], memory_bytes=s["ring_bytes"] + s["index_bytes"],
            index_age_seconds=time.monotonic() - self.built_at, dynamic_leaders=len(d.dynamic),
            frozen_tables=sorted(d.frozen), active_sessions=len(d.sessions), drafts=c.drafts,
            drafted_tokens=c.drafted_tokens, confirmed_tokens=c.confirmed_tokens,
            mean_accepted_length=c.mean_accepted_length,
            draft_latency_p50_us=c.percentile_us(50), draft_latency_p99_us=c.percentile_us(99),
            persistence_healthy=status.healthy, reported_steps=c.reported_steps,
            mean_step_ms=1e3 * c.step_seconds_total / c.reported_steps if c.reported_steps else 0.0,
            speedup_steps=c.speedup_steps, estimated_speedup=c.estimated_speedup,
            drafted_by_source=dict(c.drafted_by_source), confirmed_by_source=dict(c.confirmed_by_source),
            reused_steps=c.reused_steps, repeat_hits=d.repeats.hits,
            draft_model_sessions=m.open_sessions if m is not None else 0,
            draft_model_steps=m.steps if m is not None else 0, draft_model_hits=m.hits if m is not None else 0,
            draft_model_verdict=gate.verdict if gate else "", draft_model_served=gate.serving if gate else False,
            draft_model_ratio=gate.ratio if gate else 0.0, spooled_requests=status.spooled_requests,
            redis_replicas_connected=status.replicas_connected, redis_replica_acks=status.replica_acks,
            persistence_detail=status.detail,
        )


def _stream_key(stream_id: str) -> tuple[int, int]:
    """A stream id ("ms-seq") as a sortable pair."""
    a, _, b = stream_id.partition("-")
    return int(a), int(b or 0)


def _after(stream_id: str, snapshot_id: str) -> bool:
    """Whether a stream entry came after the one a table snapshot covers (ids are "ms-seq")."""
    return _stream_key(stream_id) > _stream_key(snapshot_id)
