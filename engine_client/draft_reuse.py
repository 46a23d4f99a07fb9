"""Pre-speculation and session bookkeeping shared by the sync and asyncio drafter clients (pure Python, no gRPC).

A session's next draft is cut from the tree drafted for an earlier context, followed down the tokens appended
since; meanwhile the tree for the new context is fetched without waiting (a prefetch), and its answer is read at
the next step. Only a miss waits for a round trip."""

from __future__ import annotations

import collections
import itertools
import logging
import re
import threading
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from time import perf_counter_ns
from typing import Any

import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.tree import EMPTY_TREE, DraftTree
from drafter_service.api.verify_budget import cost_points_error
from engine_client.client_common import (
    CALLER_ERRORS,
    Backoff,
    ClientStats,
    DrafterRequestError,
    IngestBuffer,
    check_token_lists,
    check_tokens,
)

logger = logging.getLogger(__name__)

_SOURCE_NAMES = {pb.SOURCE_SESSION: "session", pb.SOURCE_STORE: "store", pb.SOURCE_DYNAMIC: "dynamic",
                 pb.SOURCE_FROZEN: "frozen", pb.SOURCE_MODEL: "model",
                 pb.SOURCE_REPEAT: "repeat"}
_SOURCE_NAMES_ALL: collections.defaultdict[int, str] = collections.defaultdict(
    str, {int(code): name for code, name in _SOURCE_NAMES.items()})
"""Source names by number, "" for any other number."""
_LIMIT_RE = re.compile(r"max_nodes must be in \[0, (\d+)\]")


def tree_of(resp: pb.DraftResponse) -> DraftTree:
    """The DraftTree of a DraftResponse (score recomputed from the probabilities)."""
    probs = tuple(resp.probs)
    return DraftTree(tuple(resp.token_ids), tuple(resp.parents), probs, float(sum(probs)),
                     tuple(_SOURCE_NAMES.get(s, "") for s in resp.sources))


def _column(data: bytes, dtype: str) -> tuple:
    """A packed little-endian column of a DraftBatchResponse as a tuple of Python numbers (a partial value
    at the end is dropped)."""
    size = np.dtype(dtype).itemsize
    return tuple(np.frombuffer(data, dtype, len(data) // size).tolist())


def trees_of_batch(resp: pb.DraftBatchResponse) -> list[DraftTree]:
    """The DraftTree of every step of a DraftBatchResponse, in order (a failed step's tree is empty)."""
    tokens, parents, probs = _column(resp.token_ids, "<i4"), _column(resp.parents, "<i4"), _column(resp.probs, "<f4")
    names = tuple(map(_SOURCE_NAMES_ALL.__getitem__, resp.sources))  # every node's at once: trees take slices
    out = []
    bounds = iter(resp.tree_offsets)
    start = next(bounds, 0)
    for stop in bounds:
        if stop > start:
            p = probs[start:stop]
            out.append(DraftTree(tokens[start:stop], parents[start:stop], p, float(sum(p)), names[start:stop]))
        else:
            out.append(EMPTY_TREE)
        start = stop
    return out


def descend(tree: DraftTree, tokens: Sequence[int]) -> int | None:
    """Index of the node reached by following ``tokens`` down from the root (-1: none), None when off the tree."""
    node = -1
    want = iter(tokens)
    tok = next(want, None)
    if tok is None:
        return node
    # every parent comes before its children
    for i, (t, p) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
        if p == node and t == tok:
            node = i
            tok = next(want, None)
            if tok is None:
                return node
    return None


def reusable_subtree(tree: DraftTree, accepted: Sequence[int], min_nodes: int = 1) -> DraftTree | None:
    """The part of ``tree`` below the path ``accepted``, when that path is in the tree and enough hangs below it.

    Args:
        tree: the whole previous tree (the engine verified only a prefix of it).
        accepted: tokens appended since that tree was drafted (accepted draft tokens plus the bonus token).
        min_nodes: smallest subtree worth serving instead of asking the service.

    Returns:
        The subtree re-rooted at the end of the path (probabilities conditioned on it), or None.
    """
    if not accepted or not len(tree):
        return None
    node = descend(tree, accepted)
    if node is None or node < 0:
        return None
    sub = tree.subtree(node)
    return sub if len(sub) >= max(1, min_nodes) else None


@dataclass(eq=False, slots=True)
class SessionState:
    """One request as the client knows it, and how much of it the service's session holds.

    ``tokens[:acked]`` is known to be in the remote session, ``tokens[acked:sent]`` was sent and not answered yet,
    ``tokens[sent:]`` is still to send (reports skipped while the service was away go with the next request).
    """

    local_id: str
    prompt_len: int
    max_nodes: int
    tokens: list[int]
    remote_id: str = ""
    generation: int = 0
    remote_open: bool = False
    uncertain: bool = False
    sent: int = 0
    acked: int = 0
    pending: list[Pending] = field(default_factory=list)
    full: DraftTree = EMPTY_TREE  # the latest tree, drafted for the context tokens[:full_base]
    full_base: int = 0
    prefetch: Pending | None = None  # the request for the tree of a newer context, not read yet
    last_kind: str = ""


@dataclass(eq=False, slots=True)
class Pending:
    """A DraftRequest on the stream whose answer is not matched yet; ``waiter`` is the transport's stream."""

    state: SessionState
    generation: int
    upto: int
    report: bool
    max_nodes: int = 0
    waiter: Any = None
    prefetch: bool = False  # asked for the next step's tree: its answer is kept, not given to the engine
    tree: DraftTree | None = None  # the answer's tree, once answered
    code: str = ""
    details: str = ""
    culprit: bool = False
    definite: bool = False
    done: bool = False

    def outcome(self) -> str:
        """"ok"; "reopen" (the service lost the session); "invalid" (the caller's fault); "retry" (surely not
        applied, safe to send again); "down" (the service may or may not have applied it)."""
        if self.tree is not None:
            return "ok"
        if self.culprit and self.code == "NOT_FOUND":
            return "reopen"
        if self.culprit and self.code in CALLER_ERRORS:
            return "invalid"
        return "retry" if self.definite else "down"


def settle_all(book: SessionBook, entries: list[Pending], code: str, details: str) -> None:
    """Fail what a broken stream still owed. After a refusal (the service aborts the stream on a bad request)
    the first was the culprit and none of the rest was applied; otherwise nothing is certain."""
    refused = code == "NOT_FOUND" or code in CALLER_ERRORS
    for i, entry in enumerate(entries):
        book.failed(entry, code, details, culprit=refused and i == 0, definite=refused)


class SessionBook:
    """Every open session of one client (tokens, remote sync state, the last whole tree) and the statistics.

    Pre-speculation policy: a step is served from the latest tree when the tokens appended since it was drafted
    are a path in it and at least ``min_reuse_nodes`` nodes hang below (0: the step's whole budget, so the engine
    never verifies a smaller tree than a fresh draft would give it; with 1, smaller subtrees measured about 5%
    fewer tokens per step); the tree for the new context is then fetched without waiting (``prefetch_request``).
    Thread-safe: the engine threads of the sync client update it under one lock.
    """

    def __init__(self, max_nodes: int = 32, reuse: bool = True, reuse_factor: int = 4, min_reuse_nodes: int = 0,
                 service_max_nodes: int = 1024, fixed_budget: bool = False) -> None:
        if min(max_nodes, reuse_factor, service_max_nodes) < 1 or min_reuse_nodes < 0:
            raise ValueError("max_nodes, reuse_factor and service_max_nodes must be at least 1, min_reuse_nodes >= 0")
        self.max_nodes, self.reuse, self.reuse_factor = max_nodes, reuse, reuse_factor
        self.min_reuse_nodes, self.limit = min_reuse_nodes, service_max_nodes
        self.fixed_budget = fixed_budget  # sessions ask the service not to shrink their trees
        self.vocab_size: int | None = None
        self.stats = ClientStats()
        self._sessions: dict[str, SessionState] = {}
        self._lock = threading.Lock()
        self._prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._sessions)

    # -- the engine's side ----------------------------------------------------------------------------

    def open(self, prompt: Sequence[int], max_nodes: int = 0) -> SessionState:
        """A new local session (validated; opened on the service separately)."""
        if max_nodes < 0:
            raise DrafterRequestError(f"max_nodes must be >= 0, got {max_nodes}")
        tokens = check_tokens(prompt, self.vocab_size, "prompt")
        state = SessionState(f"{self._prefix}-{next(self._ids)}", len(tokens), max_nodes or self.max_nodes, tokens)
        with self._lock:
            self._sessions[state.local_id] = state
        return state

    def get(self, session: str) -> SessionState:
        """The state of an open session; DrafterRequestError when unknown."""
        state = self._sessions.get(session)
        if state is None:
            raise DrafterRequestError(f"unknown session {session!r}", "NOT_FOUND")
        return state

    def get_all(self, sessions: Sequence[str]) -> list[SessionState]:
        """``get`` for the sessions of a step."""
        states = list(map(self._sessions.get, sessions))
        if None in states:
            for session in sessions:
                self.get(session)
        return states  # type: ignore[return-value]  # no None left

    def close(self, state: SessionState) -> None:
        """Forget a session."""
        with self._lock:
            self._sessions.pop(state.local_id, None)

    def record(self, state: SessionState, accepted: Sequence[int], step_seconds: float = 0.0,
               max_nodes: int = 0, plain_step_seconds: float = 0.0) -> list[int]:
        """Validate the arguments of a step and append the tokens the target accepted.

        The tokens are attributed to the kind of the last draft (reused or fetched) for acceptance statistics.
        """
        self.record_check(step_seconds, max_nodes, plain_step_seconds)
        toks = check_tokens(accepted, self.vocab_size, "accepted")
        with self._lock:
            state.tokens.extend(toks)
            if state.last_kind and toks:
                kind = "reuse" if state.last_kind == "reuse" else "fetch"
                setattr(self.stats, f"scored_after_{kind}", getattr(self.stats, f"scored_after_{kind}") + 1)
                setattr(self.stats, f"accepted_after_{kind}",
                        getattr(self.stats, f"accepted_after_{kind}") + len(toks) - 1)
            state.last_kind = ""
        return toks

    def record_all(self, states: Sequence[SessionState], accepted: Sequence[Sequence[int]],
                   step_seconds: float = 0.0, max_nodes: int = 0, plain_step_seconds: float = 0.0) -> list[list[int]]:
        """``record`` for the sessions of a step, at once: every argument is checked before any token is
        recorded."""
        self.record_check(step_seconds, max_nodes, plain_step_seconds)
        toks = check_token_lists(accepted, self.vocab_size, "accepted")
        stats = self.stats
        with self._lock:
            for state, t in zip(states, toks, strict=True):
                state.tokens += t
                if state.last_kind and t:
                    if state.last_kind == "reuse":
                        stats.scored_after_reuse += 1
                        stats.accepted_after_reuse += len(t) - 1
                    else:
                        stats.scored_after_fetch += 1
                        stats.accepted_after_fetch += len(t) - 1
                state.last_kind = ""
        return toks

    @staticmethod
    def record_check(step_seconds: float, max_nodes: int, plain_step_seconds: float) -> None:
        """DrafterRequestError unless a step's budget and step times are valid."""
        if max_nodes < 0:
            raise DrafterRequestError(f"max_nodes must be >= 0, got {max_nodes}")
        for name, value in (("step_seconds", step_seconds), ("plain_step_seconds", plain_step_seconds)):
            if not 0.0 <= value <= 3600.0:  # also refuses NaN
                raise DrafterRequestError(f"{name} must be in [0, 3600], got {value}")

    def unrecord(self, state: SessionState, n: int) -> None:
        """Take back the last ``n`` recorded tokens (the service refused them)."""
        with self._lock:
            del state.tokens[len(state.tokens) - n:]
            state.sent = min(state.sent, len(state.tokens))
            state.acked = min(state.acked, state.sent)

    def sequence(self, state: SessionState) -> pb.Sequence:
        """The whole request as an Ingest sequence, under the id an EndSession would have stored it with (the
        service's session id), so resending it after a lost EndSession answer stores it once."""
        return pb.Sequence(prompt=state.tokens[:state.prompt_len], output=state.tokens[state.prompt_len:],
                           request_id=state.remote_id or state.local_id)

    # -- the service's copy of a session --------------------------------------------------------------

    def needs_open(self, state: SessionState) -> bool:
        """Whether the service's session must be (re)opened before drafting."""
        return not state.remote_open or state.uncertain

    def can_report(self, state: SessionState) -> bool:
        """Whether tokens can go to the service's session now (it exists and is in step with ours)."""
        return state.remote_open and not state.uncertain

    def start_request(self, state: SessionState, namespace: str) -> tuple[pb.StartSessionRequest, int, bool]:
        """StartSession for (re)opening with everything known so far as the prompt.

        A session whose remote copy may still be alive with unknown contents gets a fresh id (the old one is
        abandoned); one the service lost keeps its id.

        Returns:
            (request, tokens it holds, whether this reopens a session the service had).
        """
        with self._lock:
            reopened = state.remote_open or state.uncertain or bool(state.sent)
            if state.uncertain:
                state.generation += 1
            state.remote_id = state.local_id if not state.generation else f"{state.local_id}~{state.generation}"
            n = len(state.tokens)
            return pb.StartSessionRequest(namespace=namespace, session_id=state.remote_id, prompt=state.tokens[:n],
                                          fixed_budget=self.fixed_budget), n, reopened

    def open_refused(self, state: SessionState, code: str) -> None:
        """A StartSession sent beside drafts (in a batch) was refused: the service does not hold the session."""
        with self._lock:
            state.remote_open = False
            if code == "ALREADY_EXISTS":
                state.generation += 1

    def bump(self, state: SessionState) -> None:
        """The remote id is taken (ALREADY_EXISTS): move to the next one."""
        with self._lock:
            state.generation += 1

    def opened(self, state: SessionState, n: int, reopened: bool) -> None:
        """The service's session now holds ``tokens[:n]``."""
        with self._lock:
            state.remote_open, state.uncertain = True, False
            state.sent = state.acked = n
            state.pending.clear()
            self.stats.reopened_sessions += int(reopened)
        if reopened:
            logger.info("session %s reopened on the service with %d tokens", state.local_id, n)

    def draft_request(self, state: SessionState, max_nodes: int, report: bool, step_seconds: float,
                      plain_step_seconds: float = 0.0,
                      cost: tuple[list[float], list[float], float] = ([], [], 0.0)) -> tuple[pb.DraftRequest, Pending]:
        """The next DraftRequest of a session (every token not sent yet) and its pending record; ``cost``: the
        engine's (nodes, seconds) cost points (``cost_points``)."""
        session_id, accepted, ask, entry = self.next_step(state, max_nodes, report)
        return pb.DraftRequest(session_id=session_id, accepted=accepted, max_nodes=ask, report_only=report,
                               step_seconds=step_seconds, plain_step_seconds=plain_step_seconds,
                               cost_nodes=cost[0], cost_seconds=cost[1], estimate_exponent=cost[2]), entry

    @staticmethod
    def cost_points(points: Sequence[tuple[float, float]], exponent: float = 0.0
                    ) -> tuple[list[float], list[float], float]:
        """A cost curve's ``(nodes, seconds)`` points as the request's two columns, and the estimates' exponent;
        DrafterRequestError when bad (``cost_points_error``)."""
        nodes = [float(n) for n, _ in points]
        seconds = [float(t) for _, t in points]
        error = cost_points_error(nodes, seconds, exponent)
        if error:
            raise DrafterRequestError(error)
        return nodes, seconds, float(exponent)

    def next_step(self, state: SessionState, max_nodes: int, report: bool) -> tuple[str, list[int], int, Pending]:
        """The next step of a session: (remote session id, every token not sent yet, budget to ask for, its pending
        record); the tokens count as sent from now on."""
        ask = 0 if report else self.budget(state, max_nodes)[1]
        with self._lock:
            end = len(state.tokens)
            accepted = state.tokens[state.sent:end]
            state.sent = end
            entry = Pending(state, state.generation, end, report, ask)
            state.pending.append(entry)
            self.stats.reports_sent += int(report)
            return state.remote_id, accepted, ask, entry

    def next_steps(self, states: Sequence[SessionState], max_nodes: int, report: Sequence[bool],
                   prefetch: int = 0) -> tuple[list[str], list[int], list[int], list[int], list[Pending]]:
        """``next_step`` for many sessions at once, their tokens one after another: (remote session ids, every
        session's tokens not sent yet, how many each has, budgets to ask for, pending records). The first
        ``prefetch`` sessions were served from an earlier tree: their trees are kept for the next step. The sessions
        are distinct (``step_batch.begin`` refuses a batch that names one twice)."""
        budget = self.budget
        asks = [0 if rep else budget(state, max_nodes)[1] for state, rep in zip(states, report, strict=True)]
        with self._lock:
            counts = [len(state.tokens) - state.sent for state in states]
            tokens = list(itertools.chain.from_iterable(state.tokens[state.sent:] for state in states))
            entries = [Pending(state, state.generation, len(state.tokens), rep, ask, prefetch=k < prefetch)
                       for k, (state, rep, ask) in enumerate(zip(states, report, asks, strict=True))]
            for entry in entries:
                state = entry.state
                state.sent = entry.upto
                state.pending.append(entry)
            for entry in entries[:prefetch]:
                entry.state.prefetch = entry
            ids = [state.remote_id for state in states]
            self.stats.reports_sent += sum(report)
        return ids, tokens, counts, asks, entries

    def end_request(self, state: SessionState) -> pb.EndSessionRequest:
        """EndSession with every token not sent yet."""
        return pb.EndSessionRequest(session_id=state.remote_id, accepted=state.tokens[state.sent:])

    def refused_end(self, state: SessionState, n: int, code: str, details: str) -> None:
        """EndSession failed: raise (taking back the last ``n`` tokens) when the request was the caller's fault."""
        if code in CALLER_ERRORS:
            self.unrecord(state, n)
            raise DrafterRequestError(f"EndSession refused: {details}", code)

    def answered(self, entry: Pending, resp: pb.DraftResponse | DraftTree) -> None:
        """The service answered ``entry`` (with a DraftResponse, or the tree a batch reply held for it)."""
        tree = resp if isinstance(resp, DraftTree) else tree_of(resp)
        with self._lock:
            if entry.done:
                return
            entry.done, entry.tree = True, tree
            state = entry.state
            if entry in state.pending:
                state.pending.remove(entry)
            if entry.generation == state.generation:
                state.acked = max(state.acked, entry.upto)

    def answered_all(self, entries: Sequence[Pending], trees: Sequence[DraftTree], max_nodes: int,
                     t0: int) -> list[DraftTree | None]:
        """``answered`` then ``fetched`` for every step of a batch the service answered with a tree, at once.

        Returns:
            Per entry: the engine's part of its tree (None for a report).
        """
        out: list[DraftTree | None] = []
        round_trip_ns = perf_counter_ns() - t0
        fetches = nodes = 0
        with self._lock:
            for entry, tree in zip(entries, trees, strict=True):
                self._settle(entry, tree)
                if entry.report or entry.prefetch:
                    out.append(None)
                    continue
                got = entry.tree if entry.tree is not None else EMPTY_TREE
                part = got.prefix(min(max_nodes or entry.state.max_nodes, self.limit))
                self._keep_fetched(entry.state, got, entry.upto, len(part))
                fetches += 1
                nodes += len(part)
                out.append(part)
            self._count_fetches(fetches, nodes, round_trip_ns)
        return out

    def answered_packed(self, entries: Sequence[Pending], sizes: Sequence[int], t0: int) -> None:
        """``answered_all`` for a batch taken as flat arrays, without a tree object per step: without reuse each
        tree is the engine's whole part, and no later step reads it back (``sizes``: each tree's nodes)."""
        round_trip_ns = perf_counter_ns() - t0
        with self._lock:
            for entry, size in zip(entries, sizes, strict=True):
                self._settle(entry, EMPTY_TREE)  # answered (its tree is in the arrays)
                self._keep_fetched(entry.state, EMPTY_TREE, entry.upto, size)
            self._count_fetches(len(entries), sum(sizes), round_trip_ns)

    def _settle(self, entry: Pending, tree: DraftTree) -> None:
        """``entry`` was answered with ``tree`` (hold the lock)."""
        state = entry.state
        if not entry.done:
            entry.done, entry.tree = True, tree
            if entry in state.pending:
                state.pending.remove(entry)
            if entry.generation == state.generation:
                state.acked = max(state.acked, entry.upto)

    @staticmethod
    def _keep_fetched(state: SessionState, tree: DraftTree, upto: int, nodes: int) -> None:
        """The session keeps ``tree``, drafted for ``tokens[:upto]``, as its latest; the engine got ``nodes`` of it
        (hold the lock)."""
        state.full, state.full_base, state.last_kind = tree, upto, ("fetch" if nodes else "")

    def _count_fetches(self, fetches: int, nodes: int, round_trip_ns: int) -> None:
        """The statistics count ``fetches`` fetched steps of ``nodes`` in all, each after ``round_trip_ns`` (hold
        the lock)."""
        stats = self.stats
        stats.steps += fetches
        stats.fetched_steps += fetches
        stats.fetched_nodes += nodes
        stats.round_trip_ns += round_trip_ns * fetches

    def failed(self, entry: Pending, code: str, details: str = "", culprit: bool = False,
               definite: bool = False) -> None:
        """``entry`` got no answer; ``definite`` when the service surely did not apply it."""
        with self._lock:
            if entry.done:
                return
            entry.done, entry.code, entry.details = True, code, details
            entry.culprit, entry.definite = culprit, definite
            state = entry.state
            if entry in state.pending:
                state.pending.remove(entry)
            if entry.generation != state.generation:
                return
            if culprit and code == "NOT_FOUND":
                state.remote_open = False  # the service restarted or dropped it: reopen with every token
            elif definite:
                state.sent = state.acked  # not applied: these tokens go with the next request
            else:
                state.uncertain = True  # maybe applied: reopen under a fresh id before drafting again

    def action(self, entry: Pending, n_recorded: int) -> str:
        """What a draft does after its round trip: "done", "retry" or "down".

        Raises:
            DrafterRequestError: the service refused the request as the caller's fault (the step's
                ``n_recorded`` tokens are taken back).
        """
        outcome = entry.outcome()
        if outcome == "invalid":
            found = _LIMIT_RE.search(entry.details)
            if found and entry.max_nodes > int(found.group(1)) >= 1:
                self.limit = int(found.group(1))
                logger.warning("drafter service limits trees to %d nodes; asking for no more", self.limit)
                return "retry"
            self.unrecord(entry.state, n_recorded)
            raise DrafterRequestError(f"Draft refused: {entry.details}", entry.code)
        return {"ok": "done", "down": "down"}.get(outcome, "retry")

    # -- drafts ---------------------------------------------------------------------------------------

    def budget(self, state: SessionState, max_nodes: int) -> tuple[int, int]:
        """(nodes the engine verifies, nodes to ask the service for)."""
        engine = min(max_nodes or state.max_nodes, self.limit)
        return engine, min(engine * (self.reuse_factor if self.reuse else 1), self.limit)

    def try_reuse(self, state: SessionState, max_nodes: int) -> DraftTree | None:
        """The next draft from the latest tree (a prefetched one once answered), below the tokens appended since
        it was drafted; None when a round trip is due."""
        if not self.reuse:
            return None
        engine_nodes = self.budget(state, max_nodes)[0]
        least = self.min_reuse_nodes or engine_nodes
        with self._lock:
            self._take_prefetch(state)
            tree, base = state.full, state.full_base
        if base > len(state.tokens):
            return None
        path = state.tokens[base:]
        sub = reusable_subtree(tree, path, least) if path else (tree if len(tree) >= max(1, least) else None)
        if sub is None:
            return None
        out = sub.prefix(engine_nodes)
        with self._lock:
            state.full, state.full_base, state.last_kind = sub, len(state.tokens), "reuse"
            self.stats.steps += 1
            self.stats.reused_steps += 1
            self.stats.reused_nodes += len(out)
        return out

    def _take_prefetch(self, state: SessionState) -> None:
        """Keep the answer to the session's prefetch as its latest tree, when it came and is newer (hold the
        lock)."""
        entry = state.prefetch
        if entry is None or not entry.done:
            return
        state.prefetch = None
        if entry.tree is not None and entry.generation == state.generation and entry.upto >= state.full_base:
            state.full, state.full_base = entry.tree, entry.upto

    def prefetch_request(self, state: SessionState, max_nodes: int, step_seconds: float,
                         plain_step_seconds: float = 0.0) -> tuple[pb.DraftRequest, Pending]:
        """The DraftRequest for the tree of the session's new context, not waited for: its answer is read at the
        next step (``waiting_prefetch``) and kept as the latest tree."""
        req, entry = self.draft_request(state, max_nodes, False, step_seconds, plain_step_seconds)
        with self._lock:
            entry.prefetch = True
            state.prefetch = entry
        return req, entry

    @staticmethod
    def waiting_prefetch(state: SessionState) -> Pending | None:
        """The session's prefetch, when its answer has not been read yet."""
        entry = state.prefetch
        return entry if entry is not None and not entry.done else None

    def reused(self, t0: int) -> None:
        """A reused step is over (its report posted): count its time."""
        with self._lock:
            self.stats.reuse_ns += perf_counter_ns() - t0

    def fetched(self, state: SessionState, entry: Pending, max_nodes: int, t0: int) -> DraftTree:
        """The engine's part of the tree the service answered with; the whole tree is kept for reuse."""
        tree = entry.tree if entry.tree is not None else EMPTY_TREE
        out = tree.prefix(self.budget(state, max_nodes)[0])
        with self._lock:
            self._keep_fetched(state, tree, entry.upto, len(out))
            self._count_fetches(1, len(out), perf_counter_ns() - t0)
        return out

    def empty(self, state: SessionState) -> DraftTree:
        """No draft this step (the service is away)."""
        with self._lock:
            state.full, state.full_base, state.last_kind = EMPTY_TREE, len(state.tokens), ""
            self.stats.steps += 1
            self.stats.empty_steps += 1
        return EMPTY_TREE

    def reset_stats(self) -> None:
        """Zero the statistics in place (a benchmark's warm-up is over)."""
        with self._lock:
            for name in asdict(self.stats):
                setattr(self.stats, name, 0)

    def snapshot(self, outages: int = 0) -> ClientStats:
        """A copy of the statistics."""
        with self._lock:
            return ClientStats(**{**asdict(self.stats), "outages": outages})


class LocalFigures:
    """What a client counted itself, shared by the sync and asyncio clients."""

    _book: SessionBook
    _backoff: Backoff
    _buffer: IngestBuffer

    def stats_local(self) -> ClientStats:
        """What this client did: steps, reused steps, latencies, outages, buffered requests."""
        return self._book.snapshot(self._backoff.outages)

    def reset_stats_local(self) -> None:
        """Zero the client's statistics (outages are counted on)."""
        self._book.reset_stats()

    @property
    def buffered(self) -> int:
        """Completed requests waiting for the service."""
        return len(self._buffer)

    @property
    def available(self) -> bool:
        """Whether the last attempt to reach the service succeeded (False while backing off after a failure)."""
        return not self._backoff.down
