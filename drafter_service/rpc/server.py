"""gRPC server construction: servicer, error interceptor, health checking, reflection, size limits.

The server is grpcio's asyncio server on a loop thread of its own (``LoopServer``): the drafting calls run on the loop,
everything that may block runs in its thread pool.
"""

from __future__ import annotations

import logging

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.rpc.backpressure import StreamLimit, StreamLimitInterceptor
from drafter_service.rpc.interceptor import ErrorInterceptor
from drafter_service.rpc.loop_server import LoopServer
from drafter_service.rpc.servicer import DrafterServicer
from drafter_service.rpc.tls import server_credentials
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name
PERSISTENCE_HEALTH = SERVICE_NAME + "/persistence"
"""Health service name that reports NOT_SERVING while the service is degraded (Redis away or requests spooled)."""


def create_server(config: ServiceConfig, address: str | None = None,
                  service: DrafterService | None = None,
                  health_servicer: health.HealthServicer | None = None) -> tuple[LoopServer, int]:
    """Build and start a gRPC server for ``service`` (a memory-only service when None).

    Args:
        config: TLS, limits (message size, workers, open streams, concurrent calls) and, when ``service`` is None,
            the namespaces.
        address: where to listen ("host:0" picks a free port); ``config.address`` when None.
        service: the service to expose.
        health_servicer: the health service to register (a new one when None), so its statuses can be changed
            later from any thread; "", ``SERVICE_NAME`` and ``PERSISTENCE_HEALTH`` start SERVING.

    Returns:
        (server, bound port); ``server.stop(grace)`` answers an event, as ``grpc.Server.stop`` does.

    Raises:
        OSError: the address cannot be listened on (nothing is left running).
    """
    credentials = server_credentials(config)  # read first: a bad file starts nothing
    service = service or DrafterService(config)
    if health_servicer is None:
        health_servicer = health.HealthServicer()
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0)]
    target = address or config.address
    runner = LoopServer(config.workers)
    bound: list[int] = []

    def build() -> grpc.aio.Server:
        server = grpc.aio.server(
            migration_thread_pool=runner.pool, options=options, maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            interceptors=[ErrorInterceptor(), StreamLimitInterceptor(StreamLimit(config.max_streams))])
        pb_grpc.add_DrafterServicer_to_server(DrafterServicer(service, runner.pool), server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        return server

    def listen(server: grpc.aio.Server) -> None:
        try:
            port = (server.add_secure_port(target, credentials) if credentials is not None
                    else server.add_insecure_port(target))
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {target}")
        bound.append(port)

    runner.start(build, listen)
    for name in ("", SERVICE_NAME, PERSISTENCE_HEALTH):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("listening on port %d", bound[0])
    return runner, bound[0]
