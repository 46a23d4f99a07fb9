"""gRPC server construction: servicer, error interceptor, health checking, reflection, size limits."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.interceptor import ErrorInterceptor
from drafter_service.service import DrafterService
from drafter_service.service_config import ServiceConfig
from drafter_service.servicer import DrafterServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name


def create_server(config: ServiceConfig, address: str | None = None,
                  service: DrafterService | None = None) -> tuple[grpc.Server, int]:
    """Build and start a gRPC server for ``service`` (a memory-only service when None).

    Args:
        config: limits (message size, workers) and, when ``service`` is None, the namespaces.
        address: where to listen ("host:0" picks a free port); ``config.address`` when None.
        service: the service to expose.

    Returns:
        (server, bound port).
    """
    service = service or DrafterService(config)
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="grpc"),
                         interceptors=[ErrorInterceptor()], options=options,
                         maximum_concurrent_rpcs=config.workers * 64)
    pb_grpc.add_DrafterServicer_to_server(DrafterServicer(service), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address or config.address)
    if port == 0:
        raise OSError(f"cannot listen on {address or config.address}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("listening on port %d", port)
    return server, port

