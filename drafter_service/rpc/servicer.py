"""The gRPC servicer: validate, call the service, convert. No logic of its own.

Drafting calls are coroutines, run on the server's event loop: drafting works in memory and takes a millisecond or
less. Every call that may wait (storing requests in Redis, uploads, statistics) is a plain function, which the server
runs in its thread pool; so is a ``DraftBatch`` step that ends sessions (ending one stores its request).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import fields

import grpc
import grpc.aio
import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.errors import InvalidArgument
from drafter_service.api.frozen_wire import table_from_chunks
from drafter_service.api.tree import DraftTree
from drafter_service.namespaces.stats import NamespaceStats
from drafter_service.rpc.interceptor import status_of
from drafter_service.service.auth import Caller
from drafter_service.service.batch import BatchOutcome, BatchStep, PackedSteps
from drafter_service.service.service import DrafterService
from store.request_log import Duplicates

logger = logging.getLogger(__name__)

_SOURCES = {"session": pb.SOURCE_SESSION, "store": pb.SOURCE_STORE, "dynamic": pb.SOURCE_DYNAMIC,
            "frozen": pb.SOURCE_FROZEN, "model": pb.SOURCE_MODEL, "repeat": pb.SOURCE_REPEAT}


def tree_message(tree: DraftTree, confirmed: int) -> pb.DraftResponse:
    """A DraftResponse for a tree."""
    return pb.DraftResponse(token_ids=tree.token_ids, parents=tree.parents, probs=tree.probs, score=tree.score,
                            sources=[_SOURCES.get(s, pb.SOURCE_UNSPECIFIED) for s in tree.sources],
                            confirmed=confirmed)


def _item_errors(errors: list[tuple[int, Exception]], what: str) -> list[pb.ItemError]:
    out = []
    for index, exc in errors:
        code, message = status_of(exc)
        if code is grpc.StatusCode.INTERNAL:  # a bug, not a bad item: logged like any call that failed so
            logger.error("DraftBatch %s %d failed", what, index, exc_info=exc)
        out.append(pb.ItemError(index=index, code=code.value[0], message=message))
    return out


def batch_steps(request: pb.DraftBatchRequest) -> tuple[list[BatchStep], PackedSteps | None, tuple[int, int] | None]:
    """The steps of a DraftBatchRequest: ``steps``, then the packed ones (None when there are none; their tokens one
    int32 array), and the (least, greatest) id of the packed tokens (None when there are none).

    Raises:
        InvalidArgument: packed lists of different lengths, or counts that do not add up to the packed tokens.
    """
    steps: list[BatchStep] = [(s.session_id, s.accepted, s.max_nodes, s.report_only) for s in request.steps]
    sessions, data = request.packed_sessions, request.packed_tokens
    n = len(sessions)
    counts = list(request.packed_counts)
    budgets = list(request.packed_max_nodes) or [0] * n
    report = list(request.packed_report_only) or [False] * n
    if len(counts) != n or len(budgets) != n or len(report) != n:
        raise InvalidArgument(f"{n} packed sessions with {len(counts)} counts, {len(request.packed_max_nodes)} "
                              f"budgets and {len(request.packed_report_only)} report flags")
    if len(data) % 4 or min(counts, default=0) < 0 or sum(counts) != len(data) // 4:
        raise InvalidArgument(f"packed counts add up to {sum(counts)} tokens, packed_tokens holds {len(data) / 4}")
    if not n:
        return steps, None, None
    flat = np.frombuffer(data, "<i4").astype(np.int32, copy=False)
    packed = PackedSteps(sessions, flat, [0, *itertools.accumulate(counts)], budgets, report)
    return steps, packed, ((int(flat.min()), int(flat.max())) if flat.size else None)


def batch_message(outcome: BatchOutcome) -> pb.DraftBatchResponse:
    """A DraftBatchResponse: the steps' trees packed one after another (as the outcome holds them, little-endian
    bytes on the wire), then what failed."""
    token_ids, parents, probs, sources = outcome.nodes()
    return pb.DraftBatchResponse(
        tree_offsets=outcome.tree_offsets, token_ids=token_ids.astype("<i4", copy=False).tobytes(),
        parents=parents.astype("<i4", copy=False).tobytes(), probs=probs.astype("<f4").tobytes(),
        sources=sources.astype(np.uint8, copy=False).tobytes(), confirmed=outcome.confirmed,
        stored_tokens=outcome.stored,
        start_errors=_item_errors(outcome.start_errors, "start"),
        step_errors=_item_errors(outcome.step_errors, "step"), end_errors=_item_errors(outcome.end_errors, "end"))


def stats_message(stats: NamespaceStats) -> pb.GetStatsResponse:
    """A GetStatsResponse for a namespace's figures (the two share their field names)."""
    return pb.GetStatsResponse(**{f.name: getattr(stats, f.name) for f in fields(stats)})


def frozen_info_message(header: dict) -> pb.FrozenTableInfo:
    """A FrozenTableInfo for a frozen table's header."""
    return pb.FrozenTableInfo(name=header["name"], source=header.get("source", ""),
                              saved_at=header.get("saved_at", 0.0), leaders=header.get("leaders", 0),
                              followers=header.get("followers", 0), leader_len=header.get("leader_len", 0),
                              follower_len=header.get("follower_len", 0))


class DrafterServicer(pb_grpc.DrafterServicer):
    """Implements drafter.v1.Drafter on a ``DrafterService``; errors surface through the interceptor.

    ``pool`` runs the parts of drafting calls that may wait (a batch's ends).
    """

    def __init__(self, service: DrafterService, pool: futures.Executor) -> None:
        self.service = service
        self.pool = pool

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        """Who calls (Unauthenticated for a malformed or unknown token); the service checks what it may use."""
        return self.service.auth.caller(context.invocation_metadata(), context.peer())

    def StartSession(self, request: pb.StartSessionRequest, context: grpc.ServicerContext) -> pb.StartSessionResponse:
        ns = self.service.start_session(request.namespace, request.session_id, list(request.prompt),
                                        request.max_nodes, caller=self._caller(context),
                                        fixed_budget=request.fixed_budget)
        return pb.StartSessionResponse(session_id=request.session_id, namespace=ns.name)

    def _draft(self, request: pb.DraftRequest, caller: Caller) -> pb.DraftResponse:
        tree, confirmed = self.service.draft(request.session_id, request.accepted, request.max_nodes,
                                             request.report_only, request.step_seconds, request.plain_step_seconds,
                                             caller=caller, cost_nodes=request.cost_nodes,
                                             cost_seconds=request.cost_seconds,
                                             estimate_exponent=request.estimate_exponent)
        return tree_message(tree, confirmed)

    async def Draft(self, request: pb.DraftRequest, context: grpc.aio.ServicerContext) -> pb.DraftResponse:
        return self._draft(request, self._caller(context))

    async def DraftStream(self, requests: AsyncIterator[pb.DraftRequest], context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[pb.DraftResponse]:
        caller = self._caller(context)
        async for request in requests:
            yield self._draft(request, caller)

    async def DraftBatch(self, request: pb.DraftBatchRequest, context: grpc.aio.ServicerContext
                         ) -> pb.DraftBatchResponse:
        return await self._batch(request, self._caller(context))

    async def DraftBatchStream(self, requests: AsyncIterator[pb.DraftBatchRequest],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DraftBatchResponse]:
        caller = self._caller(context)
        async for request in requests:
            yield await self._batch(request, caller)

    async def _batch(self, request: pb.DraftBatchRequest, caller: Caller) -> pb.DraftBatchResponse:
        """A batch on the loop, or in the pool when it ends sessions (their requests are stored)."""
        if request.end:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._batch_now, request, caller)
        return self._batch_now(request, caller)

    def _batch_now(self, request: pb.DraftBatchRequest, caller: Caller) -> pb.DraftBatchResponse:
        steps, packed, bounds = batch_steps(request)
        outcome = self.service.draft_batch(
            [(s.namespace, s.session_id, s.prompt, s.max_nodes, s.fixed_budget) for s in request.start], steps,
            [(e.session_id, e.accepted) for e in request.end],
            request.max_nodes, request.step_seconds, request.plain_step_seconds, caller=caller,
            accepted_bounds=bounds, packed=packed)
        return batch_message(outcome)

    def EndSession(self, request: pb.EndSessionRequest, context: grpc.ServicerContext) -> pb.EndSessionResponse:
        return pb.EndSessionResponse(stored_tokens=self.service.end_session(request.session_id,
                                                                            request.accepted,
                                                                            caller=self._caller(context)))

    def Ingest(self, request: pb.IngestRequest, context: grpc.ServicerContext) -> pb.IngestResponse:
        reqs = [(np.array(r.prompt, dtype=np.int32), np.array(r.output, dtype=np.int32), r.request_id)
                for r in request.requests]
        rule = Duplicates.SKIP if request.skip_duplicates else \
            Duplicates.SKIP_SAME_ID if request.skip_duplicate_ids else Duplicates.KEEP
        n, tokens, skipped = self.service.ingest(request.namespace, reqs, rule, caller=self._caller(context))
        return pb.IngestResponse(ingested=n, tokens=tokens, skipped=skipped)

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        return stats_message(self.service.stats(request.namespace, caller=self._caller(context)))

    def PutFrozenTable(self, chunks: Iterator[pb.FrozenTableChunk], context: grpc.ServicerContext
                       ) -> pb.FrozenTableInfo:
        caller = self._caller(context)
        first = next(chunks, None)
        if first is not None:  # refused before the rest of the upload is read
            self.service.namespace(first.namespace, caller)
            chunks = itertools.chain([first], chunks)
        namespace, name, source, table = table_from_chunks(chunks)
        return frozen_info_message(self.service.put_frozen(namespace, name, table, source, caller=caller))

    def ListFrozenTables(self, request: pb.ListFrozenTablesRequest, context: grpc.ServicerContext
                         ) -> pb.ListFrozenTablesResponse:
        tables = self.service.list_frozen(request.namespace, caller=self._caller(context))
        return pb.ListFrozenTablesResponse(tables=[frozen_info_message(h) for h in tables])

    def RemoveFrozenTable(self, request: pb.RemoveFrozenTableRequest, context: grpc.ServicerContext
                          ) -> pb.RemoveFrozenTableResponse:
        return pb.RemoveFrozenTableResponse(removed=self.service.remove_frozen(request.namespace, request.name,
                                                                               caller=self._caller(context)))
