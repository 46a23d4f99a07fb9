"""`drafter bench warm`: throughput of `drafter warm` into a real service, from token-id and text logs."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.datasets.loaders import Request, load_dataset

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from drafter_service.api.drafter.v1 import drafter_pb2 as pb
    from drafter_service.ingest.text_tokenizer import TextTokenizer
    from drafter_service.ingest.warm_sinks import Reply

_SUMMARY = re.compile(r"warmed (\d+) requests \((\d+) tokens\).*?(\d+) skipped as duplicates")


def add_warm_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench warm``."""
    p = bench.add_parser("warm", help="tokens/s of `drafter warm` into a real service (token ids and text)")
    p.add_argument("--tokens", type=int, default=20_000_000, help="tokens in the token-id log")
    p.add_argument("--text-requests", type=int, default=2000, help="requests in the text log (0: no text run)")
    p.add_argument("--batch-tokens", type=int, default=1 << 18, help="--batch-tokens of drafter warm")
    p.add_argument("--out", default="bench-data/warm", help="folder of the generated logs (kept for reruns)")
    p.set_defaults(func=run_warm_bench)


def write_token_log(path: Path, requests: list[Request], tokens: int) -> tuple[int, int]:
    """Write ShareGPT requests as token-id JSONL until ``tokens`` tokens; returns (requests, tokens) written.

    Pass k > 0 over the data prepends token k to every prompt, so each copy is a new request (not a duplicate)
    with real text statistics; request ids are fresh too.
    """
    n = total = 0
    with open(path, "w", encoding="utf-8") as f, tqdm(total=tokens, unit="tok", unit_scale=True,
                                                       desc="writing the log", file=sys.stderr) as bar:
        k = 0
        while total < tokens:
            for r in requests:
                prompt = ([k] if k else []) + r.prompt.tolist()
                f.write(json.dumps({"request_id": f"c{k}-{r.request_id}", "prompt": prompt,
                                    "output": r.output.tolist()}, separators=(",", ":")) + "\n")
                size = len(prompt) + r.output.size
                n, total = n + 1, total + size
                bar.update(size)
                if total >= tokens:
                    break
            k += 1
    return n, total


def write_text_log(path: Path, requests: list[Request], tokenizer: Tokenizer) -> list[str]:
    """Write requests decoded to text (``prompt`` / ``completion``); returns the texts in encoding order."""
    texts: list[str] = []
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            prompt = tokenizer.decode(r.prompt.tolist(), skip_special_tokens=False)
            output = tokenizer.decode(r.output.tolist(), skip_special_tokens=False)
            f.write(json.dumps({"request_id": r.request_id, "prompt": prompt, "completion": output}) + "\n")
            texts += [prompt, output]
    return texts


def _warm(address: str, path: Path, state: Path, *extra: str) -> tuple[float, int, int, int]:
    """Run `drafter warm` as a process; returns (seconds, requests stored, tokens stored, duplicates skipped)."""
    exe = str(Path(sys.executable).parent / "drafter")
    t0 = time.perf_counter()
    done = subprocess.run([exe, "warm", str(path), "--address", address, "--state-dir", str(state), "--no-progress",
                           *extra], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"drafter warm failed ({done.returncode}): {done.stderr[-2000:]}")
    found = _SUMMARY.search(done.stdout)
    if found is None:
        raise RuntimeError(f"no summary in drafter warm's output: {done.stdout[-2000:]}")
    n, tokens, skipped = map(int, found.groups())
    return seconds, n, tokens, skipped


def run_warm_bench(args: argparse.Namespace) -> int:
    """Generate the logs, start a service, time `drafter warm` on them, print tokens/s."""
    from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = load_dataset("sharegpt", 13000)
    token_log = out / f"tokens-{args.tokens}.jsonl"
    if not token_log.is_file():
        write_token_log(token_log, requests, args.tokens)
    tokenizer = load_smollm2_tokenizer()
    text_log = out / f"text-{args.text_requests}.jsonl"
    texts = write_text_log(text_log, requests[:args.text_requests], tokenizer) if args.text_requests else []
    with tempfile.TemporaryDirectory(prefix="drafter-bench-warm-") as tmp:
        svc = ServiceProcess(Path(tmp) / "data", capacity=int(args.tokens * 1.1) + (1 << 20),
                             extra_args=["--namespaces", "text=49152"])
        svc.start()
        try:
            size_mb = token_log.stat().st_size / 1e6
            seconds, n, tokens, skipped = _warm(svc.address, token_log, Path(tmp) / "state",
                                                "--batch-tokens", str(args.batch_tokens))
            print(f"token-id log ({size_mb:,.0f} MB): {n:,} requests stored ({tokens:,} tokens), {skipped:,} "
                  "skipped as duplicates (ShareGPT repeats some requests)")
            print(f"  drafter warm, wall time of the process: {seconds:.1f} s = {tokens / seconds:,.0f} tokens/s")
            seconds, _, _, skipped = _warm(svc.address, token_log, Path(tmp) / "state", "--restart")
            print(f"  again with --restart (every request a duplicate): {seconds:.1f} s, {skipped:,} skipped")
            print(f"  the reader alone (a sink that stores nothing): {_reader_alone(token_log):,.0f} tokens/s")
            if texts:
                _text_run(svc.address, text_log, Path(tmp) / "state", texts)
        finally:
            svc.stop()
    return 0


def _text_run(address: str, text_log: Path, state: Path, texts: list[str]) -> None:
    from drafter_service.datasets.cache import cache_dir
    from drafter_service.datasets.tokenizer import CACHE_FILENAME
    from drafter_service.ingest.text_tokenizer import TextTokenizer

    tok_path = cache_dir() / CACHE_FILENAME
    seconds, n, tokens, skipped = _warm(address, text_log, state, "--tokenizer", str(tok_path),
                                        "--namespace", "text")
    print(f"text log ({text_log.stat().st_size / 1e6:,.1f} MB, SmolLM2's tokenizer, {os.cpu_count()} cores):")
    print(f"  drafter warm: {n:,} requests stored ({tokens:,} tokens, {skipped:,} duplicates) in {seconds:.1f} s "
          f"= {tokens / seconds:,.0f} tokens/s")
    tok = TextTokenizer.load(tok_path)
    t0 = time.perf_counter()
    ids = [a for i in range(0, len(texts), 512) for a in tok.encode_batch(texts[i:i + 512])]
    alone = time.perf_counter() - t0
    count = int(sum(a.size for a in ids))
    print(f"  the tokenizer alone (encode_batch, same texts): {count:,} tokens in {alone:.1f} s = "
          f"{count / alone:,.0f} tokens/s")
    print(f"  the reader with the tokenizer (a sink that stores nothing): {_reader_alone(text_log, tok):,.0f} "
          "tokens/s")


class _NullSink:
    """Acknowledges every batch at once without storing it: the cost of reading, tokenizing and building messages."""

    namespace, target, vocab_size, max_request_tokens = "default", "null", 1 << 31, 1 << 20

    def submit(self, requests: Sequence[pb.Sequence]) -> Reply:
        tokens = sum(len(r.prompt) + len(r.output) for r in requests)
        return lambda: (len(requests), tokens, 0)

    def close(self) -> None:
        pass


def _reader_alone(path: Path, tokenizer: TextTokenizer | None = None) -> float:
    """Tokens/s of ``Warmer`` reading ``path`` into a sink that does nothing, in this process."""
    from drafter_service.ingest.warm import Warmer

    t0 = time.perf_counter()
    done = Warmer(_NullSink(), tokenizer, progress=False).warm_file(path)
    return done.tokens / (time.perf_counter() - t0)
