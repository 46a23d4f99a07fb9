"""The fuzzed service and what fuzzing it draws: a Runtime on a real Redis, the checks every case ends with,
strategies of plausible and hostile field values, and the rules a valid request follows (tests import it)."""

import math
import os

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.names import NAME_RE
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import NamespaceSpec, ServiceConfig

EXAMPLES = int(os.environ.get("DRAFTER_FUZZ_EXAMPLES", "25"))
DEADLINE_S = 20.0  # every call has one: a hang fails the test
VOCAB = {"default": 1000, "other": 50}
LIMITS = {"tokens": 256, "ingest": 8, "nodes": 64, "sessions": 12, "message": 64 * 1024}
CAPACITY = 1 << 22
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
SERVICE = "/drafter.v1.Drafter/"
METHODS = {"StartSession": "unary", "Draft": "unary", "DraftStream": "stream_stream", "EndSession": "unary",
           "Ingest": "unary", "GetStats": "unary", "PutFrozenTable": "stream_unary", "ListFrozenTables": "unary",
           "RemoveFrozenTable": "unary", "DraftBatch": "unary", "DraftBatchStream": "stream_stream"}

# -- strategies: mostly plausible values, with the hostile ones mixed in --------------------------------------


def mostly(plausible: st.SearchStrategy, *hostile: st.SearchStrategy, weight: int = 4) -> st.SearchStrategy:
    """``plausible`` about ``weight`` times as often as each hostile strategy."""
    choices = [plausible] * weight + list(hostile)
    return st.sampled_from(range(len(choices))).flatmap(lambda i: choices[i])


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)  # any valid UTF-8 string
NAMESPACES = mostly(st.sampled_from(["", "default", "other"]),
                    st.sampled_from(["missing", "bad name", "ünïcode", "x" * 65, "a\x00b"]), TEXT)
SESSION_IDS = mostly(st.sampled_from([f"s{i}" for i in range(6)]),
                     st.sampled_from(["", "é" * 257, "a" * 256, "s1\x00"]), TEXT)
TOKEN = (st.integers(0, 60) | st.sampled_from([49, 50, 999, 1000, -1, 2**31 - 1, -2**31])
         | st.integers(-2**31, 2**31 - 1))
PLAUSIBLE = st.lists(st.integers(0, 49), max_size=24)  # valid in both namespaces
TOKENS = mostly(PLAUSIBLE, st.lists(TOKEN, max_size=24),
                st.builds(lambda n, t: [t] * n, st.integers(LIMITS["tokens"] - 2, LIMITS["tokens"] + 40),
                          st.integers(0, 1000)), weight=8)
BUDGETS = mostly(st.integers(0, LIMITS["nodes"]), st.integers(-3, 80),
                 st.sampled_from([LIMITS["nodes"] + 1, 2**31 - 1, -2**31]))
SECONDS = mostly(st.just(0.0) | st.floats(0, 3600), st.floats(width=32),
                 st.sampled_from([0.01, 3600.0, 3601.0, -0.0, -1e-30, math.nan, math.inf, -math.inf]))
TABLE_NAMES = mostly(st.sampled_from(["t1", "t2"]), st.sampled_from(["", "bad name", "x" * 65]), TEXT)
SEQUENCES = mostly(st.lists(st.tuples(PLAUSIBLE, PLAUSIBLE, st.sampled_from(["", "r1", "r2"])), min_size=1,
                            max_size=4),
                   st.lists(st.tuples(TOKENS, TOKENS, st.sampled_from(["", "r1", "r2"]) | TEXT),
                            max_size=LIMITS["ingest"] + 2), weight=2)


def chunk(draw, first: bool) -> pb.FrozenTableChunk:
    """A frozen-table chunk: arrays of consistent shapes most of the time, arbitrary otherwise."""
    ll, fl = (draw(st.sampled_from([1, 1, 1, 0, 2, -1])), draw(st.sampled_from([3, 3, 3, 0, 1, 4]))) if first \
        else (0, 0)
    size = draw(st.integers(0, 4))
    fanout = draw(st.lists(st.integers(0, 3) | st.integers(-2**31, 2**31 - 1), min_size=size, max_size=size))
    plausible = draw(st.booleans()) and all(0 <= f <= 3 for f in fanout)
    total = sum(fanout) if plausible else draw(st.integers(0, 6))
    leaders = draw(st.lists(TOKEN, min_size=size, max_size=size) if plausible else TOKENS)
    followers = draw(st.lists(TOKEN, min_size=3 * total, max_size=3 * total) if plausible else TOKENS)
    counts = draw(st.lists(st.integers(-5, 2**63 - 1), min_size=total, max_size=total))
    fields = {"leaders": leaders, "fanout": fanout, "followers": followers, "counts": counts}
    if first or draw(st.integers(0, 9)) == 0:  # naming fields belong to the first chunk only
        fields.update(namespace=draw(NAMESPACES), name=draw(TABLE_NAMES), source=draw(TEXT | st.just("s" * 1100)),
                      leader_len=ll, follower_len=fl)
    return pb.FrozenTableChunk(**fields)


@st.composite
def hostile_tables(draw) -> list[pb.FrozenTableChunk]:
    n = draw(st.integers(0, 3))
    return [chunk(draw, i == 0) for i in range(n)]


@st.composite
def valid_tables(draw) -> list[pb.FrozenTableChunk]:
    """A well-formed table (1-token leaders, 3-token followers, ids valid in both namespaces) in 1 or 2 chunks."""
    leaders = draw(st.lists(st.integers(0, 49), min_size=1, max_size=5, unique=True))
    fanout = [draw(st.integers(1, 3)) for _ in leaders]
    followers = draw(st.lists(st.integers(0, 49), min_size=3 * sum(fanout), max_size=3 * sum(fanout)))
    counts = draw(st.lists(st.integers(0, 1000), min_size=sum(fanout), max_size=sum(fanout)))
    cut = draw(st.integers(0, len(leaders)))  # leaders of the first chunk
    f_cut = sum(fanout[:cut])
    first = pb.FrozenTableChunk(namespace=draw(st.sampled_from(["", "default", "other"])),
                                name=draw(st.sampled_from(["t1", "t2"])), leader_len=1, follower_len=3,
                                source=draw(TEXT), leaders=leaders[:cut], fanout=fanout[:cut],
                                followers=followers[:3 * f_cut], counts=counts[:f_cut])
    rest = pb.FrozenTableChunk(leaders=leaders[cut:], fanout=fanout[cut:], followers=followers[3 * f_cut:],
                               counts=counts[f_cut:])
    return [first, rest] if cut < len(leaders) else [first]


TABLES = mostly(valid_tables(), hostile_tables(), weight=1)


REQUEST_BYTES = st.binary(max_size=200) | st.builds(lambda a, b: a + b, st.sampled_from([
    b"", b"\n\x02s0", b"\x12\x02s0", b"\x1a\x03\x01\x02\x03", b"\x08\xff\xff\xff\xff\x0f",
    b"\x12\x80\x80\x80\x80\x08"]),
    st.binary(max_size=40))
"""Random bytes, or the start of a plausible message (a session id, packed ids, a huge length) and more bytes."""


# -- the service under test -----------------------------------------------------------------------------------


class Fuzzed:
    """A Runtime on a real Redis, a channel to it, and the checks every case ends with."""

    def __init__(self, redis_url: str, data_dir: str) -> None:
        cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_url, http_address="", data_dir=data_dir,
                            default_vocab_size=VOCAB["default"], namespaces=(NamespaceSpec("other", VOCAB["other"]),),
                            drafter=DrafterConfig(capacity=CAPACITY, tail_tokens=256), rebuild_in_subprocess=False,
                            rebuild_interval_s=3600, snapshot_interval_s=3600, metrics_interval_s=3600,
                            max_request_tokens=LIMITS["tokens"], max_ingest_requests=LIMITS["ingest"],
                            max_nodes_limit=LIMITS["nodes"], max_sessions=LIMITS["sessions"],
                            max_message_bytes=LIMITS["message"], workers=8, max_streams=4)
        self.runtime = Runtime(cfg).start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.runtime.port}")
        self.stub = pb_grpc.DrafterStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.cases = 0
        self.calls: dict[str, dict[str, int]] = {}  # method -> status code name -> calls

    def close(self) -> None:
        self.channel.close()
        self.runtime.stop(grace=0)

    def state(self) -> dict[str, tuple]:
        """What no refused call may change: per namespace, what is stored and where, tables, live sessions."""
        out = {}
        for name, ns in self.runtime.service.namespaces.items():
            s = ns.stats()
            out[name] = (s.stored_tokens, s.stored_requests, ns.persistence.request_count(),
                         tuple(s.frozen_tables), s.active_sessions, s.dynamic_leaders)
        return out

    def check(self) -> None:
        """The service is alive and consistent."""
        assert self.health.Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"),
                                 timeout=DEADLINE_S).status == health_pb2.HealthCheckResponse.SERVING
        for name, ns in self.runtime.service.namespaces.items():
            ns.drafter.check_invariants()
            stats = ns.drafter.store.stats()
            assert stats["documents"] == ns.persistence.request_count(), f"{name}: memory and Redis disagree"
            for table in ns.drafter.frozen.values():
                table.check_invariants()
            assert sorted(ns.drafter.frozen) == sorted(ns.frozen_tables.info), f"{name}: frozen tables disagree"

    def check_contents(self) -> None:
        """Memory holds exactly the requests of the Redis log, in its order (every namespace)."""
        for name, ns in self.runtime.service.namespaces.items():
            ring = ns.drafter.store.ring
            held = ring.read(ring.oldest, ring.end)  # (n,) int32, requests each followed by a separator (< 0)
            logged = [np.append(r.tokens, -1) for r in ns.persistence.iter_request_records()]
            logged_all = np.concatenate(logged) if logged else np.zeros(0, dtype=np.int64)
            assert np.array_equal(np.where(held < 0, -1, held), logged_all), f"{name}: memory and Redis differ"

    def call(self, method: str, fn, *, may_change: bool = True, clean=lambda: True):
        """Run ``fn`` (an RPC); returns (code, reply). A refusal must be documented and change nothing.

        ``clean()`` says whether the refusal came before any part of the call was done (a stream that answered
        some requests before refusing one has done those).
        """
        before = self.state()
        try:
            reply = fn()
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            reply, code = None, exc.code()
            assert code in DOCUMENTED, f"{method}: {code} {exc.details()}"
            assert "--max-streams" not in (exc.details() or ""), f"{method}: a stream was not counted out"
        if (code != grpc.StatusCode.OK and clean()) or not may_change:
            assert self.state() == before, f"{method} ({code}) changed the store"
        by_code = self.calls.setdefault(method, {})
        by_code[code.name] = by_code.get(code.name, 0) + 1
        return code, reply


def check_tree(reply: pb.DraftResponse, vocab: int, budget: int) -> None:
    n = len(reply.token_ids)
    assert len(reply.parents) == len(reply.probs) == n and len(reply.sources) in (0, n)
    assert n <= budget
    for i, (tok, parent, prob) in enumerate(zip(reply.token_ids, reply.parents, reply.probs, strict=True)):
        assert 0 <= tok < vocab, "a drafted token outside the session's namespace"
        assert -1 <= parent < i
        assert 0.0 <= prob <= 1.0 and math.isfinite(prob)


# -- the rules a valid request follows -----------------------------------------------------------------------




def valid_tokens(tokens: list[int], vocab: int) -> bool:
    return all(0 <= t < vocab for t in tokens)


def in_limits(tokens: list[int]) -> bool:
    return len(tokens) <= LIMITS["tokens"]


def valid_seconds(value: float) -> bool:
    value = float(np.float32(value))  # what the service receives
    return 0.0 <= value <= 3600.0


def table_valid(chunks: list[pb.FrozenTableChunk]) -> bool:
    """Whether PutFrozenTable must take ``chunks``: the documented rules, checked one by one."""
    if not chunks:
        return False
    first = chunks[0]
    ns = (first.namespace or "default") if (first.namespace or "default") in VOCAB else None
    if (ns is None or (first.leader_len, first.follower_len) != (1, 3) or not NAME_RE.fullmatch(first.name)
            or len(first.source) > 1024):
        return False
    leaders: list[int] = []
    for c in chunks:
        if c is not first and (c.namespace or c.name or c.source or c.leader_len or c.follower_len):
            return False
        if (len(c.leaders) != len(c.fanout) or any(f < 1 for f in c.fanout) or len(c.counts) != sum(c.fanout)
                or len(c.followers) != 3 * sum(c.fanout) or any(n < 0 for n in c.counts)):
            return False
        if not valid_tokens(list(c.leaders) + list(c.followers), VOCAB[ns]):
            return False
        leaders += c.leaders
    return 0 < len(leaders) == len(set(leaders))


def send_raw(service: Fuzzed, method: str, payload: bytes) -> grpc.StatusCode:
    """Send ``payload`` as the request bytes of ``method`` (identity serializers); returns the status code."""
    kind, path = METHODS[method], SERVICE + method
    ident = {"request_serializer": None, "response_deserializer": None}
    if kind == "unary":
        fn = lambda: service.channel.unary_unary(path, **ident)(payload, timeout=DEADLINE_S)  # noqa: E731
    elif kind == "stream_unary":
        fn = lambda: service.channel.stream_unary(path, **ident)(iter([payload]), timeout=DEADLINE_S)  # noqa: E731
    else:
        fn = lambda: list(service.channel.stream_stream(path, **ident)(iter([payload, payload]),  # noqa: E731
                                                                         timeout=DEADLINE_S))
    code, _ = service.call(f"raw {method}", fn)
    return code
