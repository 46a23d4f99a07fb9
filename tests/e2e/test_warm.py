"""`drafter warm` against a real gRPC server on real Redis: idempotent, resumable after SIGKILL, malformed lines,
duplicate skipping on Ingest, grown and replaced files, and folder watching (CLI and inside `drafter serve`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.cli.main import build_parser, main
from drafter_service.cli.serve import config_from_args
from drafter_service.core.config import DrafterConfig
from drafter_service.ingest.warm import Warmer
from drafter_service.ingest.warm_sinks import GrpcSink, WarmError
from drafter_service.ingest.warm_state import CheckpointStore
from drafter_service.rpc.server import create_server
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import NamespaceSpec, ServiceConfig
from drafter_service.service.service import DrafterService
from store.persistence import RedisPersistence

VOCAB = 500
DRAFTER = str(Path(sys.executable).parent / "drafter")


class Running:
    def __init__(self, service, address, url):
        self.service, self.address, self.url = service, address, url
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.DrafterStub(self.channel)

    def stats(self, namespace=""):
        return self.stub.GetStats(pb.GetStatsRequest(namespace=namespace))

    def stored(self, namespace="default"):
        """Multiset of the logged requests' (tokens, prompt length), and the stream length."""
        p = RedisPersistence(self.url, namespace)
        recs = list(p.iter_request_records())
        return sorted((tuple(r.tokens.tolist()), r.prompt_len) for r in recs), p.request_count()


@pytest.fixture
def running(redis_server):
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 18), default_vocab_size=VOCAB,
                        namespaces=(NamespaceSpec("clean", VOCAB),))
    service = DrafterService(cfg, lambda name, vocab: RedisPersistence(redis_server.url, name, vocab_size=vocab))
    server, port = create_server(cfg, "127.0.0.1:0", service)
    r = Running(service, f"127.0.0.1:{port}", redis_server.url)
    yield r
    r.channel.close()
    server.stop(0)


def write_log(path: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` token-id lines with a few repeats (same id; same content under another id); returns the lines."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        obj = {"request_id": f"r{i}", "prompt": rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist(),
               "output": rng.integers(0, VOCAB, int(rng.integers(0, 30))).tolist()}
        if i % 17 == 5:
            obj = {**json.loads(lines[i - 3]), "request_id": f"copy{i}"}
        if i % 23 == 7:
            obj["request_id"] = "r1"
        lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n")
    return lines


def naive_dedup(lines: list[str]) -> list[dict]:
    """The requests a warm stores: those whose id and content were not seen on an earlier stored line."""
    seen, kept = set(), []
    for obj in map(json.loads, lines):
        keys = {("h", tuple(obj["prompt"]), tuple(obj["output"]))} | ({("i", obj["request_id"])} if
                                                                      obj.get("request_id") else set())
        if not keys & seen:
            seen |= keys
            kept.append(obj)
    return kept


def warm(address, *args):
    return main(["warm", "--address", address, "--no-progress", *map(str, args)])


def test_warming_twice_adds_nothing(running, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    write_log(log, 200)
    state = tmp_path / "state"
    assert warm(running.address, log, "--state-dir", state, "--batch-tokens", 300) == 0
    out = capsys.readouterr().out
    first, count = running.stored()
    stats = running.stats()
    expected = len(naive_dedup(log.read_text().splitlines()))
    assert f"warmed {expected} requests" in out and f"{200 - expected} skipped as duplicates" in out
    assert count == expected == stats.stored_requests
    assert sum(len(t) + 1 for t, _ in first) == stats.stored_tokens  # the ring counts a separator per request
    assert warm(running.address, log, "--state-dir", state) == 0  # the checkpoint says the file is done
    assert "warmed 0 requests" in capsys.readouterr().out
    assert warm(running.address, log, "--state-dir", state, "--restart") == 0  # read again: all duplicates
    assert "warmed 0 requests (0 tokens) from 1 files; 200 skipped as duplicates" in capsys.readouterr().out
    again = running.stats()
    assert running.stored() == (first, count)
    assert (again.stored_requests, again.stored_tokens) == (stats.stored_requests, stats.stored_tokens)


def test_sigkill_midway_then_rerun_gives_the_store_of_a_clean_run(running, tmp_path):
    log = tmp_path / "log.jsonl"
    write_log(log, 3000, seed=1)
    state = tmp_path / "state"
    proc = subprocess.Popen([DRAFTER, "warm", str(log), "--address", running.address, "--state-dir", str(state),
                             "--batch-tokens", "100", "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    offset = 0
    while offset == 0 and time.monotonic() < deadline and proc.poll() is None:
        for f in state.glob("*.json"):
            try:
                offset = json.loads(f.read_text())["offset"]
            except ValueError:  # never half-written: replaced atomically
                pytest.fail(f"checkpoint {f} is not whole")
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    killed_at = json.loads(next(state.glob("*.json")).read_text())["offset"]
    assert 0 < killed_at < log.stat().st_size, "the run was not killed midway"
    assert running.stats().stored_requests > 0
    assert warm(running.address, log, "--state-dir", state) == 0  # resumes
    assert warm(running.address, log, "--state-dir", tmp_path / "clean-state", "--namespace", "clean") == 0
    assert running.stored("default") == running.stored("clean")
    a, b = running.stats(), running.stats("clean")
    assert (a.stored_requests, a.stored_tokens) == (b.stored_requests, b.stored_tokens)


def test_a_failure_after_the_service_stored_a_batch_loses_and_repeats_nothing(running, tmp_path):
    log = tmp_path / "log.jsonl"
    write_log(log, 300, seed=2)

    class FailsAfterStoring(GrpcSink):
        calls = 0

        def submit(self, requests):
            FailsAfterStoring.calls += 1
            reply = super().submit(requests)
            if FailsAfterStoring.calls == 4:
                reply()  # stored, but the acknowledgement is lost

                def lost():
                    raise WarmError("connection lost")
                return lost
            return reply

    state = CheckpointStore(tmp_path / "state", "t")
    with pytest.raises(WarmError):
        Warmer(FailsAfterStoring(running.address), state=state, batch_tokens=200, progress=False).warm_file(log)
    cp = state.load(log)
    assert cp is not None and 0 < cp.offset < log.stat().st_size
    done = Warmer(GrpcSink(running.address), state=state, batch_tokens=200, progress=False).warm_file(log)
    assert done.skipped > 0  # the batch stored before the failure came again and was skipped
    Warmer(GrpcSink(running.address, "clean"), batch_tokens=10 ** 6, progress=False).warm_file(log)
    assert running.stored("default") == running.stored("clean")


def test_malformed_lines_are_reported_with_line_numbers_and_valid_lines_still_ingested(running, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    lines = [json.dumps({"prompt": [1, 2], "output": [3], "request_id": "a"}),
             "{not json",
             json.dumps({"prompt": [1, "x"], "output": [3]}),
             "",
             json.dumps({"prompt": [1], "output": [VOCAB]}),
             json.dumps({"prompt": [], "output": []}),
             json.dumps({"prompt": "text", "answer": "?"}),
             json.dumps([1, 2]),
             json.dumps({"prompt": [1, True], "output": [2]}),
             json.dumps({"prompt": [4], "output": [5, 6]})]
    log.write_text("\n".join(lines))  # no newline after the last line: it is read all the same
    assert warm(running.address, log, "--state-dir", tmp_path / "state", "--batch-tokens", 2) == 0
    out = capsys.readouterr().out
    assert "warmed 2 requests (6 tokens) from 1 files; 0 skipped as duplicates; 7 malformed lines skipped" in out
    for line_no, reason in [(2, "not valid JSON"), (3, "token ids must be integers"),
                            (5, f"output holds token id {VOCAB} outside the namespace's vocabulary"),
                            (6, "no tokens"), (7, "without 'completion'"), (8, "a JSON object was expected"),
                            (9, "token ids must be integers")]:
        assert f"log.jsonl:{line_no}: " in out and reason in out.split(f"log.jsonl:{line_no}: ")[1].split("\n")[0]
    assert running.stored()[0] == [((1, 2, 3), 2), ((4, 5, 6), 1)]


def test_ingest_skips_duplicates_only_when_asked(running):
    def ingest(reqs, skip):
        reply = running.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p, output=o, request_id=r)
                                                               for p, o, r in reqs], skip_duplicates=skip))
        return reply.ingested, reply.tokens, reply.skipped

    reqs = [([1, 2], [3], "a"), ([1, 2], [3], "a"), ([4], [5], "")]
    assert ingest(reqs, False) == (3, 8, 0)  # engines' behaviour: every request is stored
    assert ingest(reqs, True) == (0, 0, 3)
    assert ingest([([9], [9], "a"), ([1], [2, 3], "b"), ([1], [2, 3], "c"), ([7], [7], "b")], True) == (1, 3, 3)
    assert ingest([([1, 2, 3], [], "d")], True) == (1, 3, 0)  # same tokens, another prompt length: a new request
    assert running.stats().stored_requests == 5 and running.stored()[1] == 5
    with grpc.insecure_channel(running.address) as ch:  # a refused batch stores nothing and remembers nothing
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DrafterStub(ch).Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[11], output=[12]),
                                                                      pb.Sequence(prompt=[VOCAB])],
                                                            skip_duplicates=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ingest([([11], [12], "")], True) == (1, 2, 0)


def test_a_grown_file_resumes_and_a_replaced_file_starts_over(running, tmp_path, capsys):
    log, state = tmp_path / "log.jsonl", tmp_path / "state"
    rows = [json.dumps({"prompt": [i], "output": [i + 1, i + 2]}) for i in range(10)]
    log.write_text("\n".join(rows[:4]) + "\n")
    assert warm(running.address, log, "--state-dir", state) == 0
    assert "warmed 4 requests" in capsys.readouterr().out
    with open(log, "a") as f:
        f.write("\n".join(rows[4:7]) + "\n")
    assert warm(running.address, log, "--state-dir", state) == 0  # only the new lines are read
    assert "warmed 3 requests (9 tokens) from 1 files; 0 skipped" in capsys.readouterr().out
    log.write_text("\n".join(rows[6:]) + "\n")  # another file at the same path
    assert warm(running.address, log, "--state-dir", state) == 0
    assert "warmed 3 requests (9 tokens) from 1 files; 1 skipped as duplicates" in capsys.readouterr().out
    assert running.stats().stored_requests == 10


def test_stop_ends_after_the_current_batch_and_the_rest_comes_later(running, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"prompt": [i % VOCAB], "output": [1, 2, 3]}) + "\n" for i in range(50)))
    state = CheckpointStore(tmp_path / "state", "t")
    warmer = Warmer(GrpcSink(running.address), state=state, batch_tokens=40, progress=False)
    warmer.stop.set()
    first = warmer.warm_file(log)
    assert first.requests == 10 and state.load(log).line == 10
    warmer.stop.clear()
    assert warmer.warm_file(log).requests == 40 and running.stats().stored_requests == 50


def test_watching_waits_for_an_unfinished_last_line(running, tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    log = folder / "a.jsonl"
    log.write_text(json.dumps({"prompt": [1], "output": [2]}) + "\n" + '{"prompt": [3], "out')  # being written
    warmer = Warmer(GrpcSink(running.address), state=CheckpointStore(tmp_path / "state", "t"), progress=False)
    assert warmer.warm_paths([folder], settled_s=60).requests == 1
    with open(log, "a") as f:
        f.write('put": [4]}')
    assert warmer.warm_paths([folder], settled_s=60).requests == 0  # still no newline, and changed just now
    os.utime(log, (time.time() - 120, time.time() - 120))
    assert warmer.warm_paths([folder], settled_s=60).requests == 1  # settled: read without its newline
    assert running.stored()[0] == [((1, 2), 1), ((3, 4), 1)]


def test_warm_watch_picks_up_new_files_and_stops_on_sigterm(running, tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"prompt": [1], "output": [2]}) + "\n")
    proc = subprocess.Popen([DRAFTER, "warm", str(folder), "--watch", "--interval", "0.2", "--address",
                             running.address, "--state-dir", str(tmp_path / "state"), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: running.stats().stored_requests == 1)
        (folder / "notes.txt").write_text("not a log")
        (folder / "sub").mkdir()
        (folder / "sub" / "b.jsonl").write_text("".join(json.dumps({"prompt": [3], "output": [i]}) + "\n"
                                                        for i in range(5)))
        wait_for(lambda: running.stats().stored_requests == 6)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "warmed 6 requests (12 tokens) from 2 files" in out


def test_serve_warm_dir_job_picks_up_a_new_file(tmp_path):
    folder = tmp_path / "drop"
    cfg = ServiceConfig(address="127.0.0.1:0", data_dir=str(tmp_path / "data"), http_address="",
                        default_vocab_size=VOCAB, drafter=DrafterConfig(capacity=1 << 16),
                        rebuild_in_subprocess=False, warm_dir=str(folder), warm_interval_s=0.2)
    with Runtime(cfg) as rt:
        with grpc.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            stub = pb_grpc.DrafterStub(ch)
            temp = tmp_path / "new.jsonl.part"
            temp.write_text("".join(json.dumps({"request_id": f"x{i}", "prompt": [i], "output": [i, 1]}) + "\n"
                                    for i in range(20)))
            os.replace(temp, folder / "new.jsonl")
            wait_for(lambda: stub.GetStats(pb.GetStatsRequest()).stored_requests == 20)
            (folder / "again.jsonl").write_text((folder / "new.jsonl").read_text())  # the same requests again
            wait_for(lambda: (tmp_path / "data" / "warm-state").is_dir() and
                     len(list((tmp_path / "data" / "warm-state").glob("*.json"))) == 2)
            assert stub.GetStats(pb.GetStatsRequest()).stored_requests == 20
    with pytest.raises(ValueError, match="warm_namespace"):
        ServiceConfig(warm_dir="x", warm_namespace="nope")
    args = build_parser().parse_args(["serve", "--warm-dir", str(folder), "--warm-tokenizer", "tok.json",
                                      "--warm-interval", "2.5", "--warm-namespace", "default"])
    cfg = config_from_args(args)
    assert (cfg.warm_dir, cfg.warm_tokenizer, cfg.warm_interval_s, cfg.warm_namespace) == \
        (str(folder), "tok.json", 2.5, "default")
    done = subprocess.run([DRAFTER, "serve", "--address", "127.0.0.1:0", "--http-address", "", "--data-dir",
                           str(tmp_path / "data2"), "--warm-dir", str(folder), "--warm-tokenizer",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "bad --warm-tokenizer: no tokenizer at" in done.stderr


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)
