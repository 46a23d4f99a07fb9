"""Cache warming: completed requests from JSONL log files into a namespace, batched, checkpointed, resumable."""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
from tqdm import tqdm

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.ingest.log_reader import CHAT, TOKENS, LogRequest, MalformedLine, iter_lines, parse_line
from drafter_service.ingest.text_tokenizer import TextTokenizer, TokenizerError
from drafter_service.ingest.warm_sinks import IngestSink, Reply, WarmError
from drafter_service.ingest.warm_state import Checkpoint, CheckpointStore, unchanged

logger = logging.getLogger(__name__)

LOG_SUFFIXES = (".jsonl", ".ndjson")
"""Files of a folder that are warmed (files named on the command line are read whatever their name)."""

SHOWN_MALFORMED = 20
"""Malformed lines listed in a summary (all are logged and counted)."""


@dataclass
class WarmStats:
    """What a warming run did.

    Attributes:
        requests: requests stored.
        tokens: their tokens.
        skipped: requests the service skipped as already stored.
        malformed: lines skipped as malformed; ``malformed_lines`` lists the first ones ("file:line: reason").
        files: files read.
        bytes_read: bytes of lines read.
        seconds: wall time.
    """

    requests: int = 0
    tokens: int = 0
    skipped: int = 0
    malformed: int = 0
    files: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    malformed_lines: list[str] = field(default_factory=list)

    def add_malformed(self, where: str) -> None:
        """Count a malformed line ("file:line: reason"), listing the first ``SHOWN_MALFORMED``."""
        self.malformed += 1
        if len(self.malformed_lines) < SHOWN_MALFORMED:
            self.malformed_lines.append(where)

    def merge(self, other: WarmStats) -> None:
        """Add another run's figures (the listed malformed lines too, up to the limit)."""
        for name in ("requests", "tokens", "skipped", "malformed", "files", "bytes_read"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.malformed_lines += other.malformed_lines[:SHOWN_MALFORMED - len(self.malformed_lines)]

    def summary(self) -> str:
        """One line: requests, duplicates, malformed lines, tokens, time, rate; then the first malformed lines."""
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        lines = [f"warmed {self.requests} requests ({self.tokens} tokens) from {self.files} files; "
                 f"{self.skipped} skipped as duplicates; {self.malformed} malformed lines skipped; "
                 f"{self.seconds:.1f} s, {rate:,.0f} tokens/s"]
        lines += [f"  malformed: {m}" for m in self.malformed_lines]
        if self.malformed > len(self.malformed_lines):
            lines.append(f"  ... and {self.malformed - len(self.malformed_lines)} more (see the log)")
        return "\n".join(lines)


@dataclass
class _Batch:
    reply: Reply
    end: int  # byte offset after the last line the batch covers
    line: int  # lines up to there


def log_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files to warm: each file named, and every *.jsonl / *.ndjson under each folder, sorted.

    Raises:
        WarmError: a path does not exist.
    """
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix in LOG_SUFFIXES and f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise WarmError(f"no such file or folder: {p}")
    return out


class Warmer:
    """Reads log files line by line and sends their requests to a sink in batches, checkpointing each ack.

    Token-id lines are sent as they are; text and chat lines are tokenized in batches with the namespace's
    tokenizer (chat: the messages before the answer rendered by the chat template with the generation
    prompt; the answer's text is the output, without any end-of-turn token). Malformed lines (bad JSON,
    missing fields, non-integer or out-of-vocabulary ids, empty or over-long requests, a chat template
    failing on them) are logged with file and line number, counted and skipped. After each acknowledged
    batch the file's checkpoint moves past it, so a rerun resumes there; a crash between an ack and its
    checkpoint only resends requests the service then skips as duplicates.
    """

    def __init__(self, sink: IngestSink, tokenizer: TextTokenizer | None = None, state: CheckpointStore | None = None,
                 batch_tokens: int = 1 << 18, batch_requests: int = 4096, in_flight: int = 1,
                 stop: threading.Event | None = None, progress: bool = True) -> None:
        """Set up warming into ``sink``.

        Args:
            sink: where batches go.
            tokenizer: for text and chat lines (a text line without one stops warming with a WarmError).
            state: checkpoints; None warms every file from its start and records nothing.
            batch_tokens: tokens per batch (text: estimated at 4 characters per token).
            batch_requests: most requests per batch.
            in_flight: batches sent and not yet acknowledged while the next one is read.
            stop: when set, warming stops after the batch being sent (what was acknowledged is checkpointed).
            progress: show a progress bar per file (bytes read, requests, tokens, duplicates).
        """
        if batch_tokens < 1 or batch_requests < 1 or in_flight < 1:
            raise ValueError("batch_tokens, batch_requests and in_flight must be at least 1")
        self.sink, self.tokenizer, self.state = sink, tokenizer, state
        self.batch_tokens, self.batch_requests, self.in_flight = batch_tokens, batch_requests, in_flight
        self.stop = stop or threading.Event()
        self.progress = progress

    # -- files ----------------------------------------------------------------------------------------

    def warm_paths(self, paths: Sequence[str | Path], restart: bool = False, settled_s: float | None = None
                   ) -> WarmStats:
        """Warm every file of ``paths`` (see ``log_files``) that is new or grew since its checkpoint.

        Args:
            restart: ignore checkpoints (every file from its start).
            settled_s: None reads a last line without a newline; otherwise only once the file has not been
                modified for that many seconds (a writer may be in the middle of it).
        """
        total = WarmStats()
        t0 = time.perf_counter()
        for path in log_files(paths):
            if self.stop.is_set():
                break
            try:
                take_tail = settled_s is None or time.time() - path.stat().st_mtime >= settled_s
                total.merge(self.warm_file(path, restart=restart, take_unterminated=take_tail))
            except FileNotFoundError:  # removed since it was listed
                logger.info("%s disappeared before it was warmed", path)
        total.seconds = time.perf_counter() - t0
        return total

    def warm_file(self, path: str | Path, restart: bool = False, take_unterminated: bool = True) -> WarmStats:
        """Warm one file from its checkpoint (or its start); returns what this call did."""
        path = Path(path)
        stats = WarmStats(files=1)
        t0 = time.perf_counter()
        cp: Checkpoint | None = None
        if self.state is not None:
            if restart:
                self.state.clear(path)
            cp = self.state.load(path)
            if unchanged(cp, path):
                return WarmStats()
        start, line0 = (cp.offset, cp.line) if cp is not None else (0, 0)
        size = path.stat().st_size
        if start:
            logger.info("%s: resuming at line %d (byte %d of %d)", path, line0 + 1, start, size)
        bar = tqdm(total=size, initial=start, unit="B", unit_scale=True, desc=path.name[-40:], file=sys.stderr,
                   disable=not self.progress, leave=False)
        pending: list[LogRequest] = []
        inflight: collections.deque[_Batch] = collections.deque()
        hint, end, line = 0, start, line0
        acked = sent = start  # byte offsets: acknowledged and checkpointed; sent

        def settle(keep: int) -> None:
            """Wait for the oldest batches until ``keep`` are in flight, checkpointing each acknowledgement."""
            nonlocal cp, acked
            while len(inflight) > keep:
                batch = inflight.popleft()
                n, tokens, skipped = batch.reply()
                stats.requests, stats.tokens, stats.skipped = (stats.requests + n, stats.tokens + tokens,
                                                               stats.skipped + skipped)
                if self.state is not None:
                    cp = self.state.save(path, batch.end, batch.line, cp)
                bar.update(batch.end - acked)
                acked = batch.end
                bar.set_postfix(requests=stats.requests, tokens=stats.tokens, skipped=stats.skipped, refresh=False)

        def flush(end: int, line: int) -> None:
            """Send the pending requests (and cover the lines read so far, to ``end``) once a slot is free."""
            nonlocal hint, sent
            seqs = self._sequences(pending, path, stats)
            pending.clear()
            hint = 0
            settle(self.in_flight - 1)
            reply = self.sink.submit(seqs) if seqs else (lambda: (0, 0, 0))
            inflight.append(_Batch(reply, end, line))
            sent = end

        try:
            with open(path, "rb") as f:
                for line, end, raw in iter_lines(f, start, line0, take_unterminated):
                    stats.bytes_read += len(raw)
                    try:
                        req = parse_line(raw, line)
                    except MalformedLine as exc:
                        self._malformed(stats, path, line, str(exc))
                        continue
                    if req is None:
                        continue
                    pending.append(req)
                    hint += req.size_hint()
                    if hint >= self.batch_tokens or len(pending) >= self.batch_requests:
                        flush(end, line)
                        if self.stop.is_set():
                            break
                if end > sent:  # the last requests, or malformed lines after the last batch
                    flush(end, line)
            settle(0)
        finally:
            bar.close()
        stats.seconds = time.perf_counter() - t0
        logger.info("%s: %d requests (%d tokens) stored, %d duplicates, %d malformed lines", path, stats.requests,
                    stats.tokens, stats.skipped, stats.malformed)
        return stats

    # -- lines to messages ----------------------------------------------------------------------------

    def _malformed(self, stats: WarmStats, path: Path, line: int, reason: str) -> None:
        where = f"{path}:{line}: {reason}"
        logger.warning("malformed line skipped: %s", where)
        stats.add_malformed(where)

    def _sequences(self, reqs: list[LogRequest], path: Path, stats: WarmStats) -> list[pb.Sequence]:
        """Tokenize the text of ``reqs``, validate every request and build the messages of the valid ones."""
        texts: list[str] = []
        where: list[tuple[LogRequest, int]] = []  # (request, index of its prompt text in texts or -1)
        for req in reqs:
            if req.kind == TOKENS:
                where.append((req, -1))
                continue
            tok = self._tokenizer(path, req.line_no, req.kind == CHAT)
            if req.kind == CHAT:
                try:
                    prompt = tok.render_chat(req.messages or [], add_generation_prompt=True)
                except TokenizerError as exc:
                    self._malformed(stats, path, req.line_no, str(exc))
                    continue
            else:  # TEXT: prompt and output are text
                prompt = cast(str, req.prompt)
            where.append((req, len(texts)))
            texts += [prompt, cast(str, req.output)]
        ids = self.tokenizer.encode_batch(texts) if texts and self.tokenizer is not None else []
        out = []
        for req, k in where:
            if k < 0:  # TOKENS: the line's own ids
                prompt_ids, output_ids = cast(list, req.prompt), cast(list, req.output)
            else:
                prompt_ids, output_ids = ids[k].tolist(), ids[k + 1].tolist()
            try:
                out.append(self._sequence(prompt_ids, output_ids, req.request_id))
            except MalformedLine as exc:
                self._malformed(stats, path, req.line_no, str(exc))
        return out

    def _tokenizer(self, path: Path, line: int, chat: bool) -> TextTokenizer:
        """The tokenizer for a text line; its absence (or a chat template's) is a setup error, not a bad line."""
        if self.tokenizer is None:
            raise WarmError(f"{path}:{line} holds text: give the namespace's tokenizer (--tokenizer PATH)")
        if chat and not self.tokenizer.chat_template:
            raise WarmError(f"{path}:{line} holds chat messages but the tokenizer at {self.tokenizer.path} has no "
                            "chat template: give one with --chat-template FILE")
        return self.tokenizer

    def _sequence(self, prompt: list, output: list, request_id: str) -> pb.Sequence:
        """A Sequence of valid token ids.

        Raises:
            MalformedLine: non-integer ids, ids outside the namespace's vocabulary, no tokens, too many.
        """
        limit = self.sink.max_request_tokens
        if not prompt and not output:
            raise MalformedLine("the request has no tokens")
        if len(prompt) > limit or len(output) > limit:
            raise MalformedLine(f"{max(len(prompt), len(output))} tokens in the prompt or the output, more than "
                                f"the service's limit {limit}")
        try:
            seq = pb.Sequence(prompt=prompt, output=output, request_id=request_id)
        except (TypeError, ValueError) as exc:
            raise MalformedLine(f"token ids must be integers: {exc}") from None
        for name in ("prompt", "output"):
            arr = np.array(getattr(seq, name), dtype=np.int32)  # (n,) int32
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.sink.vocab_size):
                bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
                raise MalformedLine(f"{name} holds token id {bad} outside the namespace's vocabulary "
                                    f"[0, {self.sink.vocab_size})")
        return seq
