"""The service: namespaces and sessions routed per tenant, authorization, health, and its configuration."""

from drafter_service.service.auth import TRUSTED, Authorizer, Caller, HttpAuth
from drafter_service.service.config import NamespaceSpec, ServiceConfig
from drafter_service.service.health import health_report
from drafter_service.service.service import DrafterService

__all__ = ["Authorizer", "Caller", "DrafterService", "HttpAuth", "NamespaceSpec", "ServiceConfig", "TRUSTED",
           "health_report"]
