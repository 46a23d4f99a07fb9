"""The running process: the service, its servers, Redis and the background jobs, started and stopped together."""

from drafter_service.runtime.runtime import Runtime

__all__ = ["Runtime"]
