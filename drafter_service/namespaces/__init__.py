"""A namespace at run time: its drafter, frozen tables, statistics, and durable log (spool and follower)."""

from drafter_service.namespaces.durable_log import DurableLog
from drafter_service.namespaces.log_follower import LogFollower
from drafter_service.namespaces.namespace import Namespace
from drafter_service.namespaces.spooling import SpoolingLog
from drafter_service.namespaces.stats import DraftCounters, NamespaceStats, estimated_speedup

__all__ = ["DraftCounters", "DurableLog", "LogFollower", "Namespace", "NamespaceStats", "SpoolingLog",
           "estimated_speedup"]
