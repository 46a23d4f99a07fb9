"""A drafter.v1 server that does no work: every Draft gets the same 32-node reply.

``drafter bench serve`` measures it beside the real service, so the transport's own cost on the machine is known.
Run as ``python -m drafter_service.bench.echo_server ADDRESS``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc

REPLY = pb.DraftResponse(token_ids=[1] * 32, parents=list(range(-1, 31)), probs=[0.5] * 32, score=16.0)


class EchoServicer(pb_grpc.DrafterServicer):
    """Answers StartSession, Draft, DraftStream and EndSession without looking at the request."""

    def StartSession(self, request: pb.StartSessionRequest, context: grpc.ServicerContext) -> pb.StartSessionResponse:
        return pb.StartSessionResponse(session_id=request.session_id)

    def Draft(self, request: pb.DraftRequest, context: grpc.ServicerContext) -> pb.DraftResponse:
        return REPLY

    def DraftStream(self, requests: Iterator[pb.DraftRequest], context: grpc.ServicerContext
                    ) -> Iterator[pb.DraftResponse]:
        for _ in requests:
            yield REPLY

    def EndSession(self, request: pb.EndSessionRequest, context: grpc.ServicerContext) -> pb.EndSessionResponse:
        return pb.EndSessionResponse()


def main() -> int:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_DrafterServicer_to_server(EchoServicer(), server)
    server.add_insecure_port(sys.argv[1])
    server.start()
    print("ready", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    while not done.is_set():  # polled: the handler runs only when this thread runs bytecode, and takes done's lock
        time.sleep(0.1)
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
