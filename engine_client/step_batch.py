"""One engine step of many sessions in one DraftBatch call: the bookkeeping both clients share."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter_ns

import grpc
import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.tree import DraftTree
from engine_client.client_common import CALLER_ERRORS, Backoff, DrafterRequestError, check_tokens, rpc_code
from engine_client.draft_reuse import Pending, SessionBook, SessionState, trees_of_batch

CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
"""gRPC status code names by number (DraftBatch reports an item's failure with the number)."""


@dataclass
class StepBatch:
    """The sessions of one engine step: what each recorded, and its tree once known (None: still to fetch)."""

    states: list[SessionState]
    recorded: list[list[int]]
    trees: list[DraftTree | None]
    reports: list[int]  # steps served from an earlier tree: their new trees ride along with the first fetch
    reused: bool  # some session's tree is a reused subtree
    t0: int = field(default_factory=perf_counter_ns)


@dataclass(frozen=True)
class PackedBatch:
    """Every session's tree of a step as flat arrays, as a DraftBatch reply carries them: tree ``i`` is nodes
    ``offsets[i]`` to ``offsets[i + 1] - 1`` of ``token_ids``, ``parents`` (local to the tree, -1 for a child of
    the root) and ``probs``."""

    offsets: np.ndarray
    token_ids: np.ndarray
    parents: np.ndarray
    probs: np.ndarray

    @classmethod
    def of_trees(cls, trees: Sequence[DraftTree]) -> PackedBatch:
        """DraftTrees one after another."""
        offsets = np.zeros(len(trees) + 1, np.int64)
        np.cumsum([len(t) for t in trees], out=offsets[1:])
        flat = itertools.chain.from_iterable
        return cls(offsets, np.array(list(flat(t.token_ids for t in trees)), np.int64),
                   np.array(list(flat(t.parents for t in trees)), np.int64),
                   np.array(list(flat(t.probs for t in trees)), np.float64))

    def tree(self, i: int) -> DraftTree:
        """Tree ``i`` as a DraftTree (without sources, which the arrays do not carry)."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        probs = tuple(self.probs[lo:hi].tolist())
        return DraftTree(tuple(self.token_ids[lo:hi].tolist()), tuple(self.parents[lo:hi].tolist()), probs,
                         float(sum(probs)))


@dataclass
class BatchCall:
    """One DraftBatch request and what it stands for."""

    request: pb.DraftBatchRequest
    starts: list[int]  # the session (index in the batch) of each start
    entries: list[tuple[int, Pending]]  # the session and pending record of each step


def begin(book: SessionBook, items: Sequence[tuple[str, Sequence[int]]], max_nodes: int, step_seconds: float,
          plain_step_seconds: float) -> StepBatch:
    """Check every item, then record each session's tokens and reuse what can be reused.

    Raises:
        DrafterRequestError: an unknown or repeated session, bad token ids, budget or step time (nothing recorded).
    """
    t0 = perf_counter_ns()
    sessions, accepted = zip(*items, strict=True) if items else ((), ())
    states = book.get_all(sessions)
    if len(set(map(id, states))) != len(states):
        raise DrafterRequestError("a session appears twice in one batch")
    recorded = book.record_all(states, accepted, step_seconds, max_nodes, plain_step_seconds)
    trees: list[DraftTree | None] = ([book.try_reuse(state, max_nodes) for state in states] if book.reuse
                                     else [None] * len(states))
    reports = [i for i, tree in enumerate(trees) if tree is not None and book.can_report(states[i])]
    return StepBatch(states, recorded, trees, reports, any(tree is not None for tree in trees), t0)


def next_call(book: SessionBook, batch: StepBatch, namespace: str, max_nodes: int, step_seconds: float,
              plain_step_seconds: float) -> BatchCall | None:
    """The DraftBatch request for what is still to fetch (None: nothing), opening sessions the service lacks."""
    todo = [i for i, tree in enumerate(batch.trees) if tree is None]
    if not todo:  # prefetches ride along with fetches only; otherwise their tokens go with the next call
        return None
    starts, start_requests = [], []
    for i in todo:
        state = batch.states[i]
        if book.needs_open(state):
            request, n, reopened = book.start_request(state, namespace)
            starts.append(i)
            start_requests.append(request)
            book.opened(state, n, reopened)  # taken back when the service refuses the start
    order = [*batch.reports, *todo]
    prefetch = len(batch.reports)
    batch.reports = []
    sessions, tokens, counts, asks, pending = book.next_steps([batch.states[i] for i in order], max_nodes,
                                                              [False] * len(order), prefetch)
    return BatchCall(pb.DraftBatchRequest(start=start_requests, step_seconds=step_seconds,
                                          plain_step_seconds=plain_step_seconds, packed_sessions=sessions,
                                          packed_tokens=np.array(tokens, "<i4").tobytes(), packed_counts=counts,
                                          packed_max_nodes=asks),
                     starts, list(zip(order, pending, strict=True)))


def check_ends(book: SessionBook, ends: Sequence[tuple[str, Sequence[int]]],
               items: Sequence[tuple[str, Sequence[int]]]) -> tuple[list[SessionState], list[list[int]]]:
    """The sessions to end in a step's call and their last tokens, checked (nothing recorded).

    Raises:
        DrafterRequestError: an unknown session, one that ends twice or is also one of ``items``, or bad token ids.
    """
    states = [book.get(session) for session, _ in ends]
    ending = {session for session, _ in ends}
    if len(ending) != len(ends) or any(session in ending for session, _ in items):
        raise DrafterRequestError("a session ends twice in one batch, or both drafts and ends")
    return states, [check_tokens(accepted, book.vocab_size, "accepted") for _, accepted in ends]


def add_ends(book: SessionBook, call: BatchCall, states: Sequence[SessionState]) -> list[SessionState]:
    """Put the EndSession of every session in ``states`` that the service holds in step into ``call`` (after its
    steps, as the service takes them); returns those sessions, in the order of the call's ``end``."""
    sent = [state for state in states if book.can_report(state)]
    call.request.end.extend(book.end_request(state) for state in sent)
    return sent


def ends_settled(book: SessionBook, sent: Sequence[SessionState], reply: pb.DraftBatchResponse | None
                 ) -> tuple[list[SessionState], list[str]]:
    """Close the sessions a call ended (``reply`` None: the call got no answer).

    Returns:
        The sessions whose request is to go by Ingest (the service lost the session, or the call got no answer and
        may or may not have stored it), and why the service refused the others that failed (the caller's fault:
        retrying cannot help).
    """
    errors = {e.index: e for e in reply.end_errors} if reply is not None else {}
    resend: list[SessionState] = []
    refused: list[str] = []
    for i, state in enumerate(sent):
        book.close(state)
        error = errors.get(i)
        if reply is not None and error is None:
            continue
        if error is not None and CODE_NAMES.get(error.code, "UNKNOWN") in CALLER_ERRORS:
            refused.append(error.message)
        else:
            resend.append(state)
    return resend, refused


def call_failed(book: SessionBook, backoff: Backoff, call: BatchCall, exc: grpc.RpcError) -> None:
    """The whole call got no answer: every step in it failed (surely not applied when the caller was at fault),
    and the service counts as away."""
    code, details = rpc_code(exc)
    for _, entry in call.entries:
        book.failed(entry, code, details, definite=code in CALLER_ERRORS)
    backoff.failure(f"{code}: {details}")


def answers_whole(book: SessionBook, batch: StepBatch, call: BatchCall, reply: pb.DraftBatchResponse) -> bool:
    """Whether ``reply`` gave every session of ``batch`` its tree in one go (no reuse, no refusal, one tree per
    session), so that it can be taken as flat arrays (``take_packed``). Without reuse no session is served from an
    earlier tree, so a call for every session asks in the batch's order (``next_call``)."""
    return (not book.reuse and not reply.step_errors and not reply.start_errors
            and len(call.entries) == len(batch.states) == len(reply.tree_offsets) - 1)


def take_packed(book: SessionBook, backoff: Backoff, batch: StepBatch, call: BatchCall,
                reply: pb.DraftBatchResponse) -> PackedBatch:
    """Take in a reply that ``answers_whole``: its arrays as they came, each session's step settled."""
    backoff.success()
    offsets = np.asarray(reply.tree_offsets, np.int64)
    book.answered_packed([entry for _, entry in call.entries], np.diff(offsets).tolist(), batch.t0)
    n = int(offsets[-1])
    return PackedBatch(offsets, np.frombuffer(reply.token_ids, "<i4", n), np.frombuffer(reply.parents, "<i4", n),
                       np.frombuffer(reply.probs, "<f4", n))


def took(book: SessionBook, backoff: Backoff, batch: StepBatch, call: BatchCall, reply: pb.DraftBatchResponse,
         max_nodes: int) -> bool:
    """Take in a DraftBatch reply (see ``answered``) and tell the backoff; False when the service is down.

    Raises:
        DrafterRequestError: as ``answered``.
    """
    backoff.success()
    down = answered(book, batch, call, reply, max_nodes)
    if down is not None:
        backoff.failure(f"{down.code}: {down.details}")
    return down is None


def answered(book: SessionBook, batch: StepBatch, call: BatchCall, reply: pb.DraftBatchResponse,
             max_nodes: int) -> Pending | None:
    """Take in a DraftBatch reply: trees for the steps that got one, failures for the others.

    Returns:
        The pending record of a step whose failure means the service is down (None when it is not).

    Raises:
        DrafterRequestError: the service refused a step as the caller's fault (that step's tokens are taken back).
    """
    for error in reply.start_errors:
        book.open_refused(batch.states[call.starts[error.index]], CODE_NAMES.get(error.code, "UNKNOWN"))
    trees = trees_of_batch(reply)
    if not reply.step_errors:  # every step answered: settled at once
        if len(trees) == len(call.entries):
            for (i, _), tree in zip(call.entries, book.answered_all([e for _, e in call.entries], trees, max_nodes,
                                                                     batch.t0), strict=True):
                if tree is not None:
                    batch.trees[i] = tree
            return None
    errors = {e.index: e for e in reply.step_errors}
    for k, ((_, entry), tree) in enumerate(zip(call.entries, trees, strict=True)):
        if k not in errors:
            book.answered(entry, tree)
        else:
            book.failed(entry, CODE_NAMES.get(errors[k].code, "UNKNOWN"), errors[k].message, culprit=True,
                        definite=True)
    for i, entry in call.entries:  # a second pass: every step is settled before one may raise
        if entry.report or entry.prefetch:
            continue
        action = book.action(entry, len(batch.recorded[i]))
        if action == "done":
            batch.trees[i] = book.fetched(batch.states[i], entry, max_nodes, batch.t0)
        elif action == "down":
            return entry
    return None


def finish(book: SessionBook, batch: StepBatch) -> list[DraftTree]:
    """Every session's tree: what was reused or fetched, EMPTY_TREE for the rest."""
    out = [book.empty(state) if tree is None else tree for state, tree in zip(batch.states, batch.trees,
                                                                               strict=True)]
    if batch.reused:
        book.reused(batch.t0)
    return out
