"""The service behind the gRPC API: namespaces, session routing, limits, and start-up and shut-down."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from drafter_service.api.errors import InvalidArgument, NotFound
from drafter_service.api.names import DEFAULT_NAMESPACE, check_name
from drafter_service.api.tree import EMPTY_TREE, DraftTree, TokenIds
from drafter_service.api.verify_budget import StepCostCurve, best_prefix, cost_points_error
from drafter_service.core.batch_steps import StepsOutcome
from drafter_service.core.session import DraftSession
from drafter_service.namespaces.namespace import Namespace
from drafter_service.namespaces.stats import NamespaceStats
from drafter_service.service.auth import TRUSTED, Authorizer, Caller
from drafter_service.service.batch import BatchEnd, BatchOutcome, BatchStart, BatchStep, PackedSteps
from drafter_service.service.config import ServiceConfig
from drafter_service.service.session_routes import SessionRoutes
from store.persistence import RedisPersistence
from store.request_log import Duplicates

if TYPE_CHECKING:
    from store.frozen_table import FrozenNGramTable

logger = logging.getLogger(__name__)

_INT32 = np.dtype(np.int32)
_RunStep = tuple[DraftSession | None, Any, int, bool]
"""A step of a batch's run: (session, accepted ids, budget, report_only) to draft batched, or (None, its tree,
tokens confirmed, False) for one taken alone (or failed), whose tree is drawn already."""

PersistenceFactory = Callable[[str, int], RedisPersistence | None]
"""(namespace name, vocab size) -> a persistence object for it, or None for memory only."""


def cost_cut(curve: StepCostCurve, exponent: float) -> Callable[[DraftTree], DraftTree]:
    """A tree cut to the prefix that maximises the engine's expected tokens per second (``best_prefix``); the best
    node stays when drafting does not pay, for the engine to probe with when it chooses."""
    def cut(tree: DraftTree) -> DraftTree:
        if not len(tree):
            return tree
        return tree.prefix(max(1, best_prefix(tree.probs, curve, exponent=exponent, parents=tree.parents)))
    return cut


class DrafterService:
    """Every namespace of one service, and which namespace each live session belongs to."""

    def __init__(self, config: ServiceConfig, persistence: PersistenceFactory | None = None) -> None:
        self.config = config
        self.namespaces: dict[str, Namespace] = {}
        drafts = {}
        for model_spec in config.draft_models:  # loaded first: a bad model refuses to start with nothing opened
            # Imported here: torch loads only when a namespace has a draft model.
            from drafter_service.model.card import load_drafts

            ns_spec = config.namespace(model_spec.namespace)
            assert ns_spec is not None  # ServiceConfig refuses draft models of undeclared namespaces
            drafts[model_spec.namespace] = load_drafts(model_spec, ns_spec.vocab_size)
        for spec in config.namespaces:
            store = persistence(spec.name, spec.vocab_size) if persistence is not None else None
            self.namespaces[spec.name] = Namespace.create(spec.name, config.drafter, spec.vocab_size, store,
                                                          drafts.get(spec.name))
        self.auth = Authorizer(config.namespace_tokens, config.admin_token)
        self.sessions = SessionRoutes(config.max_sessions, config.max_sessions_per_client)

    # -- lifecycle ------------------------------------------------------------------------------------

    def restore(self) -> dict[str, int]:
        """Reload every namespace from persistence; returns requests restored per namespace."""
        restored = {}
        for name, ns in self.namespaces.items():
            t0 = time.perf_counter()
            restored[name] = ns.restore()
            logger.info("namespace %s: %d requests restored in %.2f s", name, restored[name],
                        time.perf_counter() - t0)
        return restored

    def close(self) -> None:
        """Stop the draft model workers of every namespace."""
        for ns in self.namespaces.values():
            ns.drafter.close()

    def snapshot(self) -> None:
        """Save every namespace's dynamic table and statistics (background job and shut-down)."""
        for ns in self.namespaces.values():
            try:
                ns.snapshot()
            except Exception:
                logger.exception("namespace %s: snapshot failed", ns.name)

    def rebuild_due(self) -> None:
        """Rebuild whichever suffix indexes are due (background job)."""
        for ns in self.namespaces.values():
            ns.rebuild()

    def save_index_files(self, behind: bool = False) -> None:
        """Write the index files that are due (background job), or with ``behind`` every one its namespace's indexes
        have outgrown (shut-down)."""
        for ns in self.namespaces.values():
            try:
                ns.save_index(behind)
            except Exception:
                logger.exception("namespace %s: the index file could not be written", ns.name)

    # -- routing --------------------------------------------------------------------------------------

    def namespace(self, name: str, caller: Caller | None = None) -> Namespace:
        """The namespace ``name`` ("" means default), when ``caller`` may use it (None: an in-process caller).

        Raises:
            InvalidArgument: a malformed name.
            Unauthenticated, PermissionDenied: the caller may not use it; an unknown namespace is refused the
                same way, so callers learn nothing of namespaces they may not use (see ``Authorizer``).
            NotFound: when it is not declared (and the caller may use every namespace).
        """
        name = name or DEFAULT_NAMESPACE
        found = self.namespaces.get(name)
        if found is None:
            try:
                check_name(name)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        self.auth.check(caller or TRUSTED, name, found is not None)
        if found is None:
            raise NotFound(f"unknown namespace {name!r}")
        return found

    def _check_tokens(self, tokens: TokenIds, what: str) -> None:
        if len(tokens) > self.config.max_request_tokens:
            raise InvalidArgument(f"{what} holds {len(tokens)} tokens, more than the limit "
                                  f"{self.config.max_request_tokens}")

    def _accepted(self, ns: Namespace, sess: DraftSession, session_id: str, accepted: TokenIds,
                  bounds: tuple[int, int] | None = None) -> np.ndarray:
        """``accepted`` (already within ``_check_tokens``) checked against the session's growth and the namespace's
        vocabulary, and converted to int32 once.

        ``bounds`` (least, greatest) holds every id of an int32 ``accepted`` when the caller knows it (a batch reads
        all its steps' tokens at once): within the vocabulary, the ids are not looked at one by one.

        Raises:
            InvalidArgument: an output beyond ``max_request_tokens``, or bad token ids.
        """
        grown = len(sess) - sess.prompt_len + len(accepted)
        if grown > self.config.max_request_tokens:
            raise InvalidArgument(f"session {session_id!r} would hold {grown} output tokens, more than the limit "
                                  f"{self.config.max_request_tokens}")
        if (bounds is not None and isinstance(accepted, np.ndarray) and accepted.dtype == np.int32
                and 0 <= bounds[0] and bounds[1] < ns.drafter.config.vocab_size):
            return accepted
        return ns.drafter.tokens(accepted, "accepted")

    @staticmethod
    def _check_step_times(step_seconds: float, plain_step_seconds: float) -> None:
        for name, value in (("step_seconds", step_seconds), ("plain_step_seconds", plain_step_seconds)):
            if not 0.0 <= value <= 3600.0:  # also refuses NaN
                raise InvalidArgument(f"{name} must be in [0, 3600], got {value}")

    def _check_budget(self, max_nodes: int) -> None:
        if max_nodes < 0 or max_nodes > self.config.max_nodes_limit:
            raise InvalidArgument(f"max_nodes must be in [0, {self.config.max_nodes_limit}], got {max_nodes}")

    # -- the API --------------------------------------------------------------------------------------

    def start_session(self, namespace: str, session_id: str, prompt: TokenIds, max_nodes: int = 0,
                      caller: Caller | None = None, fixed_budget: bool = False) -> Namespace:
        """Open a session in a namespace; its id is unique among the live sessions of the caller's scope.
        ``fixed_budget``: its trees keep the budget asked for (not shrunk while its drafts are rarely accepted)."""
        ns = self.namespace(namespace, caller)  # callers without rights learn nothing more
        if not session_id or len(session_id) > 256 or "\x00" in session_id:
            raise InvalidArgument("session_id must be 1 to 256 characters, without NUL")
        self._check_tokens(prompt, "prompt")
        self._check_budget(max_nodes)
        self.sessions.open(caller or TRUSTED, session_id, ns,
                           lambda key: ns.drafter.start(key, prompt, max_nodes, fixed_budget))
        return ns

    def draft(self, session_id: str, accepted: TokenIds, max_nodes: int = 0, report_only: bool = False,
              step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
              caller: Caller | None = None, cost_nodes: Sequence[float] = (),
              cost_seconds: Sequence[float] = (), estimate_exponent: float = 0.0) -> tuple[DraftTree, int]:
        """Correct the session with ``accepted`` and draft the next tree (none when ``report_only``).

        Everything is validated here, once; the layers below trust their arguments.

        ``step_seconds`` and ``plain_step_seconds`` are the engine's reported step times (0: not reported), each
        in [0, 3600]; they only feed the statistics. ``cost_nodes`` and ``cost_seconds`` are the engine's step
        time against draft nodes (points of its curve); given, the tree is cut to the prefix that maximises
        expected tokens per second by the namespace's acceptance estimates (``best_prefix``); when drafting does
        not pay, only the best node is left, which the engine verifies now and then to see whether it pays again.
        ``estimate_exponent`` (0: 1) is the engine's calibration of the estimates: the cut uses ``p ** exponent``.
        """
        self._check_step_times(step_seconds, plain_step_seconds)
        error = cost_points_error(cost_nodes, cost_seconds, estimate_exponent)
        if error:
            raise InvalidArgument(error)
        cut = cost_cut(StepCostCurve.from_points(cost_nodes, cost_seconds), estimate_exponent or 1.0) if len(
            cost_nodes) else None
        tree, confirmed = self._draft_step(session_id, accepted, max_nodes, report_only, step_seconds,
                                           plain_step_seconds, caller or TRUSTED, cut)
        return (cut(tree) if cut else tree), confirmed

    def _draft_step(self, session_id: str, accepted: TokenIds, max_nodes: int, report_only: bool,
                    step_seconds: float, plain_step_seconds: float, caller: Caller,
                    cut: Callable[[DraftTree], DraftTree] | None = None) -> tuple[DraftTree, int]:
        """``draft`` once the step times are known to be valid (a batch checks them once for all its steps)."""
        self._check_tokens(accepted, "accepted")
        self._check_budget(max_nodes)
        ns, sess = self.sessions.get(caller, session_id)  # another scope's session is NOT_FOUND
        ids = self._accepted(ns, sess, session_id, accepted)
        return ns.draft(sess, ids, max_nodes, report_only, step_seconds, plain_step_seconds, cut)

    def draft_batch(self, starts: Sequence[BatchStart], steps: Sequence[BatchStep], ends: Sequence[BatchEnd],
                    max_nodes: int = 0, step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
                    caller: Caller | None = None, accepted_bounds: tuple[int, int] | None = None,
                    packed: PackedSteps | None = None) -> BatchOutcome:
        """One engine step of many sessions: open ``starts``, draft for ``steps`` and then ``packed`` in order, then
        end ``ends``.

        Each item is handled exactly as ``start_session``, ``draft`` and ``end_session`` would handle it alone, and
        fails alone: the outcome keeps its error and the other items go on. ``max_nodes`` is the budget of every
        step that gives none; the step times are the engine's batched step, shared by every step.
        ``accepted_bounds``: (least, greatest) of every step's accepted ids when the caller knows them (steps
        given as int32 arrays are then checked against the vocabulary once, not id by id). Every step's tokens are
        recorded before the trees are drafted (see ``_batch_steps``).

        Raises:
            InvalidArgument: the call itself is malformed (a list longer than ``max_sessions``, a bad default
                budget or step time); nothing is done then.
        """
        for what, n in (("start", len(starts)), ("steps", len(steps)), ("end", len(ends))):
            if n > self.config.max_sessions:
                raise InvalidArgument(f"{n} items in {what}, more than the limit {self.config.max_sessions}")
        self._check_budget(max_nodes)
        self._check_step_times(step_seconds, plain_step_seconds)
        who = caller or TRUSTED
        out = BatchOutcome()
        for i, (namespace, session_id, prompt, budget, fixed) in enumerate(starts):
            try:
                self.start_session(namespace, session_id, prompt, budget, caller=who, fixed_budget=fixed)
            except Exception as exc:  # this item alone fails; the caller reports it
                out.start_errors.append((i, exc))
        if packed is not None and (steps or not self._packed_run(packed, max_nodes, step_seconds, plain_step_seconds,
                                                                  who, out, accepted_bounds)):
            steps = [*steps, *packed.steps()]
        if steps:
            self._batch_steps(steps, max_nodes, step_seconds, plain_step_seconds, who, out, accepted_bounds)
        for i, (session_id, accepted) in enumerate(ends):
            try:
                out.stored.append(self.end_session(session_id, accepted, caller=who))
            except Exception as exc:
                out.stored.append(0)
                out.end_errors.append((i, exc))
        return out

    def _batch_steps(self, steps: Sequence[BatchStep], max_nodes: int, step_seconds: float,
                     plain_step_seconds: float, caller: Caller, out: BatchOutcome,
                     bounds: tuple[int, int] | None = None) -> None:
        """The steps of a batch, each as ``_draft_step`` would take it, their trees in the steps' order: the steps of
        sessions their drafter can batch gather into a run per namespace, drafted by ``Namespace.draft_steps`` in
        one native call (every session of the run corrected, then each drafted); the others are taken one by one
        as they come, before the run they sit in. A session named again, or another namespace, ends the run."""
        run: list[_RunStep] = []
        run_ns: Namespace | None = None
        in_run: set[int] = set()  # ids of the run's sessions: a session drafted twice starts a new run
        most, widest, get = self.config.max_request_tokens, self.config.max_nodes_limit, self.sessions.get
        trusted: Namespace | None = None  # a namespace whose vocabulary holds ``bounds``
        for i, (session_id, accepted, budget, report_only) in enumerate(steps):
            try:
                budget = budget or max_nodes
                if len(accepted) > most or not 0 <= budget <= widest:  # refused: with the single path's error
                    self._check_tokens(accepted, "accepted")
                    self._check_budget(budget)
                ns, sess = get(caller, session_id)
                if id(sess) in in_run or (run_ns is not None and ns is not run_ns):  # its first step goes in first,
                    self._flush_steps(run_ns, run, step_seconds, plain_step_seconds, out)  # so that its growth counts
                    run, run_ns = [], None
                    in_run.clear()
                if (ns is trusted and type(accepted) is np.ndarray and accepted.dtype is _INT32
                        and len(sess) - sess.prompt_len + accepted.size <= most):
                    ids = accepted  # what ``_accepted`` would return, without its checks one by one
                else:
                    ids = self._accepted(ns, sess, session_id, accepted, bounds)
                    if bounds is not None and 0 <= bounds[0] and bounds[1] < ns.drafter.config.vocab_size:
                        trusted = ns
            except Exception as exc:
                out.step_errors.append((i, exc))
                run.append((None, EMPTY_TREE, 0, False))
                continue
            if ns.drafter.batchable(sess):
                run.append((sess, ids, budget, report_only))
                run_ns = ns
                in_run.add(id(sess))
                continue
            try:
                tree, confirmed = ns.draft(sess, ids, budget, report_only, step_seconds, plain_step_seconds)
            except Exception as exc:
                tree, confirmed = EMPTY_TREE, 0
                out.step_errors.append((i, exc))
            run.append((None, tree, confirmed, False))
        self._flush_steps(run_ns, run, step_seconds, plain_step_seconds, out)

    def _packed_run(self, packed: PackedSteps, max_nodes: int, step_seconds: float, plain_step_seconds: float,
                    caller: Caller, out: BatchOutcome, bounds: tuple[int, int] | None) -> bool:
        """A batch's packed steps as one run, as ``_batch_steps`` would take them, when nothing in them asks for more
        (every session live and distinct, of one namespace; every budget, token id and session's growth within its
        limits): without a step object per session. False, having done nothing, otherwise."""
        get, cfg = self.sessions.get, self.config
        try:
            routes = [get(caller, sid) for sid in packed.sessions]
        except NotFound:
            return False
        ns = routes[0][0]
        if bounds is not None and not (0 <= bounds[0] and bounds[1] < ns.drafter.config.vocab_size):
            return False
        budgets = [b or max_nodes for b in packed.budgets] if max_nodes else packed.budgets
        if min(budgets) < 0 or max(budgets) > cfg.max_nodes_limit:
            return False
        most, offsets, batchable = cfg.max_request_tokens, packed.offsets, ns.drafter.batchable
        sessions, apart = [], []  # apart: the steps of sessions the core cannot batch, taken alone
        for i, (route_ns, sess) in enumerate(routes):
            if route_ns is not ns or len(sess) - sess.prompt_len + offsets[i + 1] - offsets[i] > most:
                return False
            sessions.append(sess)
            if not batchable(sess):
                apart.append(i)
        if len(set(map(id, sessions))) < len(sessions):
            return False
        tokens, report = packed.tokens, packed.report
        alone = []
        for i in apart:
            try:
                tree, confirmed = ns.draft(sessions[i], tokens[offsets[i]:offsets[i + 1]], budgets[i], report[i],
                                           step_seconds, plain_step_seconds)
            except Exception as exc:
                tree, confirmed = EMPTY_TREE, 0
                out.step_errors.append((i, exc))
            alone.append((i, tree, confirmed))
        taken_apart = set(apart)
        keep = [i for i in range(len(sessions)) if i not in taken_apart]
        if apart and keep:  # the batched sessions' tokens, stretch by stretch
            bounds_of = [(offsets[i], offsets[i + 1]) for i in keep]
            tokens = np.concatenate([tokens[lo:hi] for lo, hi in bounds_of])
            offsets = [0, *itertools.accumulate(hi - lo for lo, hi in bounds_of)]
            report = [report[i] for i in keep]
        limits = [budgets[i] or sessions[i].max_nodes for i in keep]
        done = ns.draft_steps([sessions[i] for i in keep], tokens, offsets, limits, report, step_seconds,
                              plain_step_seconds) if keep else None
        self._add_run(out, done, alone, len(sessions))
        return True

    @classmethod
    def _flush_steps(cls, ns: Namespace | None, run: list[_RunStep], step_seconds: float, plain_step_seconds: float,
                     out: BatchOutcome) -> None:
        """Draft a run's batchable steps of ``ns`` in one call, then append every tree of the run to ``out`` in
        order (the steps taken alone, and the failed ones, hold theirs already)."""
        batched = [step for step in run if step[0] is not None]
        alone = [(i, tree, confirmed) for i, (sess, tree, confirmed, _) in enumerate(run) if sess is None]
        done = None
        if batched:
            assert ns is not None
            arrays = [ids for _, ids, _, _ in batched]
            done = ns.draft_steps([sess for sess, *_ in batched], np.concatenate(arrays) if len(arrays) > 1  # type: ignore[misc]
                                  else arrays[0], [0, *itertools.accumulate(a.size for a in arrays)],
                                  [budget or sess.max_nodes for sess, _, budget, _ in batched],  # type: ignore[union-attr]
                                  [r for *_, r in batched], step_seconds, plain_step_seconds)
        cls._add_run(out, done, alone, len(run))

    @staticmethod
    def _add_run(out: BatchOutcome, done: StepsOutcome | None, alone: list[tuple[int, DraftTree, int]],
                 total: int) -> None:
        """Append a run's ``total`` trees to ``out`` in order: those of ``alone`` (position, tree, confirmed) at their
        place, and between them the batched outcome ``done``'s, one after another."""
        if done is None:
            for _, tree, confirmed in alone:
                out.add_tree(tree, confirmed)
            return
        nodes = (done.token_ids, done.parents, done.probs, done.kinds + np.uint8(1))  # kind -> Source number
        if not alone:
            out.add_trees(done.offsets, nodes, done.confirmed)
            return

        def add_batched(lo: int, hi: int) -> None:  # batched steps lo .. hi - 1, as one block
            if hi > lo:
                a, b = done.offsets[lo], done.offsets[hi]
                out.add_trees([o - a for o in done.offsets[lo:hi + 1]], tuple(c[a:b] for c in nodes),  # type: ignore[arg-type]
                              done.confirmed[lo:hi])

        start = 0  # batched steps appended before ``start``
        for taken, (pos, tree, confirmed) in enumerate(alone):
            add_batched(start, pos - taken)
            out.add_tree(tree, confirmed)
            start = pos - taken
        add_batched(start, total - len(alone))

    def end_session(self, session_id: str, accepted: TokenIds, caller: Caller | None = None) -> int:
        """Store the request durably and close its session; returns the tokens stored."""
        self._check_tokens(accepted, "accepted")
        ns, sess = self.sessions.get(caller or TRUSTED, session_id)
        stored = ns.end_session(sess, self._accepted(ns, sess, session_id, accepted), request_id=session_id)
        self.sessions.close(caller or TRUSTED, session_id)
        return stored

    def ingest(self, namespace: str, requests: Sequence[tuple[TokenIds, TokenIds, str]],
               skip_duplicates: Duplicates | bool = False, caller: Caller | None = None) -> tuple[int, int, int]:
        """Store completed requests durably; returns (requests stored, tokens, duplicates skipped).

        With ``skip_duplicates`` a request already stored (same request id, or same prompt and output; with
        ``Duplicates.SKIP_SAME_ID`` same request id only) is left out.
        """
        ns = self.namespace(namespace, caller)
        if not requests:
            raise InvalidArgument("no requests to ingest")
        if len(requests) > self.config.max_ingest_requests:
            raise InvalidArgument(f"{len(requests)} requests in one call, more than the limit "
                                  f"{self.config.max_ingest_requests}")
        for i, (prompt, output, _) in enumerate(requests):
            self._check_tokens(prompt, f"request {i} prompt")
            self._check_tokens(output, f"request {i} output")
        return ns.ingest(requests, skip_duplicates)

    def stats(self, namespace: str, caller: Caller | None = None) -> NamespaceStats:
        """GetStats figures of one namespace."""
        return self.namespace(namespace, caller).stats()

    def put_frozen(self, namespace: str, name: str, table: FrozenNGramTable, source: str = "",
                   caller: Caller | None = None) -> dict:
        """Store a frozen table durably and draft from it (replacing one of that name); returns its header."""
        return self.namespace(namespace, caller).frozen_tables.put(name, table, source)

    def list_frozen(self, namespace: str, caller: Caller | None = None) -> list[dict]:
        """Headers of a namespace's frozen tables, by name."""
        return self.namespace(namespace, caller).frozen_tables.list()

    def remove_frozen(self, namespace: str, name: str, caller: Caller | None = None) -> bool:
        """Delete a frozen table and stop drafting from it; False when there was none."""
        return self.namespace(namespace, caller).frozen_tables.remove(name)
