"""`drafter bench first-token`: where drafter's chains lose their first token, and what another chain rule gives.

An engine that verifies one chain per request gets nothing from a step whose first draft token is wrong. Each step
of a replay (as ``bench replay --chain K`` replays, greedy acceptance) is sorted by the target's next token against
the tree the chain was cut from: the chain's first token was accepted; the token was another child of the root (the
tree held it, the chain rule ranked it below another); or it was not among the root's children at all (nothing in
the history, as drafter reads it, proposed it there). That splits what ranking could still win from what only more
or other candidates could. The replay is run once per chain rule, so the rules' MAT compare like with like.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from tqdm import tqdm

from drafter_service.api.tree import DraftTree, best_chain
from drafter_service.bench.replay import PROPOSER, CoreDrafter, path_tree, replay
from drafter_service.bench.replay_inputs import add_request_flags, load_sets
from drafter_service.datasets.loaders import Request
from engine_client.packed_trees import PackedTrees

ChainRule = Callable[[DraftTree, int], list[int]]


def likeliest_chain(tree: DraftTree, k: int) -> list[int]:
    """The vLLM proposer's chain: from the root, each node's likeliest child, cut at its minimum estimate."""
    tokens, _ = PackedTrees.from_trees([tree], k, PROPOSER.chain_min_prob).chain(0, k)
    return tokens


def expected_chain(tree: DraftTree, k: int) -> list[int]:
    """The path of at most ``k`` nodes with the most expected accepted tokens (``best_chain``: the sum of its
    estimates)."""
    return best_chain(tree, k)


RULES: dict[str, ChainRule] = {"likeliest": likeliest_chain, "expected": expected_chain}
"""Chain rules by name; "likeliest" is what the vLLM proposer and ``bench replay --chain`` take."""


@dataclass
class FirstTokens:
    """The steps of one replay, by what became of the chain's first token.

    Attributes:
        steps: verification steps.
        emitted: tokens emitted (accepted draft tokens and the target's own); ``mat`` is their mean per step.
        accepted: steps whose first draft token was accepted.
        another_child: steps where the target's token was a root child other than the chain's first token (or
            the chain was cut empty); ``second`` of them had it as the root's second likeliest child.
        absent: steps where it was not among the root's children (an empty tree included).
        no_chain: steps with an empty chain.
    """

    dataset: str
    rule: str
    k: int
    nodes: int
    steps: int = 0
    emitted: int = 0
    accepted: int = 0
    another_child: int = 0
    second: int = 0
    absent: int = 0
    no_chain: int = 0

    @property
    def mat(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def share(self, count: int) -> float:
        """``count`` as a share of the steps."""
        return count / self.steps if self.steps else 0.0

    def count(self, tree: DraftTree, chain: DraftTree, target: int) -> None:
        """Sort one step: ``chain`` was cut from ``tree``; ``target`` is the target's next token."""
        self.steps += 1
        self.no_chain += not len(chain)
        if len(chain) and chain.token_ids[0] == target:
            self.accepted += 1
            return
        kids = sorted(((tree.probs[i], tree.token_ids[i]) for i, p in enumerate(tree.parents) if p < 0), reverse=True)
        rank = next((r for r, (_, token) in enumerate(kids) if token == target), None)
        if rank is None:
            self.absent += 1
        else:
            self.another_child += 1
            self.second += rank == 1


class _SortingDrafter:
    """drafter's core in the replay, its chains cut by a rule; each step is sorted when the replay hands over the
    tokens it emitted (the first of them is the target's next token)."""

    def __init__(self, choose: ChainRule, nodes: int, counts: FirstTokens) -> None:
        self.name = f"drafter ({counts.rule})"
        self.core = CoreDrafter()
        self.choose, self.nodes, self.counts = choose, nodes, counts
        self._drafted: dict[str, tuple[DraftTree, DraftTree]] = {}  # the last step's tree and chain, not yet sorted

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self.core.start(request_id, prompt)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        drafted = self._drafted.pop(request_id, None)
        if drafted is not None and len(tokens):
            self.counts.count(*drafted, int(tokens[0]))
        self.core.extend(request_id, tokens)

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        return self.core.propose(request_id, max_nodes)

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        tree = self.core.propose(request_id, self.nodes)
        chain = path_tree(tree, self.choose(tree, k))
        self._drafted[request_id] = (tree, chain)
        return chain

    def end(self, request_id: str) -> None:
        self.core.end(request_id)


def replay_first_tokens(requests: Sequence[Request], k: int, rule: str = "likeliest", nodes: int = 0,
                        dataset: str = "", progress: Callable[[int], None] | None = None) -> FirstTokens:
    """Replay ``requests`` as ``bench replay --chain k`` does (``replay``), drafter's chains of at most ``k`` tokens
    cut by ``rule`` from trees of ``nodes`` nodes (0: what the vLLM proposer asks for), sorting every step
    (``FirstTokens``).

    Raises:
        ValueError: an unknown rule, or ``k`` < 1.
    """
    if rule not in RULES:
        raise ValueError(f"chain rule must be one of {', '.join(RULES)}, got {rule!r}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    out = FirstTokens(dataset, rule, k, nodes or PROPOSER.tree_nodes(k))
    result = replay(_SortingDrafter(RULES[rule], out.nodes, out), requests, k, dataset, progress, mode="chain")
    out.emitted = result.emitted
    if result.steps != out.steps:  # every step's tokens reach ``extend``
        raise AssertionError(f"{out.steps} steps sorted of the replay's {result.steps}")
    return out


def format_first_tokens(results: Sequence[FirstTokens]) -> str:
    """A markdown table, one row per data set and rule."""
    lines = ["| data set | chain rule | MAT | first token accepted | target's token another root child "
             "(the second likeliest) | not among the root's children | no chain |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.dataset} | {r.rule}, k = {r.k}, {r.nodes} nodes | {r.mat:.3f} | {r.share(r.accepted):.1%} "
                     f"| {r.share(r.another_child):.1%} ({r.share(r.second):.1%}) | {r.share(r.absent):.1%} "
                     f"| {r.share(r.no_chain):.1%} |")
    return "\n".join(lines)


def add_first_token_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench first-token``."""
    fp = bench.add_parser("first-token", help="where drafter's chains lose their first token: accepted, another "
                          "child of the tree's root, or not proposed at all; per chain rule")
    add_request_flags(fp)
    fp.add_argument("--chain", type=int, default=8, metavar="K", help="chain length (default 8, as vLLM verifies)")
    fp.add_argument("--nodes", type=int, default=0, help="nodes of the tree the chain is cut from (default: what "
                    "the vLLM proposer asks for)")
    fp.add_argument("--rules", default=",".join(RULES), help=f"comma-separated chain rules among {', '.join(RULES)}")
    fp.add_argument("--json", help="also write the results as JSON to this file")
    fp.set_defaults(func=run_first_token_bench)


def run_first_token_bench(args: argparse.Namespace) -> int:
    """Replay each set once per chain rule; print one table."""
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = [r for r in rules if r not in RULES]
    if unknown or not rules:
        raise SystemExit(f"--rules takes a comma-separated subset of {', '.join(RULES)}; got {args.rules!r}")
    if args.chain < 1 or args.nodes < 0:
        raise SystemExit("--chain must be at least 1 and --nodes at least 0")
    results = []
    for name, reqs in load_sets(args):
        for rule in rules:
            with tqdm(total=len(reqs), desc=f"{name} {rule}", unit="req", file=sys.stderr, leave=False) as bar:
                results.append(replay_first_tokens(reqs, args.chain, rule, args.nodes, name,
                                                    lambda _: bar.update()))
    print(format_first_tokens(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "mat": round(r.mat, 4)} for r in results], f, indent=1)
    return 0
