"""Tests of `bench first-token`: every step sorted once, and the proposer's rule replayed as `bench replay` does."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from drafter_service.api.tree import DraftTree
from drafter_service.bench.first_token import (
    FirstTokens,
    add_first_token_bench,
    format_first_tokens,
    replay_first_tokens,
)
from drafter_service.bench.replay import CoreDrafter, replay
from drafter_service.datasets.loaders import Request


def _requests(count: int = 8) -> list[Request]:
    """Variants of one answer (a few tokens changed each), so that later requests draft long chains that branch."""
    rng = np.random.default_rng(3)
    base = np.tile(rng.integers(0, 60, 40), 2)
    out = []
    for i in range(count):
        answer = base.copy()
        answer[rng.integers(0, base.size, 6)] = rng.integers(0, 60, 6)
        out.append(Request(f"r{i}", np.concatenate([[70, 71], rng.integers(0, 60, 10)]), answer))
    return out


def test_the_proposers_rule_gives_the_chain_replays_mat_and_every_step_is_sorted_once():
    reqs = _requests()
    got = replay_first_tokens(reqs, 8, "likeliest", dataset="toy")
    assert got.mat == pytest.approx(replay(CoreDrafter(), reqs, 8, mode="chain").mat)
    assert got.steps == replay(CoreDrafter(), reqs, 8, mode="chain").steps
    assert got.accepted + got.another_child + got.absent == got.steps
    assert 0 < got.accepted < got.steps and got.second <= got.another_child
    assert got.emitted == sum(r.output.size for r in reqs)


def test_the_expected_rule_replays_the_same_answers_with_its_own_chains():
    reqs = _requests()
    got = replay_first_tokens(reqs, 4, "expected", nodes=16)
    assert (got.rule, got.k, got.nodes) == ("expected", 4, 16)
    assert got.emitted == sum(r.output.size for r in reqs)
    assert got.accepted + got.another_child + got.absent == got.steps


def test_a_step_is_sorted_by_where_the_targets_token_sits_among_the_roots_children():
    tree = DraftTree((5, 6, 7, 8), (-1, -1, 0, -1), (0.5, 0.3, 0.4, 0.1), 1.3)
    chain = DraftTree((5, 7), (-1, 0), (0.5, 0.4), 0.9)
    counts = FirstTokens("toy", "likeliest", 2, 4)
    counts.count(tree, chain, 5)  # accepted
    counts.count(tree, chain, 6)  # the second likeliest child
    counts.count(tree, chain, 8)  # the third
    counts.count(tree, chain, 7)  # 7 is no child of the root
    counts.count(DraftTree(), DraftTree(), 5)  # nothing drafted
    assert (counts.steps, counts.accepted, counts.another_child, counts.second, counts.absent, counts.no_chain) == \
        (5, 1, 2, 1, 2, 1)
    assert "| toy | likeliest, k = 2, 4 nodes |" in format_first_tokens([counts])


def test_bad_rules_and_lengths_are_refused():
    with pytest.raises(ValueError, match="chain rule"):
        replay_first_tokens(_requests(1), 8, "longest")
    with pytest.raises(ValueError, match="k must be"):
        replay_first_tokens(_requests(1), 0)
    parser = argparse.ArgumentParser()
    add_first_token_bench(parser.add_subparsers())
    args = parser.parse_args(["first-token", "--rules", "likeliest,nope"])
    with pytest.raises(SystemExit, match="--rules"):
        args.func(args)
