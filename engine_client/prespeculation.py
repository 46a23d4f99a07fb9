"""Pre-speculation: every running request's next chain is ready before the engine asks (Saguaro's idea).

While the engine verifies step t, the service drafts a tree for each request's context as of step t, deeper than
one chain and with siblings where the verification may turn. At step t+1 the engine reports the outcome (the
accepted draft tokens, then its own token); the chain is cut from that tree below the outcome, without touching the
network (a hit). The step's tokens go to the service from a background thread (``DraftSender``), and its answer
lands while the engine runs the next forward pass.

On a miss (the outcome left the tree, or it has no tree yet) one rule decides between no draft and waiting for the
step's own answer: wait while the missed rows' expected accepted tokens are worth the wait, measured against the
engine's step time. A breaker stops all waiting once a wait ends without its answer; it closes after an answer has
landed again (the sender keeps sending in the background, so an outage costs one wait, not one per probe) and a
backoff that grows while waits keep ending late.
Before the rule, a missed row gets a chain from prompt lookup over its own context (``ContextNgrams``) where its
last token occurred before: in process, so the rows the rule weighs are those nothing local can draft.

Engines that verify trees call ``step_trees`` instead of ``step``: the same bookkeeping, lookups and wait rule, with
each row's best-first subtree below its outcome in place of the chain (``PackedTrees.subtree``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from drafter_service.api.backoff import BackoffClock, ExponentialBackoff
from drafter_service.api.tree import EMPTY_TREE, DraftTree
from drafter_service.api.tree import chain as chain_tree
from engine_client.client import DrafterClient
from engine_client.draft_sender import Chore, DraftSender, Ended, Item, Landed, Opened, Stepped, Tracked
from engine_client.packed_trees import PackedTrees

logger = logging.getLogger(__name__)

__all__ = ["PreSpeculator", "PreSpeculationFigures", "Tracked"]

#: Estimate of a prompt-lookup chain's first token by the length of its match (1, 2, 3 tokens), each next token's
#: LOOKUP_DECAY times the one before (the chance each is reached), for a verify budget to weigh: a prior that the
#: budget's calibration corrects.
LOOKUP_FIRST = {1: 0.2, 2: 0.35, 3: 0.5}
LOOKUP_DECAY = 0.8

#: Weight of the newest measurement in the running means of step time, round trip and accepted tokens.
EMA = 0.2

Chains = tuple[list[list[int]], list[list[float]]]
"""Per row: the chain's tokens, and each token's estimate given the row's context."""


_TABLED = 64  # chain lengths whose lookup estimates come from the table below
#: ``lookup_estimates`` up to ``_TABLED`` tokens, by match length (sliced per chain: after an engine's pause even a
#: short list comprehension costs a step several µs)
_LOOKUP_ESTIMATES = {match: [first * LOOKUP_DECAY ** j for j in range(_TABLED)]
                     for match, first in LOOKUP_FIRST.items()}


def lookup_estimates(match: int, length: int) -> list[float]:
    """Estimates of a prompt-lookup chain of ``length`` tokens whose match was ``match`` tokens long."""
    if length <= _TABLED:
        return _LOOKUP_ESTIMATES[match][:length]
    first = LOOKUP_FIRST[match]
    return [first * LOOKUP_DECAY ** j for j in range(length)]


@dataclass
class PreSpeculationFigures:
    """What pre-speculation did: hits and misses per row, waits per step, and the times the wait rule uses."""

    hits: int = 0  # rows whose chain (or subtree) came from a tree drafted earlier, without the network
    misses: int = 0  # rows that wanted a chain (or subtree) but their tree held none below what they appended
    waits: int = 0  # steps that waited for their own answer
    late: int = 0  # waits that ended without the answer (the breaker opened)
    looked_up: int = 0  # missed rows given a chain by prompt lookup over their own context
    answers: int = 0  # DraftBatch answers that landed
    step_seconds: float = 0.0  # running mean of the engine's step (between calls)
    round_trip_seconds: float = 0.0  # running mean of a DraftBatch round trip
    accepted_per_chain: float = 1.0  # running mean of tokens accepted per chain proposed


class PreSpeculator:
    """Chains for many running requests, cut from trees drafted one step ahead.

    ``open`` returns a handle per request. Each ``step`` reports every row's new tokens and returns its chain;
    everything that costs runs on the sender's thread, which starts when the engine calls ``release`` (after its
    step's own work) and starts nothing of its own between a ``step`` and the next ``release`` (an answer that comes
    back then lands after it), so the two threads do not take turns on the interpreter lock in the middle of a step.

    Args:
        client: a drafter client, for the sender's thread alone.
        k: most tokens per chain (the engine's speculative length).
        max_nodes: nodes per tree asked for (deeper than ``k``, so the chain after the next outcome is in it).
        min_prob: a chain token estimated below this ends the chain.
        timeout: the longest wait for a step's answer.
        prespeculate: False waits for every step's answer and cuts chains from the fresh trees (the synchronous
            proposer, for comparison).
        history: most tokens followed down an earlier tree (default ``4 * k + 8``).
        clock: seconds, for the step times.
    """

    def __init__(self, client: DrafterClient, k: int, max_nodes: int, min_prob: float = 0.0, timeout: float = 0.1,
                 prespeculate: bool = True, history: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.k, self.min_prob, self.timeout, self.prespeculate = k, min_prob, timeout, prespeculate
        self.history = history or 4 * k + 8
        self.clock = clock
        self.figures = PreSpeculationFigures()
        self.refused = ""  # the service's refusal of this engine's tokens ("" while none)
        self._landed = threading.Condition()
        self._answered = -1  # the last ticket whose answer landed
        self._failed = -1  # the last ticket the service did not answer
        self._late = -1  # the ticket of the last wait that ended without its answer
        self._ticket = -1
        self._breaker = BackoffClock(ExponentialBackoff(0.1, 5.0))
        self._last_step = 0.0
        self._last_batch: tuple[int, ...] = ()
        self._queued: list[Item] = []  # what happened since the last ``release``, handed to the sender then
        self._sender = DraftSender(client, max_nodes, self._land, self._refuse, k, min_prob)

    # -- the engine's thread -------------------------------------------------------------------------------

    def open(self, prompt: Sequence[int], draft: bool = False) -> Tracked:
        """A new request with its prompt (its context so far); returns its handle.

        Args:
            prompt: the request's tokens so far.
            draft: also ask for the prompt's own tree in the next call (the engine's first step appends nothing:
                ``release`` now, and the tree is drafted while the engine prefills); otherwise the first tree is
                that of the request's first step.
        """
        req = Tracked(list(prompt[-self.history:]), len(prompt))
        if draft:
            self._ticket += 1
            self._queued.append(Opened(req, list(prompt), self._ticket))
        else:
            self._queued.append(Opened(req, list(prompt)))
        return req

    def close(self, req: Tracked) -> None:
        """The request finished: its session ends (the service stores it) once ``release`` is called."""
        self._queued.append(Ended(req))

    def step(self, reqs: Sequence[Tracked], new: Sequence[list[int]], max_lengths: Sequence[int]) -> Chains:
        """Record each row's new tokens and return its chain for the new context.

        Args:
            reqs: each row's request.
            new: tokens each row appended since its last step (accepted draft tokens and the target's own).
            max_lengths: most chain tokens per row (0: no chain wanted).
        """
        self._sender.hold()
        fig = self.figures
        ticket = self._record(reqs, new, True)
        tokens: list[list[int]] = []
        probs: list[list[float]] = []
        if self.prespeculate:
            from_trees = missed = looked_up = 0
            cut = self._cut
            chain: list[int]
            estimates: list[float]
            for req, max_len in zip(reqs, max_lengths, strict=True):
                if max_len <= 0:
                    chain, estimates = [], []
                else:
                    chain, estimates = cut(req, req.landed, max_len)
                    if not chain and req.earlier[1] is not None:  # the last chain was often cut from that one
                        chain, estimates = cut(req, req.earlier, max_len)
                    if chain:
                        from_trees += 1
                    else:  # prompt lookup over its own context, before the wait rule weighs it
                        missed += 1
                        chain, match = req.ngrams.chain(req.recent, max_len)
                        if chain:
                            estimates = lookup_estimates(match, len(chain))
                            looked_up += 1
                req.proposed = len(chain)
                tokens.append(chain)
                probs.append(estimates)
            fig.hits += from_trees
            fig.misses += missed
            fig.looked_up += looked_up
            hits, missed = from_trees + looked_up, missed - looked_up  # with a chain, from a tree or a lookup
        else:
            for req in reqs:
                req.proposed = 0
                tokens.append([])
                probs.append([])
            hits, missed = 0, sum(1 for m in max_lengths if m > 0)
        if missed and self._waited(ticket, missed, len(reqs), hits):
            fresh, fresh_probs = self._lookup(reqs, max_lengths)  # drafted for this very context
            for i, chain in enumerate(fresh):
                if chain:
                    tokens[i], probs[i] = chain, fresh_probs[i]
                    reqs[i].proposed = len(chain)
        self._last_step = self.clock()
        return tokens, probs

    def step_trees(self, reqs: Sequence[Tracked], new: Sequence[list[int]], max_nodes: Sequence[int]
                   ) -> list[DraftTree]:
        """``step`` for engines that verify trees: record each row's new tokens and return its subtree for the new
        context (EMPTY_TREE: none).

        A row's tree is the best-first subtree below what it appended since the latest tree that landed for it (or
        the one before), cut to its ``max_nodes`` with estimates given its new context; a missed row may get a chain
        by prompt lookup, then the wait rule weighs the rest, as in ``step``. A step where no row appended anything
        (an engine's first step after ``open(prompt, draft=True)``) queues nothing: its wait is for the last call's
        answer (the prompt's tree).

        Args:
            reqs: each row's request.
            new: tokens each row appended since its last step (accepted draft tokens and the target's own).
            max_nodes: most nodes per row (0: no tree wanted).
        """
        self._sender.hold()
        fig = self.figures
        ticket = self._record(reqs, new, any(new))
        if self.prespeculate:
            trees = self._lookup_trees(reqs, max_nodes)
            from_trees = sum(1 for t in trees if t)
            missed = sum(1 for t, m in zip(trees, max_nodes, strict=True) if not t and m > 0)
            fig.hits += from_trees
            fig.misses += missed
            looked_up = self._look_up_missing_trees(reqs, max_nodes, trees) if missed else 0
            hits, missed = from_trees + looked_up, missed - looked_up
        else:
            trees = [EMPTY_TREE] * len(reqs)
            hits, missed = 0, sum(1 for m in max_nodes if m > 0)
        if missed and self._waited(ticket, missed, len(reqs), hits):
            for i, tree in enumerate(self._lookup_trees(reqs, max_nodes)):  # drafted for this very context
                if tree:
                    trees[i] = tree
        for req, tree in zip(reqs, trees, strict=True):
            req.proposed = len(tree)
        self._last_step = self.clock()
        return trees

    def release(self, chore: Callable[[], None] | None = None) -> None:
        """The engine's thread is done with this step: the sender may send what is queued, and then do ``chore``
        (the engine's own work for its background, so that one thread wakes per step)."""
        queued, self._queued = self._queued, []
        if chore is not None:
            queued.append(Chore(chore))
        self._sender.send(queued)

    def drain(self, timeout: float = 5.0) -> bool:
        """Send what is queued (opened, stepped and ended requests) and wait until it was sent; False when
        ``timeout`` passed first."""
        self.release()
        return self._sender.drain(timeout)

    def proposed(self, reqs: Sequence[Tracked], lengths: Sequence[int]) -> None:
        """What the engine was given in the end (a cost cut may shorten ``step``'s chains): what the next step's
        outcomes are measured against."""
        for req, n in zip(reqs, lengths, strict=True):
            req.proposed = n

    def upcoming_estimates(self, req: Tracked, max_len: int) -> list[list[float]]:
        """The estimates of each chain the next ``step`` may give ``req``, for choosing ahead: one below every node
        of its latest tree that its outcome may reach, and every prompt-lookup chain's (none that are empty). For
        the sender's thread (which sets ``landed``), e.g. in a ``Chore``."""
        if max_len <= 0:
            return []
        chains = [lookup_estimates(match, n) for match in LOOKUP_FIRST for n in range(1, max_len + 1)]
        _, tree, root = req.landed
        if tree is not None:
            chains += [tree.chain(code, max_len)[1] for code in (root, *tree.codes_below(root))]
        return [c for c in chains if c]

    @property
    def sender_cpu_seconds(self) -> float:
        """CPU time the sender's thread spent so far (sending steps, indexing the trees that came back)."""
        return self._sender.cpu_seconds

    def close_all(self) -> None:
        """Stop the sender after what is queued was sent."""
        self.release()
        self._sender.close()

    def _record(self, reqs: Sequence[Tracked], new: Sequence[list[int]], queue: bool) -> int:
        """The bookkeeping of a step, chains or trees: the engine's step time, the tokens accepted of what was
        proposed, each row's new tokens; with ``queue``, the step goes to the sender. Returns the ticket of the
        answer that drafts for the new contexts (the last one queued)."""
        now = self.clock()
        fig = self.figures
        batch = tuple(map(id, reqs))
        if self._last_step and batch == self._last_batch:  # not across a change of batch (an idle engine's gap)
            took = now - self._last_step
            fig.step_seconds += EMA * (took - fig.step_seconds) if fig.step_seconds else took
        self._last_batch = batch
        accepted, chains_proposed = 0, 0
        history = self.history
        for req, toks in zip(reqs, new, strict=True):
            if req.proposed:
                chains_proposed += 1
                accepted += min(max(len(toks) - 1, 0), req.proposed)
            req.total += len(toks)
            recent = req.recent
            recent += toks
            if len(recent) > 2 * history:
                del recent[:-history]
        if chains_proposed:
            fig.accepted_per_chain += EMA * (accepted / chains_proposed - fig.accepted_per_chain)
        if queue:
            self._ticket += 1
            self._queued.append(Stepped(self._ticket, list(reqs), list(new), [r.total for r in reqs]))
        return self._ticket

    def _lookup(self, reqs: Sequence[Tracked], max_lengths: Sequence[int]) -> Chains:
        """Each row's chain from the latest tree its request has, followed down the tokens appended since; where
        that leaves the tree, from the tree before it (the last chain was often cut from that one)."""
        tokens: list[list[int]] = []
        probs: list[list[float]] = []
        for req, max_len in zip(reqs, max_lengths, strict=True):
            chain, estimates = self._cut(req, req.landed, max_len) if max_len > 0 else ([], [])
            if not chain and max_len > 0 and req.earlier[1] is not None:
                chain, estimates = self._cut(req, req.earlier, max_len)
            tokens.append(chain)
            probs.append(estimates)
        return tokens, probs

    def _lookup_trees(self, reqs: Sequence[Tracked], max_nodes: Sequence[int]) -> list[DraftTree]:
        """``_lookup`` for trees: each row's subtree below what it appended since its latest tree, else since the
        tree before it."""
        trees: list[DraftTree] = []
        for req, n in zip(reqs, max_nodes, strict=True):
            tree = self._subtree(req, req.landed, n) if n > 0 else EMPTY_TREE
            if not tree and n > 0 and req.earlier[1] is not None:
                tree = self._subtree(req, req.earlier, n)
            trees.append(tree)
        return trees

    def _look_up_missing_trees(self, reqs: Sequence[Tracked], max_nodes: Sequence[int], trees: list[DraftTree]
                               ) -> int:
        """Prompt lookup for trees: a chain (of at most ``k`` tokens) for each row that wants a tree and has none;
        returns how many rows got one."""
        found = 0
        for i, (req, n) in enumerate(zip(reqs, max_nodes, strict=True)):
            if n > 0 and not trees[i]:
                tokens, match = req.ngrams.chain(req.recent, min(n, self.k))
                if tokens:
                    trees[i] = chain_tree(tokens, lookup_estimates(match, len(tokens)))
                    found += 1
        self.figures.looked_up += found
        return found

    def _cut(self, req: Tracked, landed: tuple[int, PackedTrees | None, int], max_len: int
             ) -> tuple[list[int], list[float]]:
        """The chain below the request's tokens since ``landed``'s context, in its tree (empty: none)."""
        base, tree, root = landed
        recent = req.recent
        span = req.total - base
        if tree is None or not 0 <= span <= self.history or span > len(recent):
            return [], []
        return tree.chain_after(root, recent, len(recent) - span, max_len)

    def _subtree(self, req: Tracked, landed: tuple[int, PackedTrees | None, int], max_nodes: int) -> DraftTree:
        """``_cut`` for trees: the subtree below the request's tokens since ``landed``'s context (empty: none)."""
        base, tree, root = landed
        span = req.total - base
        if tree is None or not 0 <= span <= min(self.history, len(req.recent)):
            return EMPTY_TREE
        code = tree.descend(root, req.recent[len(req.recent) - span:]) if span else root
        return tree.subtree(code, max_nodes) if code >= 0 else EMPTY_TREE

    def _worth_waiting(self, missed: int, rows: int, hits: int) -> float:
        """Seconds worth waiting for the step's own answer (0: do not wait).

        Waiting ``w`` makes the step ``(T + w) / T`` as long and adds the missed rows' expected accepted tokens to
        the ``rows + hits' expected`` the step yields; it pays while ``w < T * gain / yield``. Without
        pre-speculation every step waits (up to the timeout). Never while the breaker is open.
        """
        if self._answered < self._late or not self._breaker.ready() or self._sender.stuck(self.timeout):
            return 0.0
        if not self.prespeculate:
            return self.timeout
        fig = self.figures
        if not fig.step_seconds:
            return 0.0
        gain = missed * fig.accepted_per_chain
        worth = fig.step_seconds * gain / (rows + hits * fig.accepted_per_chain)
        if worth < fig.round_trip_seconds:
            return 0.0
        return min(self.timeout, worth)

    def _waited(self, ticket: int, missed: int, rows: int, hits: int) -> bool:
        """Whether the step waited for its own answer (``ticket``) and got it, by the wait rule."""
        wait = self._worth_waiting(missed, rows, hits)
        return wait > 0 and self._wait_for(ticket, wait)

    def _wait_for(self, ticket: int, seconds: float) -> bool:
        """Wait up to ``seconds`` for the answer carrying ``ticket``; a late answer opens the breaker."""
        self.figures.waits += 1
        self.release()  # the step's tokens go now, and the sender may land the answer
        deadline = time.monotonic() + seconds
        with self._landed:
            while self._answered < ticket and self._failed < ticket and not self.refused:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._landed.wait(left)
            answered = self._answered >= ticket
        self._sender.hold()  # the rest of the step
        if answered:
            self._breaker.reset()
        else:
            self.figures.late += 1
            self._late = ticket
            wait = self._breaker.failure()
            logger.info("drafter: no answer within %.0f ms; drafts are not waited for until one lands, and not "
                        "during the next %.1f s", seconds * 1e3, wait)
        return answered

    # -- the sender's thread ----------------------------------------------------------------------------------

    def _land(self, landed: Landed) -> None:
        if not landed.answered:  # the service is away: the trees already there stay, a waiting step stops
            with self._landed:
                self._failed = max(self._failed, landed.ticket)
                self._landed.notify_all()
            return
        fig = self.figures
        fig.answers += 1
        fig.round_trip_seconds += EMA * (landed.seconds - fig.round_trip_seconds) if fig.round_trip_seconds else (
            landed.seconds)
        tree = landed.trees
        for i, (req, total) in enumerate(zip(landed.reqs, landed.totals, strict=True)):
            req.earlier, req.landed = req.landed, (total, tree, i)  # the engine's thread reads each tuple whole
        with self._landed:
            self._answered = max(self._answered, landed.ticket)
            self._landed.notify_all()

    def _refuse(self, reason: str) -> None:
        with self._landed:
            self.refused = reason
            self._landed.notify_all()
