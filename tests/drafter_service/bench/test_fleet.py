"""Tests of the fleet replay: routing, restarts, and N = 1 against ``bench replay``."""

from __future__ import annotations

import argparse
import json
import zlib
from collections.abc import Sequence

import numpy as np
import pytest

from drafter_service.api.tree import EMPTY_TREE, DraftTree
from drafter_service.bench.fleet import (
    Fleet,
    FleetPlan,
    replay_fleet,
    replay_replica_oracles,
    replay_shared,
    replica_histories,
    route,
)
from drafter_service.bench.fleet_bench import FleetResult, add_fleet_bench, format_fleet
from drafter_service.bench.ngram_mod import NGramModDrafter
from drafter_service.bench.oracle import RetrievalOracle, SeenPrefixes
from drafter_service.bench.peers import ArcticSuffixDrafter, PromptLookupDrafter, arctic_available
from drafter_service.bench.pia_trie import PiaLookaheadDrafter
from drafter_service.bench.prefix_router import PrefixRouter, block_hashes
from drafter_service.bench.protocol import ReplayDrafter
from drafter_service.bench.replay import CoreDrafter, Mode, replay
from drafter_service.datasets.loaders import Request, write_requests


def _requests(count: int = 10, seed: int = 0) -> list[Request]:
    """Variants of one answer (a few tokens changed) after prompts of two families: requests learn from earlier ones."""
    rng = np.random.default_rng(seed)
    half = rng.integers(0, 60, 30)
    base = np.concatenate([half, half])
    heads = [rng.integers(100, 160, 16), rng.integers(100, 160, 16)]
    out = []
    for i in range(count):
        answer = base.copy()
        changed = rng.integers(0, base.size, 4)
        answer[changed] = rng.integers(0, 60, changed.size)
        out.append(Request(f"r{i}", np.concatenate([heads[i % 2], rng.integers(0, 60, 6)]).astype(np.int32),
                           answer.astype(np.int32)))
    return out


class Recorder:
    """A peer that drafts nothing and records the requests it served."""

    name = "recorder"

    def __init__(self) -> None:
        self.served: list[str] = []

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self.served.append(request_id)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        pass

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        return EMPTY_TREE

    def end(self, request_id: str) -> None:
        pass


def test_round_robin_assigns_requests_in_turn() -> None:
    assert route(_requests(7), 3, "round-robin").tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert route(_requests(3), 1, "round-robin").tolist() == [0, 0, 0]


def _prompt(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32)


def test_prefix_affinity_sends_a_long_shared_prefix_to_the_replica_that_served_it() -> None:
    rng = np.random.default_rng(1)
    system = rng.integers(0, 50, 40)  # the line every prompt starts with
    docs = [rng.integers(100, 200, 64) for _ in range(3)]  # three long documents asked about again and again
    reqs = [Request(f"r{i}", _prompt(system, docs[i % 3], rng.integers(0, 50, 8)), np.array([1], dtype=np.int32))
            for i in range(12)]
    for n in (2, 4, 16):
        replica = route(reqs, n, "prefix").tolist()
        # the second prompt cannot yet tell the system line from a shared document: it follows the first; the
        # third matches no more than what all prompts share so far, and goes to the least-loaded replica
        assert replica[:3] == [0, 0, 1]
        for d in range(3):
            assert len(set(replica[d::3])) == 1, (n, replica)
    # a conversation's next turn (its prompt extends the first) goes where the first turn went
    turn1 = _prompt(system[:20], rng.integers(200, 300, 20))
    turn2 = _prompt(turn1, rng.integers(200, 300, 30))
    other = _prompt(system[:20], rng.integers(200, 300, 20))
    convo = [Request(str(i), p, np.array([1], dtype=np.int32)) for i, p in enumerate([turn1, other, turn2])]
    assert route(convo, 4, "prefix").tolist() == [0, 1, 0]


def test_prompts_that_share_only_a_system_line_spread_over_the_replicas() -> None:
    rng = np.random.default_rng(2)
    system = rng.integers(0, 50, 100)  # longer than the 32-token minimum: only "longer than all share" stops it
    many = [Request(str(i), _prompt(system, rng.integers(100, 200, 20)), np.array([1], dtype=np.int32))
            for i in range(64)]
    replica = route(many, 4, "prefix")
    assert np.bincount(replica, minlength=4).tolist() == [16, 16, 16, 16]
    short = [Request(str(i), np.array([i, i + 1], dtype=np.int32), np.array([1], dtype=np.int32)) for i in range(8)]
    assert route(short, 4, "prefix").tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # no match: the least-loaded replica


def test_a_match_counts_from_32_tokens_in_whole_tokens_past_the_hashed_blocks() -> None:
    router = PrefixRouter(4)
    head = np.arange(20)
    # 20 shared tokens are under the 32-token minimum: each prompt goes to the least-loaded replica
    assert [router.route(_prompt(head, np.full(40, i + 100))) for i in range(3)] == [0, 1, 2]
    assert router.shared() == 20 and router.match(_prompt(head, np.full(40, 101))) == (60, 1)
    # 40 tokens in common with the second prompt, though only its first two blocks (32 tokens) hash alike
    assert router.route(_prompt(head, np.full(20, 101), np.full(20, 7))) == 1
    assert router.route(_prompt(np.arange(100, 140))) == 3  # nothing known: the least-loaded replica
    assert block_hashes(list(range(40)))[1] == zlib.crc32(np.arange(16, 32, dtype="<i4").tobytes(),
                                                          zlib.crc32(np.arange(16, dtype="<i4").tobytes()))
    assert len(block_hashes(list(range(40)))) == 2  # whole blocks only


def test_bad_routing_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        route(_requests(2), 2, "random")
    with pytest.raises(ValueError):
        route(_requests(2), 0, "round-robin")
    with pytest.raises(ValueError):
        FleetPlan.build(_requests(2), 2, "round-robin", -1)


def test_restarts_go_round_the_replicas_every_r_requests() -> None:
    plan = FleetPlan.build(_requests(10), 2, "round-robin", 3, window=2)
    # after requests 3, 6 and 9 (indexes 2, 5, 8): replicas 0, 1, 0 in turn
    assert plan.restart_after.tolist() == [-1, -1, 0, -1, -1, 1, -1, -1, 0, -1]
    assert plan.restarts == 3
    # replica 0 serves 4, 6 after its first restart (then restarts again after 8), replica 1 serves 7, 9
    assert np.flatnonzero(plan.after_restart).tolist() == [4, 6, 7, 9]
    assert not FleetPlan.build(_requests(10), 2, "round-robin", 0).after_restart.any()


def test_a_restarted_replica_starts_with_empty_peers_and_drafter_keeps_every_request() -> None:
    reqs = _requests(10)
    plan = FleetPlan.build(reqs, 2, "round-robin", 3)
    fleet = Fleet(2, lambda: [Recorder()])
    drafter = CoreDrafter()
    logs = replay_fleet(reqs, plan, lambda: [Recorder()], 4, "chain", shared=[drafter], fleet=fleet)
    assert fleet.restarts == [2, 1]
    # replica 0 restarted after requests 3 and 9, replica 1 after request 6
    assert fleet.peers(0)[0].served == []  # type: ignore[attr-defined]
    assert fleet.peers(1)[0].served == ["r7", "r9"]  # type: ignore[attr-defined]
    assert drafter.core.store.stats()["documents"] == 10
    assert set(logs) == {"drafter", "recorder"} and logs["recorder"].steps.sum() > 0


def test_after_a_restart_peers_are_cold_and_drafter_is_not() -> None:
    same = _requests(1)[0]
    reqs = [Request(f"r{i}", same.prompt, same.output) for i in range(4)]
    plan = FleetPlan.build(reqs, 1, "round-robin", 2)  # the replica restarts after the second request
    logs = replay_fleet(reqs, plan, lambda: [PiaLookaheadDrafter(), NGramModDrafter()], 8, "chain",
                        shared=[CoreDrafter()])
    for peer in ("pia", "ngram-mod"):
        steps = logs[peer].steps.tolist()
        assert steps[2] == steps[0] and steps[3] == steps[1] and steps[1] < steps[0]  # cold again, then warm
    ours = logs["drafter"].steps.tolist()
    assert ours[2] <= ours[1] < ours[0]
    assert plan.after_restart.tolist() == [False, False, True, True]
    assert logs["drafter"].mat(plan.after_restart) > logs["pia"].mat(plan.after_restart)


def _peers(mode: Mode) -> list[ReplayDrafter]:
    out: list[ReplayDrafter] = [PromptLookupDrafter(), PiaLookaheadDrafter(), NGramModDrafter()]
    if arctic_available():
        out.append(ArcticSuffixDrafter.vllm_suffix() if mode == "chain" else ArcticSuffixDrafter())
    return out


@pytest.mark.parametrize(("mode", "budget"), [("chain", 4), ("tree", 8)])
def test_one_replica_without_restarts_matches_bench_replay(mode: Mode, budget: int) -> None:
    reqs = _requests(8)
    seen = SeenPrefixes.of(reqs, budget)
    plan = FleetPlan.build(reqs, 1, "prefix", 0)
    logs = replay_fleet(reqs, plan, lambda: _peers(mode), budget, mode,
                        shared=[CoreDrafter(), RetrievalOracle(seen)])
    alone = [CoreDrafter(), RetrievalOracle(seen), *_peers(mode)]
    for drafter in alone:
        expected = replay(drafter, reqs, budget, mode=mode)
        assert logs[drafter.name].mat() == pytest.approx(expected.mat, abs=1e-12), drafter.name
        assert int(logs[drafter.name].steps.sum()) == expected.steps
    shared = replay_shared(CoreDrafter(), reqs, budget, mode)
    assert shared.mat() == logs["drafter"].mat()


def test_bench_fleet_command_prints_both_tables_and_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "reqs.jsonl"
    write_requests(path, _requests(8))
    parser = argparse.ArgumentParser()
    add_fleet_bench(parser.add_subparsers())
    out = tmp_path / "fleet.json"
    args = parser.parse_args(["fleet", str(path), "--chain", "4", "--replicas", "1,2", "--restart-every", "0,3",
                              "--peers", "prompt-lookup,pia", "--json", str(out)])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "| drafter / best peer |" in table and "drafter / best cold suffix" in table
    assert "| oracle per replica |" in table and "oracle / per replica |" in table
    rows = json.loads(out.read_text())
    # 2 N x 2 routings x 2 R over all requests, and the 4 settings with restarts after them
    assert len(rows) == 12 and sum(r["scope"] == "after-restart" for r in rows) == 4
    first = rows[0]
    assert set(first["mat"]) == {"drafter", "oracle", "oracle-replica", "prompt-lookup", "pia"} and first["k"] == 4
    assert all(r["oracle_vs_replica_oracle"] >= 1.0 for r in rows)


def test_a_setting_whose_restarts_leave_no_request_after_them_shows_no_figures() -> None:
    reqs = _requests(4)
    plan = FleetPlan.build(reqs, 2, "round-robin", 4)  # the only restart comes after the last request
    logs = replay_fleet(reqs, plan, lambda: [PromptLookupDrafter()], 4, "chain", shared=[CoreDrafter()])
    result = FleetResult("set", "chain", 4, plan, logs)
    assert result.requests("after-restart") == 0 and result.mats("after-restart") == {}
    assert result.best_peer("after-restart") is None and result.ratio("after-restart") is None
    row = format_fleet([result]).splitlines()[-1]
    assert row == "| set | chain 4 | 2 | round-robin | 4 | 0 | - | - | - | - | - |"


def test_replica_histories_are_what_each_replica_served_between_its_restarts() -> None:
    plan = FleetPlan.build(_requests(10), 2, "round-robin", 3)  # restarts after indexes 2 (0), 5 (1), 8 (0)
    assert replica_histories(plan) == [[0, 2], [1, 3, 5], [4, 6, 8], [7, 9]]
    assert replica_histories(FleetPlan.build(_requests(5), 1, "round-robin", 0)) == [[0, 1, 2, 3, 4]]


def test_the_oracle_per_replica_sees_only_its_replicas_history() -> None:
    reqs = _requests(12)
    alone = replay_replica_oracles(reqs, FleetPlan.build(reqs, 1, "round-robin", 0), 8)
    assert alone.mat() == replay_shared(RetrievalOracle(SeenPrefixes.of(reqs, 8)), reqs, 8).mat()
    plan = FleetPlan.build(reqs, 2, "round-robin", 5)
    split = replay_replica_oracles(reqs, plan, 8)
    for stretch in replica_histories(plan):  # each stretch replayed on its own, with nothing before it
        served = [reqs[i] for i in stretch]
        own = replay_shared(RetrievalOracle(SeenPrefixes.of(served, 8)), served, 8)
        assert split.steps[stretch].tolist() == own.steps.tolist()
    assert split.mat() < alone.mat()  # the other replica's requests would have helped
    logs = {"drafter": replay_shared(CoreDrafter(), reqs, 8), "oracle": replay_shared(
        RetrievalOracle(SeenPrefixes.of(reqs, 8)), reqs, 8), "oracle-replica": split}
    result = FleetResult("set", "chain", 8, plan, logs)
    assert result.peers == [] and result.history_gain() == pytest.approx(alone.mat() / split.mat())
