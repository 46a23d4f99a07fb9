"""Tests of the replay table: labels, and comparisons within a data set, mode and budget."""

from __future__ import annotations

import pytest

from drafter_service.bench.commands import CARD_VARIANTS, card_variants, format_table
from drafter_service.bench.replay import Mode, ReplayResult


def _result(drafter: str, mode: Mode, budget: int, steps: int, emitted: int) -> ReplayResult:
    return ReplayResult(drafter, "set", budget, mode, requests=1, steps=steps, emitted=emitted)


def _row(table: str, label: str, drafter: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[1:3] == [label, drafter]:
            return cells
    raise AssertionError(f"no row {label} {drafter} in\n{table}")


def test_chain_rows_compare_with_chain_peers_and_the_oracle_of_the_same_k() -> None:
    results = [_result("drafter", "tree", 4, 100, 300), _result("peer", "tree", 4, 100, 250),
               _result("oracle", "tree", 4, 100, 400),
               _result("drafter", "chain", 4, 100, 200), _result("peer", "chain", 4, 100, 160),
               _result("oracle", "chain", 4, 100, 350),
               _result("drafter", "chain", 8, 100, 220), _result("peer", "chain", 8, 100, 240),
               _result("oracle", "chain", 8, 100, 500)]
    table = format_table(results)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    col = {name: i for i, name in enumerate(header)}
    by = {(r.label, r.drafter): r for r in results}
    for label in ("4", "chain 4", "chain 8"):
        ours, peer, oracle = (by[(label, d)] for d in ("drafter", "peer", "oracle"))
        row = _row(table, label, "drafter")
        assert row[col["vs best peer"]] == f"{ours.mat / peer.mat:.2f}×"
        assert row[col["share of oracle"]] == f"{(ours.mat - 1) / (oracle.mat - 1):.1%}"
        assert _row(table, label, "peer")[col["share of oracle"]] == f"{(peer.mat - 1) / (oracle.mat - 1):.1%}"
        assert _row(table, label, "peer")[col["vs best peer"]] == ""
        oracle_row = _row(table, label, "oracle")
        assert oracle_row[col["vs best peer"]] == oracle_row[col["share of oracle"]] == ""
        assert oracle_row[col["p50 µs"]] == ""  # it knows the answer: no draft cost to report


def test_the_oracle_is_not_a_peer_and_warm_rows_use_the_warm_oracle() -> None:
    results = [_result("drafter", "tree", 8, 10, 20), _result("oracle", "tree", 8, 10, 40),
               _result("drafter+warm", "tree", 8, 10, 30), _result("oracle+warm", "tree", 8, 10, 50)]
    table = format_table(results)
    assert _row(table, "8", "drafter")[4] == ""  # no peer ran: the oracle is no peer
    assert _row(table, "8", "drafter")[5] == f"{(2.0 - 1) / (4.0 - 1):.1%}"
    assert _row(table, "8", "drafter+warm")[5] == f"{(3.0 - 1) / (5.0 - 1):.1%}"


def test_card_variants_keep_their_order_and_refuse_unknown_names() -> None:
    assert card_variants("card-only,drafter+card") == ["drafter+card", "card-only"]
    assert card_variants(",".join(CARD_VARIANTS)) == list(CARD_VARIANTS)
    for bad in ("drafter+card,cardd", ",", ""):
        with pytest.raises(SystemExit, match="--card-variants"):
            card_variants(bad)


def test_the_hindsight_choice_is_compared_with_the_best_peer_but_is_none() -> None:
    results = [_result("drafter", "chain", 4, 100, 200), _result("peer", "chain", 4, 100, 180),
               _result("hindsight(drafter,peer)", "chain", 4, 100, 260)]
    table = format_table(results)
    assert _row(table, "chain 4", "drafter")[4] == f"{2.0 / 1.8:.2f}×"  # the hindsight row is not the best peer
    row = _row(table, "chain 4", "hindsight(drafter,peer)")
    assert row[4] == f"{2.6 / 1.8:.2f}×"
    assert row[8] == row[9] == ""  # it knows the answer: no draft cost to report


def test_replay_drafts_with_smollm2_itself_by_name(tmp_path, capsys) -> None:
    """``--draft-model smollm2-135m`` is SmolLM2-135M-Instruct: on its own greedy answer its drafts are accepted."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from drafter_service.cli.main import main
    from drafter_service.datasets.request_files import Request, write_requests
    from drafter_service.datasets.target_model import chat_prompt, load_smollm2
    from drafter_service.datasets.tokenizer import load_smollm2_tokenizer
    from engines.reference.engine import greedy_reference

    torch.set_num_threads(2)
    prompt = load_smollm2_tokenizer().encode(chat_prompt("Name three primary colours.")).ids
    answer = greedy_reference(load_smollm2(torch.float32, "cpu"), prompt, 24)
    write_requests(tmp_path / "answer.jsonl", [Request("r0", np.array(prompt), np.array(answer))])
    assert main(["bench", "replay", str(tmp_path / "answer.jsonl"), "--chain", "4", "--draft-model", "smollm2-135m",
                 "--card-variants", "card-only", "--card-vocab", "0", "--card-layers", "4", "--peers",
                 "prompt-lookup", "--no-oracle", "--draft-threads", "2"]) == 0
    table = capsys.readouterr().out
    card, lookup = (_row(table, "chain 4", name) for name in ("card-only", "prompt-lookup"))
    assert float(card[3]) > 2.0 > float(lookup[3])  # MAT: most of its chains are accepted
