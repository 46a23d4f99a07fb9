"""Index files at start-up: one per namespace with persistence, in the index folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from drafter_service.namespaces.index_files import SUFFIX, IndexFiles
from drafter_service.namespaces.namespace import Namespace
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService


def index_folder(config: ServiceConfig) -> Path:
    """Where index files go: ``index_dir``, or ``<data_dir>/index``."""
    return Path(config.index_dir) if config.index_dir else Path(config.data_dir) / "index"


def attach_index_files(service: DrafterService, config: ServiceConfig) -> None:
    """Give every namespace with persistence its index file, ``<index folder>/<namespace>.index`` (read at restore,
    written after each main rebuild)."""
    folder = index_folder(config)
    for ns in service.namespaces.values():
        if ns.persistence is not None:
            ns.index_files = IndexFiles(folder / f"{ns.name}{SUFFIX}", ns.name, ns.drafter, ns.log, ns.persistence,
                                        holding=_spool_holding(ns))


def _spool_holding(ns: Namespace) -> Callable[[], bool]:
    """Whether the namespace's spool (attached now or later) holds requests the log does not have yet."""
    def holding() -> bool:
        return ns.spool is not None and ns.spool.holding
    return holding
