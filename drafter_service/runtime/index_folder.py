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


def index_file_path(config: ServiceConfig, namespace: str) -> Path:
    """A namespace's index file: ``<index folder>/<namespace>.index``."""
    return index_folder(config) / f"{namespace}{SUFFIX}"


def check_index_files_ahead(config: ServiceConfig) -> dict[Path, ChecksumAhead]:
    """Start computing the checksum of each configured namespace's index file, each in a thread of its own: at
    start-up this runs while Redis loads its data, instead of after it on the way to serving."""
    paths = (index_file_path(config, spec.name) for spec in config.namespaces)
    return {path: ChecksumAhead(path).start() for path in paths if path.is_file()}


def attach_index_files(service: DrafterService, config: ServiceConfig,
                       checked: Mapping[Path, ChecksumAhead] | None = None) -> None:
    """Give every namespace with persistence its index file, ``<index folder>/<namespace>.index`` (read at restore,
    written after each main rebuild), with its checksum computed ahead where ``checked`` has it."""
    for ns in service.namespaces.values():
        if ns.persistence is not None:
            path = index_file_path(config, ns.name)
            ns.index_files = IndexFiles(path, ns.name, ns.drafter, ns.log, ns.persistence,
                                        holding=_spool_holding(ns), checked=(checked or {}).get(path))


def _spool_holding(ns: Namespace) -> Callable[[], bool]:
    """Whether the namespace's spool (attached now or later) holds requests the log does not have yet."""
    def holding() -> bool:
        return ns.spool is not None and ns.spool.holding
    return holding
