"""Spools at start-up: one per namespace with persistence, after adopting what stopped processes left."""

from __future__ import annotations

from pathlib import Path

from drafter_service.namespaces.spooling import SpoolingLog
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService


def spool_folder(config: ServiceConfig) -> Path:
    """Where spool files go: ``spool_dir``, or ``<data_dir>/spool``."""
    return Path(config.spool_dir) if config.spool_dir else Path(config.data_dir) / "spool"


def attach_spools(service: DrafterService, config: ServiceConfig) -> int:
    """Give every namespace with persistence a spool (``spool_max_bytes`` > 0) and adopt dead processes' files.

    Returns:
        Requests moved to Redis from the spools of stopped processes.
    """
    if config.spool_max_bytes <= 0:
        return 0
    folder = spool_folder(config)
    moved = 0
    for ns in service.namespaces.values():
        if ns.persistence is None:
            continue
        ns.spool = SpoolingLog(ns.log, folder, config.spool_max_bytes)
        moved += ns.spool.adopt_orphans()
    return moved
