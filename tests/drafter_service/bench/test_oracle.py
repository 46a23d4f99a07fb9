"""Tests of the retrieval oracle: the longest seen prefix of the rest of each output, and its replay."""

from __future__ import annotations

import numpy as np
import pytest

from drafter_service.bench.oracle import RetrievalOracle, SeenPrefixes, seen_prefix_lengths
from drafter_service.bench.peers import ArcticSuffixDrafter, PromptLookupDrafter, arctic_available
from drafter_service.bench.protocol import ReplayDrafter
from drafter_service.bench.replay import CoreDrafter, Mode, replay
from drafter_service.datasets.loaders import Request


def _occurs(query: list[int], text: list[int]) -> bool:
    return any(text[i:i + len(query)] == query for i in range(len(text) - len(query) + 1))


def _brute_lengths(reqs: list[Request], cap: int) -> list[list[int]]:
    """The definition, literally: at output position pos of request r, the longest prefix of output[pos:] (at most
    cap) found in an earlier request's prompt + output or in this prompt + output[:pos]."""
    out = []
    for r, req in enumerate(reqs):
        docs = [x.prompt.tolist() + x.output.tolist() for x in reqs[:r]]
        answer = req.output.tolist()
        lengths = []
        for pos in range(len(answer)):
            seen = [*docs, req.prompt.tolist() + answer[:pos]]
            best = 0
            for length in range(1, min(cap, len(answer) - pos) + 1):
                if any(_occurs(answer[pos:pos + length], d) for d in seen):
                    best = length
            lengths.append(best)
        out.append(lengths)
    return out


def _brute_replay(reqs: list[Request], cap: int) -> tuple[int, int, int, int]:
    """(steps, tokens emitted, steps with a hit, draft tokens accepted) stepping by the brute-force lengths."""
    steps = emitted = hits = accepted = 0
    for lengths, req in zip(_brute_lengths(reqs, cap), reqs, strict=True):
        pos = 0
        while pos < req.output.size:
            a = lengths[pos]
            advance = min(a + 1, req.output.size - pos)
            steps, emitted, hits, accepted = steps + 1, emitted + advance, hits + (a > 0), accepted + a
            pos += advance
    return steps, emitted, hits, accepted


def _random_requests(rng: np.random.Generator, count: int, vocab: int) -> list[Request]:
    return [Request(f"r{i}", rng.integers(0, vocab, int(rng.integers(0, 8))),
                    rng.integers(0, vocab, int(rng.integers(0, 14)))) for i in range(count)]


def test_a_hand_made_history() -> None:
    reqs = [Request("a", [1, 2], [3, 4, 5, 6]),
            Request("b", [9, 3, 4], [5, 6, 7, 9, 3, 4, 5, 6, 8]),
            Request("c", [], [2, 3, 4, 5, 6, 7, 6, 7, 6, 7])]
    got = [a.tolist() for a in seen_prefix_lengths(reqs, 4)]
    assert got == _brute_lengths(reqs, 4)
    assert all(a.dtype == np.int32 for a in seen_prefix_lengths(reqs, 4))
    # request a's output never occurred before it; the cap binds where more was seen
    assert got[0] == [0] * 4
    assert max(got[1]) == 4 and max(max(x) for x in seen_prefix_lengths(reqs, 2)) == 2


def test_lengths_match_the_definition_on_random_histories() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        reqs = _random_requests(rng, int(rng.integers(1, 5)), int(rng.integers(1, 5)))
        cap = int(rng.integers(1, 9))
        assert [a.tolist() for a in seen_prefix_lengths(reqs, cap)] == _brute_lengths(reqs, cap)


def test_matches_do_not_cross_requests() -> None:
    # "7 8" is seen only across the end of one request and the start of the next
    reqs = [Request("a", [5], [6, 7]), Request("b", [8, 1], [2]), Request("c", [0], [7, 8])]
    assert seen_prefix_lengths(reqs, 4)[2].tolist() == [1, 1]
    with pytest.raises(ValueError):
        seen_prefix_lengths(reqs, 0)
    with pytest.raises(ValueError):
        seen_prefix_lengths([Request("n", [-3], [1])], 2)


@pytest.mark.parametrize(("mode", "cap"), [("tree", 3), ("chain", 2), ("tree", 6)])
def test_oracle_replay_steps_by_the_seen_prefix_within_the_budget(mode: Mode, cap: int) -> None:
    rng = np.random.default_rng(1)
    reqs = _random_requests(rng, 6, 3)
    oracle = RetrievalOracle(SeenPrefixes.of(reqs, 6))
    result = replay(oracle, reqs, cap, "tiny", mode=mode)
    assert (result.steps, result.emitted, result.hits, result.nodes) == _brute_replay(reqs, cap)
    assert result.mode == mode


def test_history_counts_as_seen_and_budgets_cap_drafts() -> None:
    answer = np.arange(40) % 23
    history = [Request("h", [1, 2, 3], answer)]
    reqs = [Request("r", [4, 5], answer)]
    oracle = RetrievalOracle(SeenPrefixes.of(history + reqs, 16), skip=1, name="oracle+warm")
    oracle.start("r", [4, 5])
    for budget in (1, 5, 16):
        tree = oracle.propose("r", budget)
        assert list(tree.token_ids) == answer[:budget].tolist()  # the whole answer was seen: the budget binds
    with pytest.raises(ValueError, match="cap"):
        oracle.propose("r", 17)
    oracle.extend("r", answer[:3].tolist())
    assert list(oracle.propose_chain("r", 4).token_ids) == answer[3:7].tolist()
    with pytest.raises(ValueError, match="recorded output"):
        oracle.extend("r", [99])
    result = replay(RetrievalOracle(SeenPrefixes.of(history + reqs, 16), skip=1), reqs, 16)
    assert result.mean_nodes <= 16 and result.steps == -(-answer.size // 17)  # 16 drafted + 1 per step
    cold = replay(RetrievalOracle(SeenPrefixes.of(reqs, 16)), reqs, 16)
    assert cold.mat < result.mat  # without the history, the first tokens were never seen


def test_oracle_replays_only_its_schedule() -> None:
    reqs = [Request("a", [1, 2], [3]), Request("b", [4], [5])]
    oracle = RetrievalOracle(SeenPrefixes.of(reqs, 2))
    with pytest.raises(ValueError, match="next request"):
        oracle.start("b", [4])
    oracle.start("a", [1, 2])
    oracle.end("a")
    oracle.start("b", [4])
    oracle.end("b")
    with pytest.raises(ValueError, match="over"):
        oracle.start("c", [1])


def _structured_requests(seed: int) -> list[Request]:
    """Answers built from a few shared phrases: drafters copy across requests and within them."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 200, int(rng.integers(3, 12))) for _ in range(12)]
    reqs = []
    for i in range(14):
        picks = rng.integers(0, len(phrases), 8)
        answer = np.concatenate([phrases[p] for p in picks] + [rng.integers(0, 200, 3)])
        reqs.append(Request(f"r{i}", np.concatenate([phrases[picks[0]], rng.integers(0, 200, 6)]), answer))
    return reqs


@pytest.mark.parametrize(("mode", "cap"), [("tree", 8), ("chain", 4), ("tree", 32)])
def test_oracle_mat_bounds_every_drafter(mode: Mode, cap: int) -> None:
    reqs = _structured_requests(4)
    drafters: list[ReplayDrafter] = [CoreDrafter(), PromptLookupDrafter()]
    if arctic_available():
        drafters += [ArcticSuffixDrafter(max_spec_factor=4.0) if mode == "tree" else ArcticSuffixDrafter.vllm_suffix()]
    oracle = replay(RetrievalOracle(SeenPrefixes.of(reqs, cap)), reqs, cap, mode=mode)
    mats = {d.name: replay(d, reqs, cap, mode=mode).mat for d in drafters}
    assert all(oracle.mat >= mat for mat in mats.values()), (oracle.mat, mats)
    assert max(mats.values()) > 1.5  # the drafters do find much of it
