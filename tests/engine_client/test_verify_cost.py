"""An engine's cost curve on a Draft request, through the client to a real gRPC server: the service returns only the
prefix of its tree worth verifying, and bad curves are refused before anything changes."""

import grpc
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.verify_budget import StepCostCurve, best_prefix
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient, DrafterRequestError

CONFIG = ServiceConfig(drafter=DrafterConfig(capacity=1 << 14), default_vocab_size=100)
DOC = [(7 * i) % 50 + 1 for i in range(120)]  # a sequence stored a few times, so drafts are long and confident


@pytest.fixture
def address():
    server, port = create_server(CONFIG, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    with DrafterClient(address) as client:
        client.ingest([(DOC[:10], DOC[10:], f"doc{i}") for i in range(3)])
    yield address
    server.stop(0)


def steep(per_node):
    return [(float(n), 0.1 * (1 + per_node * n)) for n in (0, 1, 2, 4, 8, 16, 32)]


def test_the_tree_is_cut_to_its_best_prefix_for_the_engines_cost(address):
    with DrafterClient(address, reuse=False, max_nodes=32) as client:
        full = client.draft(client.start(DOC[:30]), [])
        assert len(full) >= 8
        flat = client.draft(client.start(DOC[:30]), [], verify_cost=steep(0.0))
        assert flat.token_ids == full.token_ids  # free nodes: nothing is cut
        for per_node in (0.05, 0.3, 5.0):
            cost = steep(per_node)
            cut = client.draft(client.start(DOC[:30]), [], verify_cost=cost)
            want = max(1, best_prefix(full.probs, StepCostCurve.from_points(*zip(*cost, strict=True))))
            assert cut.token_ids == full.token_ids[:want] and cut.parents == full.parents[:want]
        assert len(cut) == 1  # nothing pays at 5 plain steps per node: the best node stays, for probing
        cost = steep(0.05)
        sure = client.draft(client.start(DOC[:30]), [], verify_cost=cost, estimate_exponent=0.25)
        doubt = client.draft(client.start(DOC[:30]), [], verify_cost=cost, estimate_exponent=4.0)
        curve = StepCostCurve.from_points(*zip(*cost, strict=True))
        assert len(sure) == max(1, best_prefix([p ** 0.25 for p in full.probs], curve))
        assert len(doubt) == max(1, best_prefix([p ** 4.0 for p in full.probs], curve))
        assert len(sure) > len(doubt)  # an engine that sees more accepted than estimated is sent more


def test_bad_cost_curves_are_refused_and_change_nothing(address):
    with DrafterClient(address, reuse=False) as client:
        sid = client.start(DOC[:30])
        client.draft(sid, [])
        for bad in ([(0.0, 0.0)], [(-1.0, 0.1)], [(0.0, float("nan"))], [(float(n), 0.1) for n in range(65)]):
            with pytest.raises(DrafterRequestError, match="cost point"):
                client.draft(sid, DOC[30:32], verify_cost=bad)
        for exponent in (-1.0, float("nan"), 101.0):
            with pytest.raises(DrafterRequestError, match="estimate_exponent"):
                client.draft(sid, DOC[30:32], verify_cost=steep(0.1), estimate_exponent=exponent)
        assert len(client.draft(sid, DOC[30:32])) > 0  # the refused calls recorded nothing: the tokens go now
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        stub.StartSession(pb.StartSessionRequest(session_id="raw", prompt=DOC[:30]))
        for nodes, seconds, exponent in (([0.0, 1.0], [0.1], 0.0), ([0.0], [-0.1], 0.0), ([float("inf")], [0.1], 0.0),
                                         ([0.0], [0.1], -2.0)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Draft(pb.DraftRequest(session_id="raw", cost_nodes=nodes, cost_seconds=seconds,
                                           estimate_exponent=exponent))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
