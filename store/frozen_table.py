"""Frozen n-gram tables: the most frequent leaders of a corpus with their most frequent followers, as CSR arrays."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

Follower = tuple[int, ...]

_MEMO_LEADERS = 16384
"""Leaders whose first followers are kept decoded as Python tuples (the older half is dropped when full)."""
_MEMO_FOLLOWERS = 8
"""Followers kept decoded per leader at first; a query with a larger limit widens it (clearing the memo)."""
_MEMO_MAX_FOLLOWERS = 64
"""Queries with a larger limit (or none) decode from the arrays each time."""
_DENSE_INDEX_LIMIT = 1 << 26
"""Single-token leaders below this id are found through a dense (max id + 1,) row index."""


class FrozenNGramTable:
    """A read-only table built offline: the most frequent leaders, each with its most frequent followers.

    The table is held as compressed sparse rows, so a table of a million leaders costs a few arrays rather
    than millions of Python objects. Leaders keep the order they were given (most frequent first when built);
    the followers of each leader are most frequent first, ties keeping the given order.
    """

    def __init__(self, leader_len: int, follower_len: int,
                 entries: dict[Follower, list[tuple[Follower, int]]] | None = None) -> None:
        """Wrap prepared entries (leader -> followers with counts); ``from_arrays`` is the direct way."""
        self.leader_len = int(leader_len)
        self.follower_len = int(follower_len)
        if self.leader_len < 1 or self.follower_len < 1:
            raise ValueError(f"leader_len and follower_len must be at least 1, got {leader_len}, {follower_len}")
        entries = entries or {}
        leaders = np.array([t for lead in entries for t in lead], dtype=np.int64).reshape(-1, self.leader_len)
        fols = [f for found in entries.values() for f in found]
        self._install(leaders,
                      np.array([len(found) for found in entries.values()], dtype=np.int64),
                      np.array([t for f, _ in fols for t in f], dtype=np.int64).reshape(-1, self.follower_len),
                      np.array([c for _, c in fols], dtype=np.int64))

    @classmethod
    def from_arrays(cls, leader_len: int, follower_len: int, leaders: np.ndarray, fanout: np.ndarray,
                    followers: np.ndarray, counts: np.ndarray) -> FrozenNGramTable:
        """A table from CSR arrays (as ``arrays()`` returns them).

        Args:
            leader_len: LL, tokens per leader.
            follower_len: FL, tokens per follower.
            leaders: (L, LL) or (L * LL,) integer token ids, distinct rows, in table order.
            fanout: (L,) followers of each leader (at least 1 each).
            followers: (F, FL) or (F * FL,) integer token ids, every leader's followers in turn.
            counts: (F,) non-negative corpus count of each follower.

        Raises:
            ValueError: on shapes that do not fit together, negative ids or counts, empty fanouts or a
                repeated leader.
        """
        table = cls.__new__(cls)
        table.leader_len, table.follower_len = int(leader_len), int(follower_len)
        if table.leader_len < 1 or table.follower_len < 1:
            raise ValueError(f"leader_len and follower_len must be at least 1, got {leader_len}, {follower_len}")
        table._install(leaders, fanout, followers, counts)
        return table

    def _install(self, leaders: np.ndarray, fanout: np.ndarray, followers: np.ndarray, counts: np.ndarray) -> None:
        ll, fl = self.leader_len, self.follower_len
        leaders, followers = np.asarray(leaders), np.asarray(followers)
        fanout, counts = np.asarray(fanout).ravel(), np.asarray(counts).ravel()
        for name, arr in (("leaders", leaders), ("fanout", fanout), ("followers", followers), ("counts", counts)):
            if arr.size and arr.dtype.kind not in "iu":
                raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
        if leaders.size % ll or followers.size % fl:
            raise ValueError(f"leaders hold {leaders.size} ids and followers {followers.size}: not whole "
                             f"{ll}-token leaders and {fl}-token followers")
        n_lead, n_fol = leaders.size // ll, followers.size // fl
        if fanout.size != n_lead:
            raise ValueError(f"fanout has {fanout.size} entries for {n_lead} leaders")
        if counts.size != n_fol:
            raise ValueError(f"counts has {counts.size} entries for {n_fol} followers")
        if fanout.size and int(fanout.min()) < 1:
            raise ValueError("every leader needs at least one follower (fanout >= 1)")
        if int(fanout.sum(dtype=np.int64)) != n_fol:
            raise ValueError(f"fanout adds up to {int(fanout.sum(dtype=np.int64))}, not to the {n_fol} followers")
        if counts.size and int(counts.min()) < 0:
            raise ValueError("counts must be non-negative")
        for name, arr in (("leaders", leaders), ("followers", followers)):
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 31):
                raise ValueError(f"{name} hold token ids outside [0, 2^31)")
        self._leaders = leaders.astype(np.int32).reshape(n_lead, ll)  # (L, LL) token ids, table order
        self._fanout = fanout.astype(np.int32)  # (L,) followers per leader
        self._offsets = np.zeros(n_lead + 1, dtype=np.int64)  # (L + 1,) first follower of each leader
        np.cumsum(self._fanout, out=self._offsets[1:])
        counts = counts.astype(np.int64)
        followers = followers.astype(np.int32).reshape(n_fol, fl)
        rising = np.flatnonzero(counts[1:] > counts[:-1]) + 1  # followers counted more than the one before
        if rising.size and not np.isin(rising, self._offsets[1:-1]).all():  # ... within a leader: reorder
            owner = np.repeat(np.arange(n_lead, dtype=np.int64), self._fanout)  # (F,) leader row of each follower
            order = np.lexsort((-counts, owner))  # most frequent first within each leader, stable
            followers, counts = followers[order], counts[order]
        self._followers = followers  # (F, FL) token ids
        self._counts = counts  # (F,) corpus counts
        for arr in (self._leaders, self._fanout, self._offsets, self._followers, self._counts):
            arr.flags.writeable = False
        self._build_index()
        # (width, leader -> its first ``width`` followers decoded)
        self._memo: tuple[int, dict[Follower, list[tuple[Follower, int]]]] = (_MEMO_FOLLOWERS, {})

    def _build_index(self) -> None:
        """Leader -> row: a dense array for single-token leaders, sorted byte keys otherwise."""
        n = self._leaders.shape[0]
        self._row_of: np.ndarray | None = None  # (max id + 1,) int32 row of each single-token leader, -1 if none
        self._keys: np.ndarray | None = None  # (L,) void big-endian leader rows, sorted
        self._key_rows: np.ndarray | None = None  # (L,) int64 row of each sorted key
        if self.leader_len == 1 and (n == 0 or int(self._leaders.max()) < _DENSE_INDEX_LIMIT):
            self._row_of = np.full(int(self._leaders.max(initial=-1)) + 1, -1, dtype=np.int32)
            self._row_of[self._leaders[:, 0]] = np.arange(n, dtype=np.int32)
            if int((self._row_of >= 0).sum()) != n:
                raise ValueError("leaders must be distinct")
            return
        keys = self._leader_keys(self._leaders)
        self._key_rows = np.argsort(keys, kind="stable")
        self._keys = keys[self._key_rows]
        if n > 1 and bool((self._keys[1:] == self._keys[:-1]).any()):
            raise ValueError("leaders must be distinct")

    def _leader_keys(self, rows: np.ndarray) -> np.ndarray:
        """(n,) void keys whose byte order is the rows' lexicographic order (ids are non-negative)."""
        big = np.ascontiguousarray(rows, dtype=">u4").reshape(-1, self.leader_len)
        return big.view(f"V{4 * self.leader_len}").ravel()

    def _row(self, leader: Follower) -> int:
        """Row of ``leader`` in the table, or -1."""
        if len(leader) != self.leader_len:
            return -1
        if self._row_of is not None:
            tok = leader[0]
            return int(self._row_of[tok]) if 0 <= tok < self._row_of.size else -1
        if min(leader) < 0 or max(leader) >= 1 << 31:
            return -1
        keys, key_rows = self._keys, self._key_rows
        assert keys is not None and key_rows is not None  # _build_index sets them when there is no _row_of
        key = self._leader_keys(np.array(leader, dtype=np.int64))
        at = int(np.searchsorted(keys, key[0]))
        return int(key_rows[at]) if at < keys.size and keys[at] == key[0] else -1

    def _decode(self, row: int, limit: int) -> list[tuple[Follower, int]]:
        start, stop = self._offsets[row:row + 2].tolist()
        stop = min(stop, start + limit)
        ids = iter(self._followers[start:stop].ravel().tolist())
        return list(zip(zip(*[ids] * self.follower_len, strict=True), self._counts[start:stop].tolist(), strict=True))

    def __len__(self) -> int:
        return int(self._leaders.shape[0])

    @property
    def followers(self) -> int:
        """Followers held over all leaders."""
        return int(self._counts.size)

    def query(self, leader: Sequence[int], limit: int | None = None) -> list[tuple[Follower, int]]:
        """Followers of ``leader`` with their corpus counts, most frequent first (empty if unknown).

        The first followers of recently asked leaders are kept decoded (as many as the widest query asked
        for, up to 64), so a draft pays for the arrays only on a leader's first query.
        """
        key = tuple(leader)
        width, memo = self._memo  # read together: a wider memo may replace both at any time
        if limit is not None and limit <= width:
            found = memo.get(key)
            if found is None:
                found = self._remember(key, width, memo)
            return found[:limit]
        if limit is not None and limit <= _MEMO_MAX_FOLLOWERS:  # wider than before: remember wider lists
            self._memo = (limit, {})
            return self.query(key, limit)
        row = self._row(key)
        return [] if row < 0 else self._decode(row, self.followers if limit is None else limit)

    def _remember(self, key: Follower, width: int, memo: dict) -> list[tuple[Follower, int]]:
        row = self._row(key)
        found = [] if row < 0 else self._decode(row, width)
        if len(memo) >= _MEMO_LEADERS:  # forget the older half (in the order they were first asked)
            memo = dict(list(memo.items())[len(memo) // 2:])
            if self._memo[0] == width:
                self._memo = (width, memo)
        memo[key] = found
        return found

    def items(self) -> Iterator[tuple[Follower, list[tuple[Follower, int]]]]:
        """Every leader with its followers, in the table's order."""
        for row, lead in enumerate(self._leaders.tolist()):
            yield tuple(lead), self._decode(row, len(self._counts))

    def arrays(self) -> dict[str, np.ndarray]:
        """The read-only CSR arrays: leaders (L, LL), fanout (L,), followers (F, FL) int32; counts (F,) int64."""
        return {"leaders": self._leaders, "fanout": self._fanout, "followers": self._followers,
                "counts": self._counts}

    @property
    def max_token(self) -> int:
        """Largest token id in the table (-1 when empty)."""
        return max(int(self._leaders.max(initial=-1)), int(self._followers.max(initial=-1)))

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays and the leader index."""
        parts: list[np.ndarray | None] = [self._leaders, self._fanout, self._offsets, self._followers, self._counts,
                 self._row_of, self._keys, self._key_rows]
        return sum(p.nbytes for p in parts if p is not None)

    def check_invariants(self, leader_capacity: int | None = None, follower_capacity: int | None = None) -> None:
        """Raise AssertionError when shapes, ordering, the index or the optional capacities are violated."""
        n, f = len(self), self.followers
        assert self._leaders.shape == (n, self.leader_len) and self._followers.shape == (f, self.follower_len)
        assert self._fanout.shape == (n,) and self._offsets[-1] == f and self._counts.shape == (f,)
        assert n == 0 or int(self._fanout.min()) >= 1, "a leader without followers"
        assert leader_capacity is None or n <= leader_capacity
        assert follower_capacity is None or n == 0 or int(self._fanout.max()) <= follower_capacity
        owner = np.repeat(np.arange(n), self._fanout)
        assert not bool(((owner[1:] == owner[:-1]) & (self._counts[1:] > self._counts[:-1])).any()), \
            "followers not most frequent first"
        assert f == 0 or int(self._counts.min()) >= 0
        for row, lead in enumerate(self._leaders.tolist()):
            assert self._row(tuple(lead)) == row, f"leader {lead} is not found at row {row}"


def save_npz(path: str | pathlib.Path, table: FrozenNGramTable, source: str = "") -> None:
    """Write ``table`` (and a description of its corpus) to an .npz file."""
    fields: dict[str, Any] = {"leader_len": np.int64(table.leader_len), "follower_len": np.int64(table.follower_len),
                              "source": np.array(source), **table.arrays()}
    np.savez(path, **fields)  # Any values: mypy would match the arrays against savez's allow_pickle too


def load_npz(path: str | pathlib.Path) -> tuple[FrozenNGramTable, str]:
    """Read a table written by ``save_npz``; returns it with its corpus description.

    Raises:
        ValueError: when the file is not such a table.
    """
    with np.load(path, allow_pickle=False) as data:
        try:
            table = FrozenNGramTable.from_arrays(int(data["leader_len"]), int(data["follower_len"]), data["leaders"],
                                                 data["fanout"], data["followers"], data["counts"])
            source = str(data["source"]) if "source" in data else ""
        except KeyError as exc:
            raise ValueError(f"{path} is not a frozen table file: missing {exc}") from None
    return table, source
