"""n-gram tables as flat arrays and back, in the order their items come (for snapshots in Redis)."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

Items = Iterable[tuple[Sequence[int], Iterable[tuple[Sequence[int], int]]]]
"""(leader, [(follower, count), ...]) pairs, as ``LRUNGramTable.items()`` yields them."""


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector: building millions of small containers would make it rescan them over and over."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def encode_items(items: Items, vocab_limit: int) -> tuple[dict, dict[str, np.ndarray]]:
    """Flatten (leader, [(follower, count), ...]) pairs into arrays, keeping every order.

    Raises:
        ValueError: on leaders or followers of different lengths, or token ids outside [0, vocab_limit).
    """
    leaders: list[int] = []
    fanout: list[int] = []
    followers: list[int] = []
    counts: list[int] = []
    ll = fl = None
    with gc_paused():
        for lead, fols in items:
            lead = tuple(lead)
            ll = len(lead) if ll is None else ll
            if len(lead) != ll:
                raise ValueError(f"leaders of different lengths: {ll} and {len(lead)}")
            leaders.extend(lead)
            n = 0
            for fol, count in fols:
                fol = tuple(fol)
                fl = len(fol) if fl is None else fl
                if len(fol) != fl:
                    raise ValueError(f"followers of different lengths: {fl} and {len(fol)}")
                followers.extend(fol)
                counts.append(count)
                n += 1
            fanout.append(n)
    ll, fl = ll or 0, fl or 0
    arrays: dict[str, np.ndarray] = {
        "leaders": np.array(leaders, dtype=np.int64).reshape(len(fanout), ll),  # (L, LL) token ids
        "fanout": np.array(fanout, dtype=np.int32),  # (L,) followers of each leader
        "followers": np.array(followers, dtype=np.int64).reshape(len(counts), fl),  # (F, FL) token ids
        "counts": np.array(counts, dtype=np.int64),  # (F,) insertions or corpus counts
    }
    for name in ("leaders", "followers"):
        arr = arrays[name]
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_limit):
            raise ValueError(f"{name} hold token ids outside [0, {vocab_limit})")
        arrays[name] = arr.astype(np.int32)
    header = {"leader_len": ll, "follower_len": fl, "leaders": len(fanout), "followers": len(counts)}
    return header, arrays


def encode_table(table: Any, vocab_limit: int) -> tuple[dict, dict[str, np.ndarray]]:
    """``encode_items(table.items(), vocab_limit)``, read in one native call when the table offers ``arrays()``
    (the native LRU table: no Python object per leader or follower, so a snapshot holds its lock briefly).

    Raises:
        ValueError: token ids outside [0, vocab_limit).
    """
    dump = getattr(table, "arrays", None)
    if dump is None or not len(table):
        return encode_items(table.items(), vocab_limit)
    leaders, fanout, followers, counts = dump()
    ll, fl = int(table.leader_len), int(table.follower_len)
    arrays: dict[str, np.ndarray] = {
        "leaders": np.frombuffer(leaders, dtype=np.int32).reshape(-1, ll),  # (L, LL) token ids
        "fanout": np.frombuffer(fanout, dtype=np.int32),  # (L,) followers of each leader
        "followers": np.frombuffer(followers, dtype=np.int32).reshape(-1, fl),  # (F, FL) token ids
        "counts": np.frombuffer(counts, dtype=np.int64),  # (F,) insertions
    }
    for name in ("leaders", "followers"):
        arr = arrays[name]
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_limit):
            raise ValueError(f"{name} hold token ids outside [0, {vocab_limit})")
    header = {"leader_len": ll, "follower_len": fl, "leaders": int(arrays["fanout"].size),
              "followers": int(arrays["counts"].size)}
    return header, arrays


def decode_items(arrays: dict[str, np.ndarray]) -> list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], int]]]]:
    """The (leader, [(follower, count), ...]) pairs of ``encode_items``'s arrays, in order."""
    with gc_paused():
        leaders = list(map(tuple, arrays["leaders"].tolist()))
        followers = list(zip(map(tuple, arrays["followers"].tolist()), arrays["counts"].tolist(), strict=True))
        stops = np.cumsum(arrays["fanout"], dtype=np.int64).tolist()
        out, start = [], 0
        for lead, stop in zip(leaders, stops, strict=True):
            out.append((lead, followers[start:stop]))
            start = stop
    return out
