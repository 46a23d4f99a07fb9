"""Build a frozen n-gram table from corpus files: read, tokenize and count in overlapping threads."""

from __future__ import annotations

import logging
import queue
import resource
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import numpy as np

from drafter_service.ingest.corpus_reader import Batch, CorpusOptions, CorpusReader
from store.corpus_counts import NGramCounter
from store.frozen_table import FrozenNGramTable

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_DISTINCT = 1 << 24
"""Distinct grams held while counting by default: 16 bytes each, about 50 at the peak of the final selection
(so about 800 MiB at the bound)."""


@dataclass
class CorpusReport:
    """What a build read, counted and kept."""

    files: int = 0
    bytes_read: int = 0
    documents: int = 0
    tokens: int = 0
    grams: int = 0
    distinct: int = 0
    pruned_grams: int = 0
    pruned_occurrences: int = 0
    leaders: int = 0
    followers: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)  # the first few skipped lines or files

    def lines(self) -> list[str]:
        """A human-readable summary."""
        out = [f"read {self.files} files ({self.bytes_read / 1e6:.1f} MB): {self.documents:,} documents, "
               f"{self.tokens:,} tokens",
               f"counted {self.grams:,} grams, {self.distinct:,} distinct kept; pruned {self.pruned_grams:,} rare "
               f"grams ({self.pruned_occurrences:,} occurrences)",
               f"table: {self.leaders:,} leaders, {self.followers:,} followers",
               f"{self.seconds:.1f} s ({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s), "
               f"peak RSS {self.peak_rss_bytes / 2**20:,.0f} MiB"]
        if self.skipped:
            out.append(f"skipped {self.skipped} malformed lines or files, e.g. " + "; ".join(self.problems))
        return out

    def as_dict(self) -> dict:
        """The report as a JSON-ready dictionary."""
        return asdict(self)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def in_background(items: Iterable[T], depth: int = 2, name: str = "corpus") -> Iterator[T]:
    """Yield ``items`` as a daemon thread produces them, at most ``depth`` ahead; its errors re-raise here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False  # the consumer is gone

    def run() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as exc:  # handed to the consumer
            put((done, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item, exc = q.get()
            if item is done:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        stop.set()


def _tokenized(batches: Iterable[Batch], encode: Callable[[list[str]], list[np.ndarray]] | None
               ) -> Iterator[tuple[Batch, list[np.ndarray]]]:
    """Each batch with the token ids of its documents, in order."""
    for batch in batches:
        texts = [d.text for d in batch.documents if d.text is not None]
        if texts and encode is None:
            raise ValueError("the corpus holds text: give a tokenizer (token-id JSONL needs none)")
        encoded = iter(encode(texts) if texts and encode is not None else [])
        tokens: list[np.ndarray] = []
        for d in batch.documents:
            if d.text is not None:
                tokens.append(next(encoded))
            else:
                assert d.tokens is not None  # a document holds text or token ids
                tokens.append(d.tokens)
        yield batch, tokens


def build_corpus_table(paths: Sequence[str], *, vocab_size: int,
                       encode: Callable[[list[str]], list[np.ndarray]] | None = None, leader_len: int = 1,
                       follower_len: int = 3, leader_capacity: int = 1 << 20, follower_capacity: int = 128,
                       max_distinct: int | None = DEFAULT_MAX_DISTINCT, options: CorpusOptions | None = None,
                       progress: Callable[[int], object] | None = None) -> tuple[FrozenNGramTable, CorpusReport]:
    """Read corpus files, tokenize their text, count leader-follower grams and keep the most frequent.

    Reading, tokenizing and counting run at once in three threads (the tokenizer releases the GIL), with
    two batches in flight between each; memory is bounded by ``max_distinct`` and the batch size.

    Args:
        paths: files and folders (see ``CorpusReader``).
        vocab_size: token ids are below it (the tokenizer's vocabulary, or the namespace's).
        encode: texts -> (n,) int token arrays (``TextTokenizer.encode_batch``); None for token ids only.
        leader_len, follower_len, leader_capacity, follower_capacity: the table's LL, FL, LC, FC.
        max_distinct: most distinct grams held while counting (None: no bound); see ``NGramCounter``.
        options: what to read from the files.
        progress: called with the file bytes read for each batch.

    Returns:
        The table and the report (tokens, grams, pruning, time, peak RSS, skipped lines).
    """
    t0 = time.perf_counter()
    opts = options or CorpusOptions()
    if opts.vocab_size is None:
        opts = replace(opts, vocab_size=vocab_size)
    reader = CorpusReader(paths, opts)
    counter = NGramCounter(leader_len, follower_len, vocab_size, max_distinct)
    report = CorpusReport(files=len(reader.files))
    batches = in_background(reader.batches(), name="corpus-read")
    for batch, docs in in_background(_tokenized(batches, encode), name="corpus-tokenize"):
        for doc, tokens in zip(batch.documents, docs, strict=True):
            counter.add(tokens, continues=doc.continues)
        report.bytes_read += batch.nbytes
        if progress is not None:
            progress(batch.nbytes)
    table = counter.table(leader_capacity, follower_capacity)
    report.documents, report.tokens, report.grams = counter.documents, counter.tokens, counter.grams
    report.distinct, report.pruned_grams = counter.distinct, counter.pruned_grams
    report.pruned_occurrences = counter.pruned_occurrences
    report.leaders, report.followers = len(table), table.followers
    report.skipped = len(reader.problems)
    report.problems = [f"{f}:{line} {why}" if line else f"{f} {why}" for f, line, why in reader.problems[:3]]
    report.seconds = time.perf_counter() - t0
    report.peak_rss_bytes = peak_rss_bytes()
    logger.info("corpus table built: %s", " | ".join(report.lines()))
    return table, report
