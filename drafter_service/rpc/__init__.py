"""The gRPC layer: a thin servicer, the server with its error boundary, back-pressure, TLS and health."""

from drafter_service.rpc.persistence_health import PersistenceHealth
from drafter_service.rpc.server import PERSISTENCE_HEALTH, SERVICE_NAME, create_server
from drafter_service.rpc.servicer import DrafterServicer

__all__ = ["DrafterServicer", "PERSISTENCE_HEALTH", "PersistenceHealth", "SERVICE_NAME", "create_server"]
