"""The drafting core of one namespace: store, n-gram tables, acceptance model and live sessions."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from drafter_service.api.errors import AlreadyExists, InvalidArgument, NotFound
from drafter_service.api.tree import EMPTY_TREE, DraftTree, merge_trees
from drafter_service.core.acceptance import AcceptanceModel
from drafter_service.core.batch_steps import StepsOutcome, draft_steps
from drafter_service.core.batch_steps import available as batch_steps_available
from drafter_service.core.config import DrafterConfig
from drafter_service.core.model_drafts import ModelDrafts
from drafter_service.core.model_gate import ModelGate
from drafter_service.core.repeat_cache import RepeatCache
from drafter_service.core.session import BudgetPolicy, Confirmation, DraftSession
from drafter_service.core.tree_builder import BuildLimits, RowsSource, TableSource, build_tree
from store.ngram_table import FrozenNGramTable, LRUNGramTable, NativeLRUTable
from store.token_store import TokenStore

logger = logging.getLogger(__name__)

#: Longest interval between a session's steps that counts as an engine step (longer: the engine was idle).
MAX_STEP_INTERVAL = 5.0


class _LockedTable:
    """An n-gram table whose queries take the drafter's table lock (queries reorder leaders)."""

    def __init__(self, table: LRUNGramTable, lock: threading.Lock) -> None:
        self.table = table
        self.leader_len = table.leader_len
        self._lock = lock

    def query(self, leader: Sequence[int], limit: int | None = None) -> list[tuple[tuple[int, ...], int]]:
        with self._lock:
            return self.table.query(leader, limit)


class Drafter:
    """Drafts trees for sessions from every source and learns from each completed request.

    Lifecycle of a request: ``start`` (prompt) -> (``propose`` -> ``extend``)* -> ``end``, by session id, with
    every argument validated. The service, which validates requests itself and holds the session objects, calls
    ``correct``, ``draft`` and ``finish`` on a ``DraftSession`` instead. ``ingest`` adds a completed request
    without a session. ``rebuild`` refreshes the suffix index and is meant to run off the request path.

    With a ``draft_model``, each session also gets a CARD candidate cache grown by the model on its own thread;
    its best paths are merged into every draft while the ``model_gate`` finds that they pay (see ``ModelGate``).
    """

    def __init__(self, config: DrafterConfig | None = None, draft_model: ModelDrafts | None = None,
                 name: str = "") -> None:
        self.config = cfg = config or DrafterConfig()
        self.draft_model = draft_model
        gate = draft_model.settings.gate if draft_model is not None else "off"
        if not (cfg.use_session or cfg.use_store or cfg.use_dynamic or cfg.use_frozen):
            gate = "off"  # drafting from the model alone (``--sources none``): nothing for it to displace
        self.model_gate = None if gate == "off" else ModelGate(
            count_time=gate == "time", on_running=draft_model.set_running if draft_model else None, name=name)
        self._vocab_end = 0  # store end when the draft model's vocabulary was last chosen
        self.store = TokenStore(cfg.capacity, tail_tokens=cfg.tail_tokens)
        self.dynamic = LRUNGramTable(cfg.leader_len, cfg.follower_len, cfg.leader_capacity, cfg.follower_capacity)
        self.frozen: dict[str, FrozenNGramTable] = {}
        self.model = AcceptanceModel()
        self.repeats = RepeatCache(cfg.repeat_cache_tokens)
        self.sessions: dict[str, DraftSession] = {}
        self.policy = BudgetPolicy(cfg.adaptive_budget, cfg.min_nodes)
        self._table_lock = threading.Lock()
        # the native table reads int32 arrays as they are; the Python one takes lists of ints
        self._table_tokens = (lambda ids: ids) if NativeLRUTable is not None and isinstance(
            self.dynamic, NativeLRUTable) else (lambda ids: ids.tolist())
        self._sessions_lock = threading.Lock()
        self._batched = batch_steps_available(self)

    # -- validation ------------------------------------------------------------------------------------

    def tokens(self, values: Sequence[int] | np.ndarray, what: str, allow_empty: bool = True) -> np.ndarray:
        """Validate token ids against the vocabulary and return them as int32.

        Raises:
            InvalidArgument: on ids outside [0, vocab_size) or an empty array when not allowed.
        """
        if not isinstance(values, np.ndarray) and len(values) <= 256:  # the common small case, without numpy
            if not isinstance(values, (list, tuple)):  # e.g. a protobuf repeated field: a list is read fastest
                values = list(values)
            if not values:
                if not allow_empty:
                    raise InvalidArgument(f"{what} is empty")
                return np.zeros(0, dtype=np.int32)
            lo, hi = min(values), max(values)
            arr = None
        else:
            arr = np.asarray(values, dtype=np.int64).ravel()
            if not allow_empty and arr.size == 0:
                raise InvalidArgument(f"{what} is empty")
            if arr.size == 0:
                return arr.astype(np.int32)
            lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"{what} holds token id {bad} outside [0, {self.config.vocab_size})")
        return np.array(values, dtype=np.int32) if arr is None else arr.astype(np.int32)

    def session(self, session_id: str) -> DraftSession:
        """The live session ``session_id``.

        Raises:
            NotFound: when there is none.
        """
        found = self.sessions.get(session_id)
        if found is None:
            raise NotFound(f"unknown session {session_id!r}")
        return found

    # -- session lifecycle -----------------------------------------------------------------------------

    def start(self, session_id: str, prompt: Sequence[int] | np.ndarray, max_nodes: int = 0,
              fixed_budget: bool = False) -> DraftSession:
        """Open a session for a request; its prompt also teaches the dynamic table. With ``fixed_budget`` its
        trees keep the budget asked for (the policy's adaptation is off for it).

        Raises:
            AlreadyExists: when ``session_id`` is live.
            InvalidArgument: on bad token ids or budget.
        """
        ids = self.tokens(prompt, "prompt")
        if max_nodes < 0:
            raise InvalidArgument(f"max_nodes must be >= 0, got {max_nodes}")
        with self._sessions_lock:
            if session_id in self.sessions:
                raise AlreadyExists(f"session {session_id!r} already exists")
            policy = replace(self.policy, adaptive=False) if fixed_budget else self.policy
            sess = DraftSession(session_id, ids, max_nodes or self.config.max_nodes, self.model, policy)
            self.sessions[session_id] = sess
        if self.config.use_repeat:
            sess.repeat = self.repeats.lookup(ids)
        if self.draft_model is not None and ids.size:
            try:
                sess.card = self.draft_model.open(ids, name=f"card-{session_id}")
            except Exception:
                logger.exception("session %s: the draft model could not start; drafting without it", session_id)
        if self.config.use_dynamic:
            with self._table_lock:
                self.dynamic.update(self._table_tokens(ids))
        return sess

    def extend(self, session_id: str, accepted: Sequence[int] | np.ndarray) -> int:
        """Append the tokens the target accepted since the last call; returns draft tokens confirmed."""
        return self.correct(self.session(session_id), self.tokens(accepted, "accepted")).tokens

    def correct(self, sess: DraftSession, ids: np.ndarray) -> Confirmation:
        """The correction step of a live session: score its last draft against ``ids``, then append them.

        Args:
            sess: a session of this drafter.
            ids: (k,) int32 token ids already validated (see ``tokens``).
        """
        before = len(sess)
        if sess.repeat is not None:
            self._follow_repeat(sess, ids)
        if sess.card is not None and self.model_gate is not None and ids.size:
            self._score_model(sess, self.model_gate, ids)
        confirmed = sess.extend(ids)
        if sess.card is not None and ids.size and self.draft_model is not None:
            model_hit = sess.card.correct(ids)
            if model_hit is not None:
                self.draft_model.record_step(model_hit)
        if self.config.use_dynamic and ids.size:
            with self._table_lock:
                self.dynamic.update(self._table_tokens(sess.tokens[max(0, before - 8):]), new_from=min(before, 8))
        return confirmed

    @staticmethod
    def _score_model(sess: DraftSession, gate: ModelGate, ids: np.ndarray) -> None:
        """Give the model gate the last draft's shadow score and the session's step interval."""
        shadow, sess.model_shadow = sess.model_shadow, None
        if shadow is not None:
            free, merged, empty = shadow
            truth = ids.tolist()
            gate.record(_path_depth(merged, truth), _path_depth(free, truth), empty)
        now = time.monotonic()
        if sess.stepped_phase == gate.phase_id and now - sess.stepped_at < MAX_STEP_INTERVAL:
            gate.record_interval(now - sess.stepped_at, gate.running, gate.phase_id)
        sess.stepped_at, sess.stepped_phase = now, gate.phase_id

    def _follow_repeat(self, sess: DraftSession, ids: np.ndarray) -> None:
        """Score the last repeat branch against ``ids`` and keep following it while the output matches."""
        rep, pos = sess.repeat, sess.repeat_pos
        assert rep is not None
        expect = rep[pos:pos + ids.size]
        k = min(expect.size, ids.size)
        diff = np.flatnonzero(expect[:k] != ids[:k])
        matched = int(diff[0]) if diff.size else k
        if sess.repeat_offered:
            offered = min(sess.repeat_offered, ids.size)
            self.repeats.record(min(matched, offered), matched < offered)
            sess.repeat_offered = 0
        if matched == ids.size:
            sess.repeat_pos = pos + matched
        else:  # the output left the stored one (or outgrew it)
            sess.repeat = None

    def propose(self, session_id: str, max_nodes: int = 0) -> DraftTree:
        """Draft a tree for the session's current sequence (an empty tree when nothing is known)."""
        if max_nodes < 0:
            raise InvalidArgument(f"max_nodes must be >= 0, got {max_nodes}")
        return self.draft(self.session(session_id), max_nodes)

    def draft(self, sess: DraftSession, max_nodes: int = 0,
              cut: Callable[[DraftTree], DraftTree] | None = None) -> DraftTree:
        """Draft a tree for a live session within ``max_nodes`` (>= 0; 0: the session's default).

        ``cut`` is what the caller will do to the tree before the engine verifies it (the engine's cost cut): the
        model gate scores the trees with and without the draft model's nodes as each would have been cut.
        """
        cfg = self.config
        gate = self.model_gate
        if gate is not None and sess.card is not None:
            gate.tick()
        repeating = sess.repeat is not None
        budget = (max_nodes or sess.max_nodes) if repeating else sess.budget(max_nodes)
        tokens = sess.tokens
        if budget == 0 or tokens.size == 0:
            return EMPTY_TREE
        # A paused model whose nodes are not served has nothing to give this draft: its query and merge are skipped.
        card = sess.card
        model_tree = card.query(budget) if card is not None and (gate is None or gate.running or gate.serving) else (
            EMPTY_TREE)
        rows: list[RowsSource] = []
        if cfg.use_session:
            found = sess.lookup(cfg.max_match, cfg.max_occurrences, cfg.max_depth)
            if found.match_len:
                rows.append(RowsSource(0, found.match_len, found.rows))
        if cfg.use_store:
            found = self.store.lookup(tokens, cfg.max_match, cfg.max_occurrences, cfg.max_depth)
            if found.match_len:
                rows.append(RowsSource(1, found.match_len, found.rows))
        tables: list[TableSource] = []
        if cfg.use_dynamic:
            # The native table's methods run whole under the GIL; the Python one needs the lock.
            native = NativeLRUTable is not None and isinstance(self.dynamic, NativeLRUTable)
            dynamic = self.dynamic if native else _LockedTable(self.dynamic, self._table_lock)
            tables.append(TableSource(2, dynamic, cfg.table_branch))
        if cfg.use_frozen:
            tables.extend(TableSource(3, t, cfg.table_branch) for t in self.frozen.values())
        limits = BuildLimits(budget, cfg.max_depth, cfg.min_prob, cfg.branch)
        tree, evidence = build_tree(tokens[-cfg.leader_len:].tolist(), rows, tables, self.model, limits)
        served = merge_trees(tree, model_tree, budget) if len(model_tree) else tree
        if gate is not None and sess.card is not None:
            if gate.running:  # scored against the outcome; a paused worker's cache says nothing of the model
                sess.model_shadow = ((cut(tree), cut(served)) if cut else (tree, served)) + (not len(model_tree),)
            if not gate.serving:
                served = tree
        if sess.repeat is not None:
            branch = self.repeats.branch(sess.repeat, sess.repeat_pos, budget)
            if len(branch):
                served = merge_trees(branch, served, budget)
                sess.repeat_offered = _path_depth(served, branch.token_ids)
        sess.remember(tree, evidence, served)
        return served

    def batchable(self, sess: DraftSession) -> bool:
        """Whether ``draft_steps`` can take a step of ``sess`` (else ``correct`` and ``draft`` must)."""
        return self._batched and sess.batchable

    def draft_steps(self, sessions: Sequence[DraftSession], accepted: np.ndarray, offsets: list[int],
                    limits: list[int], report: list[bool]) -> StepsOutcome:
        """``correct`` then ``draft`` for each of many ``batchable`` sessions, in order, in one native call.

        See ``batch_steps.draft_steps`` for the arguments; the trees are the ones single calls would draft.
        """
        return draft_steps(self, sessions, accepted, offsets, limits, report)

    def end(self, session_id: str, accepted: Sequence[int] | np.ndarray = ()) -> DraftSession:
        """Close a session, appending its final tokens, and ingest prompt + output into the store."""
        sess = self.session(session_id)
        return self.finish(sess, self.tokens(accepted, "accepted"))

    def finish(self, sess: DraftSession, ids: np.ndarray, document: np.ndarray | None = None) -> DraftSession:
        """Close a live session after appending ``ids`` (validated), and store prompt + output.

        ``document`` (the session's tokens and ``ids``, already stored durably) is what the store takes instead of
        the session's tokens, so that a Draft call racing with the end cannot make memory differ from the durable
        log.

        Raises:
            NotFound: the session has already ended.
        """
        with self._sessions_lock:
            if sess.closed:
                raise NotFound(f"session {sess.session_id!r} has ended")
            sess.closed = True
            self.sessions.pop(sess.session_id, None)
        if ids.size:
            self.correct(sess, ids)
        self._close_card(sess)
        doc = sess.tokens if document is None else document
        self.store.append(doc)
        if self.config.use_repeat:
            self.repeats.remember(doc[:sess.prompt_len], doc[sess.prompt_len:])
        return sess

    def _close_card(self, sess: DraftSession) -> None:
        if sess.card is not None and self.draft_model is not None:
            self.draft_model.close(sess.card)
            sess.card = None

    def close(self) -> None:
        """Stop every session's draft model worker (the sessions stay open without it)."""
        with self._sessions_lock:
            live = list(self.sessions.values())
        for sess in live:
            self._close_card(sess)

    def document(self, prompt: Sequence[int] | np.ndarray, output: Sequence[int] | np.ndarray) -> np.ndarray:
        """Validate a completed request and return it as one int32 document (prompt + output).

        Raises:
            InvalidArgument: on bad token ids or an empty request.
        """
        doc = np.concatenate([self.tokens(prompt, "prompt"), self.tokens(output, "output")])
        if doc.size == 0:
            raise InvalidArgument("request has no tokens")
        return doc

    def add_document(self, doc: np.ndarray, learn: bool = True, prompt_len: int | None = None) -> None:
        """Store a validated document; ``learn`` also feeds it to the dynamic table.

        ``prompt_len`` (when known) splits it into prompt and output for the cache of repeated prompts.
        """
        if learn:
            self.learn(doc)
        self.store.append(doc)
        if prompt_len is not None and self.config.use_repeat:
            self.repeats.remember(doc[:prompt_len], doc[prompt_len:])

    def learn(self, doc: np.ndarray) -> None:
        """Feed a stored document to the dynamic table only (``add_document`` without storing it)."""
        if self.config.use_dynamic:
            with self._table_lock:
                self.dynamic.update(self._table_tokens(doc))

    def ingest(self, prompt: Sequence[int] | np.ndarray, output: Sequence[int] | np.ndarray) -> None:
        """Add a completed request that had no session (from an engine or a log)."""
        self.add_document(self.document(prompt, output), prompt_len=len(prompt))

    def add_frozen(self, name: str, table: FrozenNGramTable) -> None:
        """Install (or replace) a frozen table under ``name``."""
        if table.leader_len != self.config.leader_len:
            raise InvalidArgument(f"frozen table {name!r} has leaders of {table.leader_len} tokens, "
                                  f"expected {self.config.leader_len}")
        self.frozen = {**self.frozen, name: table}

    def remove_frozen(self, name: str) -> bool:
        """Stop drafting from frozen table ``name`` (drafts already running finish with it); False if none."""
        if name not in self.frozen:
            return False
        self.frozen = {k: t for k, t in self.frozen.items() if k != name}
        return True

    def rebuild(self) -> str | None:
        """Rebuild whichever suffix index is due (see ``TokenStore.rebuild``)."""
        done = self.store.rebuild()
        if done:
            self.refresh_draft_vocabulary()
        return done

    def refresh_draft_vocabulary(self, recent: int = 1 << 22) -> None:
        """Let the draft model's vocabulary follow the store's most frequent tokens (after it grew by a quarter)."""
        ring = self.store.ring
        if self.draft_model is None or not self.draft_model.settings.vocab or ring.end < 1.25 * self._vocab_end:
            return
        self._vocab_end = max(ring.end, 1)
        self.draft_model.set_frequencies(ring.read(max(ring.oldest, ring.end - recent), ring.end))

    def check_invariants(self) -> None:
        """Raise AssertionError when the store or the tables are inconsistent."""
        self.store.check_invariants()
        self.repeats.check_invariants()
        with self._table_lock:
            self.dynamic.check_invariants()


def _path_depth(tree: DraftTree, path: Sequence[int]) -> int:
    """How many leading tokens of ``path`` the tree holds as one branch from its root."""
    node, depth = -1, 0
    children = tree.children()
    for tok in path:
        node = children.get(node, {}).get(tok, -2)
        if node == -2:
            break
        depth += 1
    return depth
