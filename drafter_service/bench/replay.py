"""Replay completed requests through drafters as a live service would, and measure acceptance and latency."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree, accept_greedy, best_chain
from drafter_service.bench.protocol import ChainDrafter, ReplayDrafter
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.datasets.loaders import Request
from engine_client.packed_trees import PackedTrees
from engines.vllm import ProposerSettings

if TYPE_CHECKING:
    from drafter_service.model.card import DraftModelDrafts

logger = logging.getLogger(__name__)

Mode = Literal["tree", "chain"]
"""How the replay verifies: a tree of at most ``budget`` nodes per step, or one chain of at most ``budget`` tokens."""

#: The vLLM proposer's default settings (no environment): how many nodes it asks for and where it cuts chains.
PROPOSER = ProposerSettings()


def path_tree(tree: DraftTree, tokens: Sequence[int]) -> DraftTree:
    """The path of ``tree`` spelt by ``tokens`` (from the root) as a chain, keeping its nodes' estimates and sources.

    Raises:
        ValueError: when ``tokens`` is not a path of the tree.
    """
    kids = tree.children()
    nodes: list[int] = []
    node = -1
    for tok in tokens:
        node = kids.get(node, {}).get(int(tok), -2)
        if node < 0:
            raise ValueError(f"{list(tokens)} is not a path of the tree")
        nodes.append(node)
    if not nodes:
        return EMPTY_TREE
    probs = tuple(tree.probs[i] for i in nodes)
    return DraftTree(tuple(int(t) for t in tokens), tuple(range(-1, len(nodes) - 1)), probs, float(sum(probs)),
                     tuple(tree.sources[i] for i in nodes) if tree.sources else ())


def chain_proposer(drafter: ReplayDrafter) -> Callable[[str, int], DraftTree]:
    """How the drafter makes its chain of at most ``k`` tokens per step: ``(request id, k) -> chain``.

    A drafter with its own ``propose_chain`` (``ChainDrafter``) makes it; otherwise it is the best path
    (``best_chain``, no minimum estimate) of a ``propose`` tree of as many nodes as the vLLM proposer asks for.
    """
    if isinstance(drafter, ChainDrafter):
        return drafter.propose_chain

    def best_path(request_id: str, k: int) -> DraftTree:
        tree = drafter.propose(request_id, PROPOSER.tree_nodes(k))
        return path_tree(tree, best_chain(tree, k))

    return best_path


class CoreDrafter:
    """drafter's own core behind the replay protocol; index rebuilds run between requests, untimed,
    as the service's background job runs them between draft calls.

    With a draft model, every step waits (untimed) until the model has grown its cache ``layers_ahead`` layers
    below the verified prefix: the replay fixes the communication ratio instead of racing a target.
    """

    def __init__(self, config: DrafterConfig | None = None, name: str = "drafter",
                 draft_model: DraftModelDrafts | None = None) -> None:
        self.name = name
        self.core = Drafter(config, draft_model)
        self.untimed_ns = 0  # waiting for the draft model, taken out of the latency figures

    def _settle(self, request_id: str) -> None:
        card = self.core.session(request_id).card
        if card is not None:
            t0 = time.perf_counter_ns()
            card.settle()
            self.untimed_ns += time.perf_counter_ns() - t0

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self.core.start(request_id, prompt)
        self._settle(request_id)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        self.core.extend(request_id, tokens)
        self._settle(request_id)

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        return self.core.propose(request_id, max_nodes)

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        """The chain the vLLM proposer (``engines.vllm``, default settings) takes from drafter's tree."""
        tree = self.core.propose(request_id, PROPOSER.tree_nodes(k))
        tokens, _ = PackedTrees.from_trees([tree], k, PROPOSER.chain_min_prob).chain(0, k)  # the proposer's cut
        return path_tree(tree, tokens)

    def end(self, request_id: str) -> None:
        self.core.end(request_id)
        self.core.rebuild()


@dataclass
class ReplayResult:
    """Acceptance and cost of one drafter on one data set.

    Attributes:
        budget: most nodes per step: the tree budget, or ``k`` in chain mode.
        mode: "tree" (a tree per step) or "chain" (one path of at most ``budget`` tokens per step).
        mat: mean accepted length, tokens emitted per verification step (the target's own token included).
        hit_rate: share of steps that accepted at least one draft token.
        mean_nodes: nodes drafted per step.
        p50_us, p99_us: latency of one draft (correction + proposal) in microseconds.
        model_hit_rate: with a draft model, share of its steps whose accepted draft tokens all lay in its cache.
    """

    drafter: str
    dataset: str
    budget: int
    mode: Mode = "tree"
    requests: int = 0
    steps: int = 0
    emitted: int = 0
    hits: int = 0
    nodes: int = 0
    latencies_ns: list[int] = field(default_factory=list, repr=False)
    model_hit_rate: float | None = None

    @property
    def label(self) -> str:
        """The budget as reports show it: ``"32"`` for a tree of 32 nodes, ``"chain 4"`` for chains of 4."""
        return f"chain {self.budget}" if self.mode == "chain" else str(self.budget)

    @property
    def mat(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.steps if self.steps else 0.0

    @property
    def mean_nodes(self) -> float:
        return self.nodes / self.steps if self.steps else 0.0

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(self.latencies_ns, q)) / 1e3 if self.latencies_ns else 0.0

    @property
    def p50_us(self) -> float:
        return self.percentile_us(50)

    @property
    def p99_us(self) -> float:
        return self.percentile_us(99)

    def count_step(self, accepted: int, nodes: int, remaining: int) -> int:
        """Count a step whose draft of ``nodes`` nodes had ``accepted`` tokens accepted, with ``remaining`` tokens
        of the answer left; returns the tokens it emits (the accepted ones and the target's own)."""
        advance = min(accepted + 1, remaining)
        self.steps += 1
        self.emitted += advance
        self.hits += accepted > 0
        self.nodes += nodes
        return advance

    def as_dict(self) -> dict[str, float | int | str | None]:
        """Summary figures (no per-step data); ``k`` is the chain length in chain mode, None in tree mode."""
        return {"drafter": self.drafter, "dataset": self.dataset, "mode": self.mode, "budget": self.budget,
                "k": self.budget if self.mode == "chain" else None, "requests": self.requests, "steps": self.steps,
                "mat": round(self.mat, 4),
                "hit_rate": round(self.hit_rate, 4), "mean_nodes": round(self.mean_nodes, 2),
                "p50_us": round(self.p50_us, 1), "p99_us": round(self.p99_us, 1),
                "model_hit_rate": self.model_hit_rate}


def replay(drafter: ReplayDrafter, requests: Sequence[Request], budget: int, dataset: str = "",
           progress: Callable[[int], None] | None = None, mode: Mode = "tree") -> ReplayResult:
    """Process requests in order: draft, accept the longest matching branch, advance, repeat; then end.

    Each step drafts with at most ``budget`` nodes, accepts the longest branch prefix that equals the
    recorded output (greedy verification), and advances by the accepted tokens plus the target's own
    next token. In chain mode each step drafts one path of at most ``budget`` tokens (``chain_proposer``).
    Latency covers ``extend`` (the correction with the previous step's tokens) and the proposal.
    """
    if mode not in ("tree", "chain"):
        raise ValueError(f"mode must be 'tree' or 'chain', got {mode!r}")
    result = ReplayResult(drafter.name, dataset, budget, mode)
    draft = chain_proposer(drafter) if mode == "chain" else drafter.propose
    clock = time.perf_counter_ns
    untimed_before = getattr(drafter, "untimed_ns", 0)
    for done, req in enumerate(requests):
        rid = req.request_id or f"r{done}"
        drafter.start(rid, req.prompt.tolist())
        out = req.output.tolist()
        pos = 0
        pending: list[int] = []
        while pos < len(out):
            t0 = clock()
            if pending:
                drafter.extend(rid, pending)
            tree = draft(rid, budget)
            untimed = getattr(drafter, "untimed_ns", 0)
            result.latencies_ns.append(clock() - t0 - (untimed - untimed_before))
            untimed_before = untimed
            _check_draft(drafter.name, tree, budget, mode)
            accepted, _ = accept_greedy(tree, out[pos:])
            advance = result.count_step(accepted, len(tree), len(out) - pos)
            pending = out[pos:pos + advance]
            pos += advance
        if pending:
            drafter.extend(rid, pending)
        drafter.end(rid)
        result.requests += 1
        if progress is not None:
            progress(done + 1)
    model = getattr(getattr(drafter, "core", None), "draft_model", None)
    if model is not None and model.steps:
        result.model_hit_rate = model.hits / model.steps
    return result


def _check_draft(name: str, tree: DraftTree, budget: int, mode: Mode) -> None:
    """Refuse a draft over the budget, or a tree in chain mode."""
    if len(tree) > budget:
        raise AssertionError(f"{name} drafted {len(tree)} nodes over the budget {budget}")
    if mode == "chain" and tree.parents != tuple(range(-1, len(tree) - 1)):
        raise AssertionError(f"{name} drafted a tree, not a chain, in chain mode")


def hindsight_name(names: Sequence[str]) -> str:
    """The row name of the hindsight choice among drafters named ``names``."""
    return f"hindsight({','.join(names)})"


def replay_hindsight(drafters: Sequence[ReplayDrafter], requests: Sequence[Request], budget: int, dataset: str = "",
                     progress: Callable[[int], None] | None = None, mode: Mode = "tree") -> ReplayResult:
    """The ceiling of choosing among ``drafters``: each step, take the draft that got the most tokens accepted.

    Every drafter drafts each step from the same sequence (as in ``replay``, with the same budget or chain length);
    the step accepts the most that any of them got accepted, and all of them advance by those tokens plus the
    target's own. No selector that looks only at the drafts can do better than this one, which looks at the answer:
    it bounds what ranking the drafters' candidates against one another can reach. Its latencies are not recorded.
    """
    if mode not in ("tree", "chain"):
        raise ValueError(f"mode must be 'tree' or 'chain', got {mode!r}")
    if not drafters:
        raise ValueError("the hindsight choice needs at least one drafter")
    result = ReplayResult(hindsight_name([d.name for d in drafters]), dataset, budget, mode)
    proposers = [(d, chain_proposer(d) if mode == "chain" else d.propose) for d in drafters]
    for done, req in enumerate(requests):
        rid = req.request_id or f"r{done}"
        for d in drafters:
            d.start(rid, req.prompt.tolist())
        out = req.output.tolist()
        pos = 0
        pending: list[int] = []
        while pos < len(out):
            accepted, nodes = -1, 0
            for d, draft in proposers:
                if pending:
                    d.extend(rid, pending)
                tree = draft(rid, budget)
                _check_draft(d.name, tree, budget, mode)
                got, _ = accept_greedy(tree, out[pos:])
                if got > accepted:  # ties go to the first drafter
                    accepted, nodes = got, len(tree)
            advance = result.count_step(accepted, nodes, len(out) - pos)
            pending = out[pos:pos + advance]
            pos += advance
        for d in drafters:
            if pending:
                d.extend(rid, pending)
            d.end(rid)
        result.requests += 1
        if progress is not None:
            progress(done + 1)
    return result
