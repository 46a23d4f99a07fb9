"""A namespace's frozen n-gram tables at run time: stored durably first, then drafted from; and their upload."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from drafter_service.api.errors import InvalidArgument, Unavailable
from drafter_service.api.names import NAME_RE
from store.frozen_table import FrozenNGramTable

if TYPE_CHECKING:
    from drafter_service.core.drafter import Drafter
    from store.persistence import RedisPersistence

logger = logging.getLogger(__name__)

MAX_SOURCE_CHARS = 1024
"""Longest corpus description kept with a table."""
_SAME = ("saved_at", "source", "leaders", "followers")
"""Header fields that tell two stored versions of a table apart."""


class FrozenTables:
    """The frozen tables of one namespace: each is written to persistence before drafts use it.

    Attributes:
        info: name -> header (name, source, saved_at, leader_len, follower_len, leaders, followers).
    """

    def __init__(self, namespace: str, drafter: Drafter, persistence: RedisPersistence | None) -> None:
        self.namespace = namespace
        self.drafter = drafter
        self.persistence = persistence
        self.info: dict[str, dict] = {}
        self._lock = threading.Lock()  # one change at a time, so the store and the drafter agree

    def restore(self) -> int:
        """Load every stored table into the drafter; a table that cannot be used is logged and skipped.

        Returns:
            Tables loaded.
        """
        p = self.persistence
        if p is None:
            return 0
        from store.persistence import PersistenceError

        for name in p.list_frozen():
            try:
                table, header = p.load_frozen_table(name)
                self._check(name, table)
            except (KeyError, PersistenceError, InvalidArgument) as exc:
                logger.error("namespace %s: frozen table %s not loaded: %s", self.namespace, name, exc)
                continue
            self.drafter.add_frozen(name, table)
            self.info[name] = header
            logger.info("namespace %s: frozen table %s (%d leaders, %d followers)", self.namespace, name,
                        len(table), table.followers)
        return len(self.info)

    def _check(self, name: str, table: FrozenNGramTable) -> None:
        cfg = self.drafter.config
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise InvalidArgument(f"bad frozen table name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
        if table.leader_len != cfg.leader_len or table.follower_len != cfg.follower_len:
            raise InvalidArgument(f"frozen table {name!r} has {table.leader_len}-token leaders and "
                                  f"{table.follower_len}-token followers; namespace {self.namespace!r} uses "
                                  f"{cfg.leader_len} and {cfg.follower_len}")
        if len(table) == 0:
            raise InvalidArgument(f"frozen table {name!r} has no leaders")
        if table.max_token >= cfg.vocab_size:
            raise InvalidArgument(f"frozen table {name!r} holds token id {table.max_token} outside "
                                  f"[0, {cfg.vocab_size})")

    def put(self, name: str, table: FrozenNGramTable, source: str = "") -> dict:
        """Store ``table`` durably under ``name`` (replacing one of that name), then draft from it.

        Drafts that are running keep the table they started with; the next ones use the new one.

        Returns:
            The table's header.

        Raises:
            InvalidArgument: a bad name or source, n-gram lengths other than the namespace's, no leaders,
                or token ids outside the vocabulary (nothing changes).
            Unavailable: persistence failed (nothing changes).
        """
        self._check(name, table)
        if len(source) > MAX_SOURCE_CHARS:
            raise InvalidArgument(f"source holds {len(source)} characters, more than {MAX_SOURCE_CHARS}")
        with self._lock:
            if self.persistence is not None:
                try:
                    header = self.persistence.save_frozen_table(name, table, source)
                except ValueError as exc:
                    raise InvalidArgument(str(exc)) from None
                except Exception as exc:
                    logger.error("namespace %s: could not store frozen table %s: %s", self.namespace, name, exc)
                    raise Unavailable(f"could not store frozen table {name!r} durably: {exc}") from exc
            else:
                header = {"name": name, "source": source, "saved_at": time.time(), "leader_len": table.leader_len,
                          "follower_len": table.follower_len, "leaders": len(table), "followers": table.followers}
            self.drafter.add_frozen(name, table)
            self.info[name] = header
        logger.info("namespace %s: frozen table %s stored (%d leaders, %d followers, %.1f MB)", self.namespace,
                    name, len(table), table.followers, table.nbytes / 1e6)
        return header

    def remove(self, name: str) -> bool:
        """Delete table ``name`` from persistence, then stop drafting from it; False when there was none.

        Raises:
            InvalidArgument: a bad name.
            Unavailable: persistence failed (the table stays).
        """
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise InvalidArgument(f"bad frozen table name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
        with self._lock:
            stored = False
            if self.persistence is not None:
                try:
                    stored = self.persistence.delete_frozen(name)
                except Exception as exc:
                    raise Unavailable(f"could not delete frozen table {name!r}: {exc}") from exc
            self.info.pop(name, None)
            return self.drafter.remove_frozen(name) or stored

    def sync(self) -> list[str]:
        """Make the drafted tables match the stored ones, which another replica may have put, replaced or removed.

        A table is (re)loaded when its stored header differs from the one held, and dropped when it is no
        longer stored; one that cannot be used is logged and left out, as at start.

        Returns:
            Names of the tables loaded or dropped.

        Raises:
            PersistenceUnavailable: Redis cannot be reached (nothing changes).
        """
        p = self.persistence
        if p is None:
            return []
        from store.persistence import PersistenceError, PersistenceUnavailable

        changed = []
        with self._lock:
            stored = p.list_frozen()
            for name in stored:
                header = p.frozen_header(name)
                mine = self.info.get(name)
                if header is None or (mine is not None and all(mine.get(k) == header.get(k) for k in _SAME)):
                    continue
                try:
                    table, header = p.load_frozen_table(name)
                    self._check(name, table)
                except PersistenceUnavailable:
                    raise
                except (KeyError, PersistenceError, InvalidArgument) as exc:
                    logger.error("namespace %s: frozen table %s not loaded: %s", self.namespace, name, exc)
                    continue
                self.drafter.add_frozen(name, table)
                self.info[name] = header
                changed.append(name)
            for name in sorted(set(self.info) - set(stored)):
                self.info.pop(name, None)
                self.drafter.remove_frozen(name)
                changed.append(name)
        return changed

    def list(self) -> list[dict]:
        """Headers of the tables drafts use, by name."""
        return [self.info[name] for name in sorted(self.info)]
