"""The gRPC servicer: validate, call the service, convert. No logic of its own."""

from __future__ import annotations

from typing import Iterator

import grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.service import DrafterService
from drafter_service.tree import DraftTree

_SOURCES = {"session": pb.SOURCE_SESSION, "store": pb.SOURCE_STORE, "dynamic": pb.SOURCE_DYNAMIC,
            "frozen": pb.SOURCE_FROZEN, "model": pb.SOURCE_MODEL, "repeat": pb.SOURCE_REPEAT}


def tree_message(tree: DraftTree, confirmed: int) -> pb.DraftResponse:
    """A DraftResponse for a tree."""
    return pb.DraftResponse(token_ids=tree.token_ids, parents=tree.parents, probs=tree.probs, score=tree.score,
                            sources=[_SOURCES.get(s, pb.SOURCE_UNSPECIFIED) for s in tree.sources],
                            confirmed=confirmed)


class DrafterServicer(pb_grpc.DrafterServicer):
    """Implements drafter.v1.Drafter on a ``DrafterService``; errors surface through the interceptor."""

    def __init__(self, service: DrafterService) -> None:
        self.service = service

    def StartSession(self, request: pb.StartSessionRequest, context: grpc.ServicerContext) -> pb.StartSessionResponse:
        ns = self.service.start_session(request.namespace, request.session_id, list(request.prompt),
                                        request.max_nodes)
        return pb.StartSessionResponse(session_id=request.session_id, namespace=ns.name)

    def Draft(self, request: pb.DraftRequest, context: grpc.ServicerContext) -> pb.DraftResponse:
        tree, confirmed = self.service.draft(request.session_id, list(request.accepted), request.max_nodes,
                                             request.report_only, request.step_seconds)
        return tree_message(tree, confirmed)

    def DraftStream(self, requests: Iterator[pb.DraftRequest], context: grpc.ServicerContext
                    ) -> Iterator[pb.DraftResponse]:
        draft = self.service.draft
        for request in requests:
            tree, confirmed = draft(request.session_id, list(request.accepted), request.max_nodes,
                                    request.report_only, request.step_seconds)
            yield tree_message(tree, confirmed)

    def EndSession(self, request: pb.EndSessionRequest, context: grpc.ServicerContext) -> pb.EndSessionResponse:
        return pb.EndSessionResponse(stored_tokens=self.service.end_session(request.session_id,
                                                                            list(request.accepted)))

    def Ingest(self, request: pb.IngestRequest, context: grpc.ServicerContext) -> pb.IngestResponse:
        reqs = [(list(r.prompt), list(r.output), r.request_id) for r in request.requests]
        n, tokens = self.service.ingest(request.namespace, reqs)
        return pb.IngestResponse(ingested=n, tokens=tokens)

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        return pb.GetStatsResponse(**self.service.stats(request.namespace))
