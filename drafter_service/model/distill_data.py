"""Training data for ``drafter distill-draft``: requests from Redis, files or data sets, cut into windows."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from drafter_service.datasets.loaders import Request, load_dataset, read_requests

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: A data source: its name and its requests' token sequences, each (n,) int32.
Source = tuple[str, list[np.ndarray]]


class DistillError(ValueError):
    """The training data or settings cannot be used; the message says why."""


def read_token_file(path: str | pathlib.Path) -> list[np.ndarray]:
    """Prompt + output of every request in a JSONL file, as (n,) int32 arrays.

    Reads the request format of :func:`~drafter_service.datasets.loaders.read_requests` and the e2e
    benchmark's warm-up files (``{"id", "prompt", "output"}`` a line).
    """
    path = pathlib.Path(path)
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if first.strip() and '"request_id"' not in first:
        try:
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            requests: Iterable[Request] = [Request(str(r["id"]), r["prompt"], r["output"]) for r in rows]
        except (ValueError, KeyError, TypeError) as exc:
            raise DistillError(f"{path}: not a request JSONL file ({exc!r})") from None
    else:
        requests = read_requests(path)
    return [np.concatenate([r.prompt, r.output]) for r in requests]


def redis_sequences(url: str, namespace: str) -> list[np.ndarray]:
    """The token sequences of every request a namespace has stored in Redis, oldest first."""
    from store.persistence import RedisPersistence

    store = RedisPersistence(url, namespace, durable=False)
    try:
        return [tokens for _, tokens, _ in store.iter_requests()]
    finally:
        store.client.close()


def load_sources(redis_url: str | None = None, data_dir: str | None = None, namespace: str = "default",
                 tokens: Sequence[str] = (), datasets: Sequence[str] = (), limit: int | None = None,
                 skip: int = 0) -> list[Source]:
    """Read every named source, in this order: Redis, data dir, token files, data sets.

    Args:
        redis_url: read ``namespace``'s stored requests from this Redis.
        data_dir: read them from a ``drafter serve --data-dir`` folder, starting its embedded Redis.
        namespace: the namespace for ``redis_url`` and ``data_dir``.
        tokens: request JSONL files (see :func:`read_token_file`).
        datasets: built-in data set names (:data:`~drafter_service.datasets.loaders.DATASET_NAMES`).
        limit: requests per data set (None: each set's default).
        skip: requests skipped first in each data set, which then gives requests [skip, skip + limit) (with no
            ``limit``: those of its default after the first ``skip``), e.g. to keep a replay's requests out.

    Raises:
        DistillError: when no source is named, ``skip`` is negative or leaves a data set empty.
    """
    if skip < 0:  # checked before any source is read
        raise DistillError(f"--skip must be >= 0, got {skip}")
    sources: list[Source] = []
    if redis_url:
        sources.append((f"redis:{namespace}", redis_sequences(redis_url, namespace)))
    if data_dir:
        from store.embedded_redis import EmbeddedRedis

        with EmbeddedRedis(data_dir) as server:
            sources.append((f"data-dir:{namespace}", redis_sequences(server.url, namespace)))
    for path in tokens:
        sources.append((pathlib.Path(path).stem, read_token_file(path)))
    for name in datasets:
        reqs = load_dataset(name, None if limit is None else skip + limit)[skip:]
        if not reqs:
            raise DistillError(f"data set {name} has no requests after skipping {skip}")
        sources.append((name, [np.concatenate([r.prompt, r.output]) for r in reqs]))
    if not sources:
        raise DistillError("no training data: give --redis-url, --data-dir, --tokens or --dataset")
    for name, seqs in sources:
        logger.info("source %s: %d requests, %d tokens", name, len(seqs), sum(len(s) for s in seqs))
    return sources


def check_vocab(sources: list[Source], vocab_size: int) -> None:
    """Raise DistillError naming the source and request of the first token id outside [0, vocab_size)."""
    for name, seqs in sources:
        for i, seq in enumerate(seqs):
            if len(seq) and (int(seq.min()) < 0 or int(seq.max()) >= vocab_size):
                bad = int(seq.max()) if int(seq.max()) >= vocab_size else int(seq.min())
                raise DistillError(f"{name}: request {i} holds token id {bad}, outside the target's vocabulary "
                                   f"[0, {vocab_size})")


def split_requests(sources: list[Source], eval_requests: int, seed: int
                   ) -> tuple[list[Source], list[Source]]:
    """Hold out ``eval_requests`` requests, taken from the (shuffled) sources in turn.

    Every source keeps at least one request for training. Returns (training sources, held-out sources).
    """
    rng = np.random.default_rng(seed)
    shuffled = [[seqs[i] for i in rng.permutation(len(seqs))] for _, seqs in sources]
    held: list[list[np.ndarray]] = [[] for _ in sources]
    while sum(map(len, held)) < eval_requests:
        took = False
        for s, seqs in enumerate(shuffled):
            if len(seqs) > 1 and sum(map(len, held)) < eval_requests:
                held[s].append(seqs.pop())
                took = True
        if not took:
            break
    names = [name for name, _ in sources]
    return (list(zip(names, shuffled, strict=True)), [(n, h) for n, h in zip(names, held, strict=True) if h])


def windows(seqs: list[np.ndarray], seq_len: int) -> list[np.ndarray]:
    """Consecutive non-overlapping windows of at most ``seq_len`` tokens of every sequence."""
    return [s[i:i + seq_len] for s in seqs for i in range(0, len(s), seq_len)]


class WindowStream:
    """Training windows in an order fixed by the seed: window ``g`` of the stream is a pure function of ``g``.

    With several sources (mix "balanced") they take turns, each cycling through its own windows in a fresh
    random order per epoch, so a small source weighs as much as a large one.
    """

    def __init__(self, per_source: list[list[np.ndarray]], seed: int) -> None:
        self.sources = [w for w in per_source if w]
        if not self.sources:
            raise DistillError("no training windows left after holding out the evaluation requests")
        self.seed = seed
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, (n,) int64 permutation)

    def __getitem__(self, g: int) -> np.ndarray:
        s, k = g % len(self.sources), g // len(self.sources)
        epoch, i = divmod(k, len(self.sources[s]))
        if self._perms.get(s, (-1,))[0] != epoch:
            perm = np.random.default_rng([self.seed, s, epoch]).permutation(len(self.sources[s]))
            self._perms[s] = (epoch, perm)
        return self.sources[s][self._perms[s][1][i]]

    def __len__(self) -> int:
        return sum(map(len, self.sources))


def pad_batch(batch: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) int64 token ids and their (B, T) bool mask of real positions.

    A causal model never attends forward, so padding at the end changes nothing before it.
    """
    import torch

    ids = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for row, w in enumerate(batch):
        ids[row, :len(w)] = torch.from_numpy(w.astype(np.int64))
        mask[row, :len(w)] = True
    return ids, mask
