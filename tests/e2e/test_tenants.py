"""Tenants over a real gRPC channel and real Redis: namespace tokens on every RPC, private sessions and drafts,
per-client session limits, the HTTP token, and the flags that configure them."""

import asyncio
import json
import logging
import secrets
import urllib.error
import urllib.request

import grpc
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.frozen_wire import frozen_table_chunks
from drafter_service.cli.main import build_parser, main
from drafter_service.cli.serve import config_from_args
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import NamespaceSpec, ServiceConfig
from engine_client.admin import list_frozen_tables
from engine_client.async_client import AsyncDrafterClient
from engine_client.client import DrafterClient
from engine_client.client_common import DrafterRequestError
from engine_client.security import ClientSecurity
from store.embedded_redis import EmbeddedRedis
from store.frozen_table import FrozenNGramTable

VOCAB = 1000
A, B, ADMIN, HTTP = (secrets.token_hex(16) for _ in range(4))  # alpha's, beta's, the admin's and the HTTP token
UNKNOWN = secrets.token_hex(16)
PREFIX = [11, 12, 13, 14, 15, 16]
SECRET = [901, 902, 903, 904, 905, 906, 907, 908]  # tokens only alpha's requests hold
TABLE = FrozenNGramTable(1, 3, {(5,): [((6, 7, 8), 3)]})


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as redis:
        cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis.url, http_address="127.0.0.1:0",
                            data_dir=str(tmp_path_factory.mktemp("data")),
                            default_vocab_size=VOCAB, namespaces=tuple(NamespaceSpec(n, VOCAB) for n in
                                                                       ("alpha", "beta", "open")),
                            namespace_tokens=(("alpha", A), ("beta", B)), admin_token=ADMIN, http_token=HTTP,
                            drafter=DrafterConfig(capacity=1 << 14), rebuild_in_subprocess=False,
                            rebuild_interval_s=3600, snapshot_interval_s=3600, metrics_interval_s=3600)
        running = Runtime(cfg).start()
        yield running
        running.stop(grace=0)


@pytest.fixture(scope="module")
def stub(runtime):
    with grpc.insecure_channel(f"127.0.0.1:{runtime.port}") as channel:
        yield pb_grpc.DrafterStub(channel)


def md(token):
    return (("authorization", f"Bearer {token}"),) if token else ()


def code(call, *args, token=None, metadata=None):
    """Status code name of a call (OK when it succeeds) and its details."""
    try:
        call(*args, metadata=metadata if metadata is not None else md(token), timeout=10)
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()


def namespace_calls(stub, namespace):
    """Every RPC that names a namespace, as (name, callable taking metadata) pairs; each one leaves no trace."""
    seq = pb.Sequence(prompt=[1, 2], output=[3])

    def start(metadata, timeout):
        sid = secrets.token_hex(8)
        stub.StartSession(pb.StartSessionRequest(namespace=namespace, session_id=sid, prompt=[1, 2]),
                          metadata=metadata, timeout=timeout)
        stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=metadata, timeout=timeout)

    def put(metadata, timeout):
        stub.PutFrozenTable(frozen_table_chunks(TABLE, "t", namespace), metadata=metadata, timeout=timeout)
        stub.RemoveFrozenTable(pb.RemoveFrozenTableRequest(namespace=namespace, name="t"), metadata=metadata,
                               timeout=timeout)

    return [
        ("StartSession", start),
        ("Ingest", lambda metadata, timeout: stub.Ingest(pb.IngestRequest(namespace=namespace, requests=[seq],
                                                                          skip_duplicates=True),
                                                         metadata=metadata, timeout=timeout)),
        ("GetStats", lambda metadata, timeout: stub.GetStats(pb.GetStatsRequest(namespace=namespace),
                                                             metadata=metadata, timeout=timeout)),
        ("PutFrozenTable", put),
        ("ListFrozenTables", lambda metadata, timeout: stub.ListFrozenTables(
            pb.ListFrozenTablesRequest(namespace=namespace), metadata=metadata, timeout=timeout)),
        ("RemoveFrozenTable", lambda metadata, timeout: stub.RemoveFrozenTable(
            pb.RemoveFrozenTableRequest(namespace=namespace, name="none"), metadata=metadata, timeout=timeout)),
    ]


def status(call, metadata):
    try:
        call(metadata, 10)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def test_every_namespace_rpc_needs_a_token_that_grants_the_namespace(stub):
    for name, call in namespace_calls(stub, "alpha"):
        got = {who: status(call, metadata) for who, metadata in [
            ("none", ()), ("unknown", md(UNKNOWN)), ("basic", (("authorization", f"Basic {A}"),)),
            ("twice", md(A) + md(A)), ("beta", md(B)), ("alpha", md(A)), ("admin", md(ADMIN))]}
        assert got == {"none": "UNAUTHENTICATED", "unknown": "UNAUTHENTICATED", "basic": "UNAUTHENTICATED",
                       "twice": "UNAUTHENTICATED", "beta": "PERMISSION_DENIED", "alpha": "OK", "admin": "OK"}, name


def test_an_open_namespace_takes_anyone_with_valid_credentials_or_none(stub):
    for name, call in namespace_calls(stub, "open"):
        got = {who: status(call, metadata) for who, metadata in [
            ("none", ()), ("alpha", md(A)), ("admin", md(ADMIN)), ("unknown", md(UNKNOWN))]}
        assert got == {"none": "OK", "alpha": "OK", "admin": "OK", "unknown": "UNAUTHENTICATED"}, name


def test_unknown_namespaces_are_refused_exactly_like_protected_ones(stub):
    for token, expected in ((None, "UNAUTHENTICATED"), (B, "PERMISSION_DENIED")):
        for (name, protected), (_, unknown) in zip(namespace_calls(stub, "alpha"), namespace_calls(stub, "nosuch"),
                                                   strict=True):
            answers = []
            for call, namespace in ((protected, "alpha"), (unknown, "nosuch")):
                try:
                    call(md(token), 10)
                    answers.append(("OK", ""))
                except grpc.RpcError as exc:
                    answers.append((exc.code().name, exc.details().replace(namespace, "NS")))
            assert answers[0] == answers[1] and answers[0][0] == expected, (name, answers)
    assert code(stub.GetStats, pb.GetStatsRequest(namespace="nosuch"), token=ADMIN)[0] == "NOT_FOUND"
    assert code(stub.GetStats, pb.GetStatsRequest(namespace="bad name!"))[0] == "INVALID_ARGUMENT"


def test_another_tenants_session_is_exactly_as_unknown_as_one_that_never_existed(stub, runtime):
    start = pb.StartSessionRequest(namespace="alpha", session_id="s1", prompt=PREFIX)
    assert code(stub.StartSession, start, token=A)[0] == "OK"
    before = runtime.service.namespaces["alpha"].drafter.sessions
    n_before = len(before)
    for token in (B, ADMIN, None):
        for sid in ("s1", "never-existed"):
            answers = [code(stub.Draft, pb.DraftRequest(session_id=sid, accepted=[17]), token=token),
                       code(stub.EndSession, pb.EndSessionRequest(session_id=sid, accepted=[17]), token=token)]
            try:
                list(stub.DraftStream(iter([pb.DraftRequest(session_id=sid)]), metadata=md(token), timeout=10))
                answers.append(("OK", ""))
            except grpc.RpcError as exc:
                answers.append((exc.code().name, exc.details()))
            assert [(c, d.replace(sid, "ID")) for c, d in answers] == [("NOT_FOUND", "unknown session 'ID'")] * 3
    for bad in (md(UNKNOWN), (("authorization", "Bearer"),)):  # bad credentials are refused before any lookup
        assert code(stub.Draft, pb.DraftRequest(session_id="s1"), metadata=bad)[0] == "UNAUTHENTICATED"
        assert code(stub.EndSession, pb.EndSessionRequest(session_id="s1"), metadata=bad)[0] == "UNAUTHENTICATED"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.DraftStream(iter([pb.DraftRequest(session_id="s1")]), metadata=bad, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # beta may open its own "s1": no ALREADY_EXISTS tells it that alpha has one
    assert code(stub.StartSession, pb.StartSessionRequest(namespace="beta", session_id="s1", prompt=[1]),
                token=B)[0] == "OK"
    assert code(stub.StartSession, pb.StartSessionRequest(namespace="open", session_id="s1", prompt=[1]))[0] == "OK"
    assert code(stub.StartSession, start, token=A)[0] == "ALREADY_EXISTS"  # within its own scope it is taken
    assert len(before) == n_before  # nothing the others did touched alpha's sessions
    reply = stub.Draft(pb.DraftRequest(session_id="s1", accepted=[17, 18]), metadata=md(A), timeout=10)
    assert reply.confirmed == 0
    stored = stub.EndSession(pb.EndSessionRequest(session_id="s1", accepted=[19]), metadata=md(A), timeout=10)
    assert stored.stored_tokens == len(PREFIX) + 3  # only alpha's own tokens: nobody else extended it
    for token in (B, None):
        stub.EndSession(pb.EndSessionRequest(session_id="s1"), metadata=md(token), timeout=10)
    assert code(stub.Draft, pb.DraftRequest(session_id="s1"), token=A)[0] == "NOT_FOUND"


def test_session_ids_with_nul_are_refused(stub):
    got = code(stub.StartSession, pb.StartSessionRequest(namespace="open", session_id="a\x00b", prompt=[1]))
    assert got[0] == "INVALID_ARGUMENT" and "NUL" in got[1]


def test_drafts_and_stats_never_show_another_namespaces_tokens(stub, runtime):
    seqs = [pb.Sequence(prompt=PREFIX, output=SECRET, request_id=f"secret-{i}") for i in range(3)]
    assert stub.Ingest(pb.IngestRequest(namespace="alpha", requests=seqs), metadata=md(A), timeout=10).ingested == 3
    runtime.service.rebuild_due()

    def drafted(namespace, token, sid):
        stub.StartSession(pb.StartSessionRequest(namespace=namespace, session_id=sid, prompt=PREFIX),
                          metadata=md(token), timeout=10)
        reply = stub.Draft(pb.DraftRequest(session_id=sid, max_nodes=64), metadata=md(token), timeout=10)
        stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=md(token), timeout=10)
        return set(reply.token_ids)

    assert set(SECRET) <= drafted("alpha", A, "d-alpha")  # the test can see them where they belong
    for namespace, token in (("beta", B), ("open", None), ("default", None), ("beta", ADMIN)):
        assert not drafted(namespace, token, f"d-{namespace}") & set(SECRET), namespace
    alpha = stub.GetStats(pb.GetStatsRequest(namespace="alpha"), metadata=md(A), timeout=10)
    beta = stub.GetStats(pb.GetStatsRequest(namespace="beta"), metadata=md(B), timeout=10)
    assert alpha.stored_requests >= 3 and beta.stored_requests < alpha.stored_requests
    assert code(stub.GetStats, pb.GetStatsRequest(namespace="alpha"), token=B)[0] == "PERMISSION_DENIED"


def test_frozen_tables_are_private_to_their_namespace(stub, runtime):
    address = f"127.0.0.1:{runtime.port}"
    stub.PutFrozenTable(frozen_table_chunks(TABLE, "alpha-only", "alpha"), metadata=md(A), timeout=10)
    assert code(stub.PutFrozenTable, frozen_table_chunks(TABLE, "intruder", "alpha"), token=B)[0] == \
        "PERMISSION_DENIED"
    assert code(stub.RemoveFrozenTable, pb.RemoveFrozenTableRequest(namespace="alpha", name="alpha-only"),
                token=B)[0] == "PERMISSION_DENIED"
    names = [t["name"] for t in list_frozen_tables(address, "alpha", security=ClientSecurity(token=A))]
    assert "alpha-only" in names and "intruder" not in names
    assert "alpha-only" not in [t["name"] for t in list_frozen_tables(address, "beta",
                                                                      security=ClientSecurity(token=B))]
    with pytest.raises(grpc.RpcError) as err:
        list_frozen_tables(address, "alpha", security=ClientSecurity(token=B))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stub.RemoveFrozenTable(pb.RemoveFrozenTableRequest(namespace="alpha", name="alpha-only"), metadata=md(A),
                           timeout=10)


def test_clients_send_their_token_and_raise_on_refusal(runtime):
    address = f"127.0.0.1:{runtime.port}"
    with DrafterClient(address, namespace="alpha", security=ClientSecurity(token=A)) as client:
        sid = client.start(PREFIX)
        client.draft(sid, [])
        client.end(sid, [20, 21])
        assert client.stats()["namespace"] == "alpha"
        assert client.stats_local().outages == 0
    for security, expected in ((None, "UNAUTHENTICATED"), (ClientSecurity(token=B), "PERMISSION_DENIED")):
        with pytest.raises(DrafterRequestError) as err:
            DrafterClient(address, namespace="alpha", security=security)
        assert err.value.code == expected

    async def run_async() -> int:
        async with AsyncDrafterClient(address, namespace="beta", security=ClientSecurity(token=B)) as client:
            sid = await client.start(PREFIX)
            await client.draft(sid, [])  # on the DraftStream
            await client.draft(sid, [30, 31])
            await client.end(sid, [32])
            return client.stats_local().fetched_steps
    assert asyncio.run(run_async()) == 2


def test_the_cli_reads_its_token_from_a_file_or_the_environment(runtime, tmp_path, capsys, monkeypatch):
    address = f"127.0.0.1:{runtime.port}"
    (tmp_path / "token").write_text(A + "\n")
    assert main(["stats", "--address", address, "--namespace", "alpha", "--token", f"@{tmp_path / 'token'}"]) == 0
    assert json.loads(capsys.readouterr().out)["namespace"] == "alpha"
    with pytest.raises(SystemExit, match="PERMISSION_DENIED"):
        main(["stats", "--address", address, "--namespace", "alpha", "--token", B])
    with pytest.raises(SystemExit, match="UNAUTHENTICATED"):
        main(["stats", "--address", address, "--namespace", "alpha"])
    monkeypatch.setenv("DRAFTER_TOKEN", ADMIN)
    assert main(["frozen", "list", "--address", address, "--namespace", "alpha", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_sessions_per_client_are_limited_by_token_or_address(tmp_path):
    cfg = ServiceConfig(address="127.0.0.1:0", http_address="", default_vocab_size=VOCAB,
                        namespaces=(NamespaceSpec("alpha", VOCAB),), namespace_tokens=(("alpha", A),),
                        max_sessions_per_client=2, drafter=DrafterConfig(capacity=1 << 12))
    server, port = create_server(cfg, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.DrafterStub(channel)

            def start(sid, namespace="", token=None):
                return code(stub.StartSession, pb.StartSessionRequest(namespace=namespace, session_id=sid,
                                                                      prompt=[1]), token=token)[0]

            assert [start("a1"), start("a2"), start("a3")] == ["OK", "OK", "RESOURCE_EXHAUSTED"]
            # a token is its own client; the anonymous address is still full
            assert [start("t1", "alpha", A), start("t2", "", A), start("t3", "alpha", A)] == \
                ["OK", "OK", "RESOURCE_EXHAUSTED"]
            assert start("a3") == "RESOURCE_EXHAUSTED"
            stub.EndSession(pb.EndSessionRequest(session_id="a1"), timeout=10)
            assert start("a3") == "OK"
            assert code(stub.EndSession, pb.EndSessionRequest(session_id="t1"))[0] == "NOT_FOUND"  # not anyone's
            assert start("t3", "alpha", A) == "RESOURCE_EXHAUSTED"
    finally:
        server.stop(0)


def http(runtime, path, token=None, cookie=None):
    req = urllib.request.Request(f"http://127.0.0.1:{runtime.http_port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if cookie:
        req.add_header("Cookie", cookie)
    try:
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_http_pages_need_the_http_or_admin_token(runtime, caplog):
    for path in ("/metrics", "/", "/api/namespaces", "/api/series?namespace=alpha", "/static/dashboard.js"):
        for token in (None, A, UNKNOWN):
            status, headers, body = http(runtime, path, token)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer"), (path, token)
            assert b"alpha" not in body and b"beta" not in body
        for token in (HTTP, ADMIN):
            assert http(runtime, path, token)[0] == 200, (path, token)
    with caplog.at_level(logging.DEBUG, logger="drafter_service.web.http_server"):
        status, headers, _ = http(runtime, f"/?token={HTTP}")
    assert status == 200 and "HttpOnly" in headers["Set-Cookie"]
    assert "token=***" in caplog.text and HTTP not in caplog.text  # the request line is logged without it
    cookie = headers["Set-Cookie"].split(";")[0]
    status, _, body = http(runtime, "/api/namespaces", cookie=cookie)  # the page's own calls carry the cookie
    assert status == 200 and "alpha" in json.loads(body)["namespaces"]
    assert http(runtime, f"/api/series?namespace=alpha&token={ADMIN}")[0] == 200  # the parameter is not a filter
    assert http(runtime, "/metrics", cookie="drafter_token=wrong")[0] == 401
    status, _, body = http(runtime, "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}  # no namespace names without a token
    assert set(json.loads(http(runtime, "/healthz", HTTP)[2])["persistence_healthy"]) >= {"alpha", "beta"}


def test_tenant_flags_and_their_validation(tmp_path, monkeypatch):
    (tmp_path / "alpha.token").write_text(A + "\n")
    monkeypatch.setenv("DRAFTER_ADMIN_TOKEN", ADMIN)
    args = build_parser().parse_args([
        "serve", "--namespaces", "alpha=100,beta=100", "--namespace-tokens", f"alpha=@{tmp_path / 'alpha.token'},"
        f"beta={B}", "--http-token", HTTP, "--max-sessions-per-client", "7", "--max-request-tokens", "500",
        "--max-nodes-limit", "64", "--max-ingest-requests", "9", "--max-message-bytes", "100000",
        "--max-sessions", "50"])
    cfg = config_from_args(args)
    assert cfg.namespace_tokens == (("alpha", A), ("beta", B)) and cfg.admin_token == ADMIN and cfg.http_token == HTTP
    assert (cfg.max_sessions_per_client, cfg.max_request_tokens, cfg.max_nodes_limit, cfg.max_ingest_requests,
            cfg.max_message_bytes, cfg.max_sessions) == (7, 500, 64, 9, 100000, 50)
    assert A not in repr(cfg) and ADMIN not in repr(cfg) and HTTP not in repr(cfg)
    ns = (NamespaceSpec("alpha", 10),)
    bad = [dict(namespace_tokens=(("nosuch", A),)), dict(namespace_tokens=(("alpha", "short"),)),
           dict(namespace_tokens=(("alpha", A + " x"),)), dict(namespace_tokens=(("alpha", A), ("alpha", B))),
           dict(namespace_tokens=(("alpha", A),), admin_token=A),
           dict(namespace_tokens=(("alpha", A),), http_address="127.0.0.1:0"),
           dict(tls_cert="cert.pem"), dict(tls_client_ca="ca.pem"), dict(max_sessions_per_client=-1)]
    for fields in bad:
        with pytest.raises(ValueError) as err:
            ServiceConfig(namespaces=ns, **{"http_address": "", **fields})
        assert A not in str(err.value) and B not in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        config_from_args(build_parser().parse_args(["serve", "--namespaces", "alpha=10", "--namespace-tokens",
                                                    f"alpha=@{tmp_path / 'missing'}"]))
