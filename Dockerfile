# drafter service image: the C kernels are built here, Redis comes from the compose file.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY store store
COPY drafter_service drafter_service
COPY engine_client engine_client
COPY proto proto
RUN pip install --no-cache-dir ".[service]" && python -c "import store._kernels, store._lru, drafter_service.core._tree"

ENV DRAFTER_ADDRESS=0.0.0.0:50051 DRAFTER_HTTP_ADDRESS=0.0.0.0:8050
EXPOSE 50051 8050
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD python -c "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
s = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')); \
sys.exit(0 if s.Check(h.HealthCheckRequest(), timeout=2).status == h.HealthCheckResponse.SERVING else 1)"
ENTRYPOINT ["drafter", "serve"]
