"""The `drafter` command line: bench replay on request files."""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from drafter_service.cli.main import exit_on_sigterm, main
from drafter_service.datasets.loaders import Request, write_requests


def test_bench_replay_on_a_request_file_prints_ours_and_the_peer(tmp_path, capsys):
    rng = np.random.default_rng(1)
    answer = rng.integers(0, 50, 40)
    reqs = [Request(f"r{i}", rng.integers(0, 50, 10), answer) for i in range(6)]  # same answer each time
    path = tmp_path / "reqs.jsonl"
    write_requests(path, reqs)
    out_json = tmp_path / "out.json"
    assert main(["bench", "replay", str(path), "--peers", "prompt-lookup", "--budget", "8",
                 "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "| drafter |" in table and "| prompt-lookup |" in table
    rows = {r["drafter"]: r for r in json.loads(out_json.read_text())}
    assert rows["drafter"]["requests"] == 6
    # after the first request the repeated answer is drafted from the store, up to 8 tokens a step
    assert rows["drafter"]["mat"] > 3.0
    assert rows["drafter"]["mat"] > rows["prompt-lookup"]["mat"]


def test_bench_replay_without_input_explains_itself(capsys):
    with pytest.raises(SystemExit, match="request files or --dataset"):
        main(["bench", "replay"])


def test_bench_replay_chain_mode_and_the_oracle(tmp_path, capsys):
    rng = np.random.default_rng(2)
    answer = rng.integers(0, 50, 40)
    reqs = [Request(f"r{i}", rng.integers(0, 50, 10), answer) for i in range(5)]
    path = tmp_path / "reqs.jsonl"
    write_requests(path, reqs)
    out_json = tmp_path / "out.json"
    assert main(["bench", "replay", str(path), "--peers", "prompt-lookup", "--budget", "8", "--chain", "4",
                 "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "| chain 4 | drafter |" in table and "| 8 | oracle |" in table and "share of oracle" in table
    rows = {(r["drafter"], r["mode"], r["budget"]): r for r in json.loads(out_json.read_text())}
    assert set(rows) == {(d, m, b) for d in ("drafter", "prompt-lookup", "oracle") for m, b in (("tree", 8),
                                                                                               ("chain", 4))}
    for (_, mode, budget), row in rows.items():
        assert row["k"] == (budget if mode == "chain" else None)
        assert row["mean_nodes"] <= budget
        assert row["mat"] <= rows[("oracle", mode, budget)]["mat"]
    # the answer is all seen after the first request: the oracle then emits 4 + 1 tokens a step
    assert rows[("oracle", "chain", 4)]["steps"] <= answer.size + 4 * -(-answer.size // 5)


def test_sigterm_ends_a_command_with_its_finally_blocks_run():
    """A bench stopped with SIGTERM stops the services it started (they are closed in ``finally`` blocks)."""
    script = ("import os, signal, time\n"
              "from drafter_service.cli.main import exit_on_sigterm\n"
              "signal.signal(signal.SIGTERM, exit_on_sigterm)\n"
              "try:\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(10)\n"
              "finally:\n"
              "    print('children stopped', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM and done.stdout == "children stopped\n"


def test_the_command_line_installs_the_sigterm_handler():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            main(["bench", "replay"])  # (no input: explains itself and exits) after installing the handler
        assert signal.getsignal(signal.SIGTERM) is exit_on_sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)
