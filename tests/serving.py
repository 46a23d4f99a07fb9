"""Helpers for tests that start services: a free local port, and waiting until a service reports SERVING."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout: float = 60.0, proc: subprocess.Popen | None = None,
                 channel: Callable[[str], grpc.Channel] = grpc.insecure_channel) -> None:
    """Poll the health service at ``address`` until ``drafter.v1.Drafter`` is SERVING.

    Raises:
        TimeoutError: after ``timeout`` seconds, or at once when ``proc`` (the service's process) has exited.
    """
    deadline = time.monotonic() + timeout
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"),
                              timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if proc is not None and proc.poll() is not None:
                raise TimeoutError(f"the service at {address} exited: {proc.communicate()[0]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no service at {address}")
            time.sleep(0.1)
