"""Where warming sends its batches: a running service over gRPC, or a DrafterService in the same process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np

from drafter_service.api.backoff import ExponentialBackoff
from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from drafter_service.service.service import DrafterService
    from engine_client.security import ClientSecurity

logger = logging.getLogger(__name__)

Reply = Callable[[], tuple[int, int, int]]
"""Waits for a batch's acknowledgement: (requests stored, tokens stored, duplicates skipped)."""

MAX_REQUEST_TOKENS = 1 << 20
"""The service's default limit on the tokens of one prompt or one output."""

_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
RETRY_BACKOFF = ExponentialBackoff(base_s=0.5, cap_s=30.0)
"""Waits between retries of a failed Ingest call (doubling from 0.5 s up to 30 s)."""


class WarmError(RuntimeError):
    """Warming cannot go on: the service refused or could not take a batch, or the setup is wrong."""


class IngestSink(Protocol):
    """Takes batches of completed requests; ``submit`` may return before the batch is stored."""

    namespace: str
    vocab_size: int
    max_request_tokens: int
    target: str

    def submit(self, requests: Sequence[pb.Sequence]) -> Reply:
        """Send a batch; the returned callable waits for its acknowledgement (raising WarmError on failure)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class GrpcSink:
    """Sends batches to a running service with Ingest; with ``skip_duplicates`` a failed call is retried.

    Retrying is safe then: a batch the service stored before the failure is skipped as duplicates.
    """

    def __init__(self, address: str, namespace: str = "", skip_duplicates: bool = True, timeout: float = 300.0,
                 retries: int = 5, max_message_bytes: int = 64 << 20,
                 security: ClientSecurity | None = None) -> None:
        """Connect and read the namespace's vocabulary size with GetStats (``security``: TLS and token).

        Raises:
            WarmError: no service answers at ``address``, or it has no such namespace.
        """
        self.address, self.skip_duplicates = address, skip_duplicates
        self.timeout, self.retries = timeout, retries if skip_duplicates else 0
        self.max_request_tokens = MAX_REQUEST_TOKENS
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        from engine_client.security import PLAINTEXT

        self.channel = (security or PLAINTEXT).channel(address, options=options)
        self.stub = pb_grpc.DrafterStub(self.channel)
        try:
            stats = self.stub.GetStats(pb.GetStatsRequest(namespace=namespace), timeout=30)
        except grpc.RpcError as exc:
            self.channel.close()
            raise WarmError(f"no usable drafter service at {address}: {exc.code().name}: {exc.details()}") from None
        self.namespace, self.vocab_size = stats.namespace, int(stats.vocab_size)
        self.target = f"{address}/{self.namespace}"

    def submit(self, requests: Sequence[pb.Sequence]) -> Reply:
        msg = pb.IngestRequest(namespace=self.namespace, requests=requests, skip_duplicates=self.skip_duplicates)
        future = self.stub.Ingest.future(msg, timeout=self.timeout)

        def wait() -> tuple[int, int, int]:
            return self._reply(msg, future)
        return wait

    def _reply(self, msg: pb.IngestRequest, future: grpc.Future) -> tuple[int, int, int]:
        for attempt in range(self.retries + 1):
            try:
                reply = future.result()
                return int(reply.ingested), int(reply.tokens), int(reply.skipped)
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in _RETRIED or attempt == self.retries:
                    raise WarmError(f"the service did not take a batch of {len(msg.requests)} requests: "
                                    f"{code.name}: {exc.details()}") from None
                delay = RETRY_BACKOFF.delay(attempt)
                logger.warning("Ingest failed (%s: %s); retrying in %.1f s", code.name, exc.details(), delay)
                time.sleep(delay)
                future = self.stub.Ingest.future(msg, timeout=self.timeout, wait_for_ready=True)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.channel.close()


class ServiceSink:
    """Calls ``DrafterService.ingest`` in the same process (the service's own folder-watch job)."""

    def __init__(self, service: DrafterService, namespace: str = "", skip_duplicates: bool = True) -> None:
        ns = service.namespace(namespace)
        self.service, self.namespace, self.skip_duplicates = service, ns.name, skip_duplicates
        self.vocab_size = int(ns.drafter.config.vocab_size)
        self.max_request_tokens = int(service.config.max_request_tokens)
        self.target = f"local/{ns.name}"

    def submit(self, requests: Sequence[pb.Sequence]) -> Reply:
        reqs = [(np.array(r.prompt, dtype=np.int32), np.array(r.output, dtype=np.int32), r.request_id)
                for r in requests]
        try:
            result = self.service.ingest(self.namespace, reqs, self.skip_duplicates)
        except Exception as exc:  # Unavailable (Redis down) or a refusal: nothing of the batch was stored
            raise WarmError(f"the service did not take a batch of {len(reqs)} requests: {exc}") from exc
        return lambda: result

    def close(self) -> None:
        pass
