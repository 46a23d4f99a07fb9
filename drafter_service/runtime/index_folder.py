"""Index files at start-up: one per namespace with persistence, in the index folder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from drafter_service.namespaces.index_files import SUFFIX, IndexFiles
from drafter_service.namespaces.namespace import Namespace
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService
from store.index_file import ChecksumAhead


def index_folder(config: ServiceConfig) -> Path:
    """Where index files go: ``index_dir``, or ``<data_dir>/index``."""
    return Path(config.index_dir) if config.index_dir else Path(config.data_dir) / "index"


def check_index_files_ahead(config: ServiceConfig) -> dict[Path, ChecksumAhead]:
    """Start computing the checksum of every index file in the index folder, each in a thread of its own: at
    start-up this runs while Redis loads its data, instead of after it on the way to serving."""
    folder = index_folder(config)
    if not folder.is_dir():
        return {}
    return {path: ChecksumAhead(path).start() for path in sorted(folder.glob(f"*{SUFFIX}"))}


def attach_index_files(service: DrafterService, config: ServiceConfig,
                       checked: Mapping[Path, ChecksumAhead] | None = None) -> None:
    """Give every namespace with persistence its index file, ``<index folder>/<namespace>.index`` (read at restore,
    written after each main rebuild), with its checksum computed ahead where ``checked`` has it."""
    folder = index_folder(config)
    for ns in service.namespaces.values():
        if ns.persistence is not None:
            path = folder / f"{ns.name}{SUFFIX}"
            ns.index_files = IndexFiles(path, ns.name, ns.drafter, ns.log, ns.persistence,
                                        holding=_spool_holding(ns), checked=(checked or {}).get(path))


def _spool_holding(ns: Namespace) -> Callable[[], bool]:
    """Whether the namespace's spool (attached now or later) holds requests the log does not have yet."""
    def holding() -> bool:
        return ns.spool is not None and ns.spool.holding
    return holding
