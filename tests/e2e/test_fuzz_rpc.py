"""Hostile input over a real channel to a real service on a real Redis: every RPC with arbitrary fields, in any
order, raw bytes as request messages, and concurrent misuse. After every call the service answers health checks,
every store passes ``check_invariants()``, memory and the Redis log agree, only documented status codes come back,
and a refused call changed nothing.

``DRAFTER_FUZZ_EXAMPLES`` sets the examples per test (default 25: a quick run); the cases run are printed.
"""

import collections
import threading

import grpc
import pytest
from fuzz_harness import (
    BUDGETS,
    CAPACITY,
    DEADLINE_S,
    EXAMPLES,
    LIMITS,
    METHODS,
    NAMESPACES,
    PLAUSIBLE,
    REQUEST_BYTES,
    SECONDS,
    SEQUENCES,
    SESSION_IDS,
    TABLE_NAMES,
    TABLES,
    TOKENS,
    VOCAB,
    Fuzzed,
    check_tree,
    in_limits,
    mostly,
    send_raw,
    table_valid,
    valid_seconds,
    valid_tokens,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from engine_client.draft_reuse import trees_of_batch


@pytest.fixture
def fuzzed(redis_server, request, capsys, tmp_path):
    service = Fuzzed(redis_server.url, str(tmp_path / "data"))
    yield service
    service.check()
    service.check_contents()
    service.close()
    with capsys.disabled():  # the case counts are part of the result
        calls = sum(n for codes in service.calls.values() for n in codes.values())
        print(f"\n{request.node.name}: {service.cases} cases, {calls} calls")
        for method, codes in sorted(service.calls.items()):
            print(f"  {method}: {dict(sorted(codes.items()))}")


# -- a stateful fuzzer over the whole API ---------------------------------------------------------------------


class ApiMachine(RuleBasedStateMachine):
    """Calls in any order; a model of live sessions and stored requests says which must succeed."""

    service: Fuzzed  # set by the test

    @initialize()
    def reset(self) -> None:
        """Every case starts without sessions, so what it draws depends on nothing but itself."""
        self.service.cases += 1
        self.live: dict[str, tuple[str, int]] = {}  # session id -> (namespace, output tokens so far)
        self.trees: dict[str, tuple[tuple, tuple]] = {}  # session id -> (token ids, parents) of its last draft
        self._end_all()

    def teardown(self) -> None:
        self._end_all()

    def _end_all(self) -> None:
        for sid in self._live_now():  # those a failed case left too
            code, _ = self.service.call("EndSession", lambda sid=sid: self.service.stub.EndSession(
                pb.EndSessionRequest(session_id=sid), timeout=DEADLINE_S))
            assert code == grpc.StatusCode.OK, (sid, code)

    def known(self, namespace: str) -> str | None:
        name = namespace or "default"
        return name if name in VOCAB else None

    @rule(namespace=NAMESPACES, sid=SESSION_IDS, prompt=TOKENS, max_nodes=BUDGETS)
    def start_session(self, namespace, sid, prompt, max_nodes):
        code, reply = self.service.call("StartSession", lambda: self.service.stub.StartSession(
            pb.StartSessionRequest(namespace=namespace, session_id=sid, prompt=prompt, max_nodes=max_nodes),
            timeout=DEADLINE_S))
        ns = self.known(namespace)
        valid = (ns is not None and 1 <= len(sid) <= 256 and "\x00" not in sid and in_limits(prompt)
                 and 0 <= max_nodes <= LIMITS["nodes"] and valid_tokens(prompt, VOCAB[ns]))
        if valid and sid in self.live:
            assert code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED)
        elif valid and len(self.live) < LIMITS["sessions"]:
            assert code == grpc.StatusCode.OK, code
            assert reply.namespace == ns
            self.live[sid] = (ns, 0)
        elif valid:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            assert code != grpc.StatusCode.OK

    def _draft_valid(self, sid, accepted, max_nodes, step, plain) -> bool:
        if sid not in self.live or not in_limits(accepted) or not 0 <= max_nodes <= LIMITS["nodes"]:
            return False
        ns, out = self.live[sid]
        return (valid_seconds(step) and valid_seconds(plain) and valid_tokens(accepted, VOCAB[ns])
                and out + len(accepted) <= LIMITS["tokens"])

    def _sid(self, data: st.DataObject) -> str:
        """Mostly a live session's id, else any."""
        return data.draw(mostly(st.sampled_from(sorted(self.live)), SESSION_IDS, weight=3) if self.live
                         else SESSION_IDS, label="session_id")

    @rule(data=st.data(), accepted=TOKENS, max_nodes=BUDGETS, report_only=st.booleans(), step=SECONDS,
          plain=SECONDS)
    def draft(self, data, accepted, max_nodes, report_only, step, plain):
        self._draft(self._sid(data), accepted, max_nodes, report_only, step, plain)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), follow=st.integers(0, 8), extra=PLAUSIBLE, max_nodes=st.integers(0, LIMITS["nodes"]),
          report_only=st.booleans(), step=st.just(0.0) | st.floats(0, 3600))
    def draft_live(self, data, follow, extra, max_nodes, report_only, step):
        """A well-formed step of a live session: accepted tokens follow the last draft's first branch, as an
        engine's would, then tokens of the target's own."""
        sid = data.draw(st.sampled_from(sorted(self.live)), label="session_id")
        ids, parents = self.trees.get(sid, ((), ()))
        path, node = [], -1
        for i, (tok, parent) in enumerate(zip(ids, parents, strict=True)):  # parents come before their children
            if len(path) == follow:
                break
            if parent == node:
                path.append(tok)
                node = i
        self._draft(sid, path + extra[:3], max_nodes, report_only, step, step / 2)

    def _draft(self, sid, accepted, max_nodes, report_only, step, plain):
        request = pb.DraftRequest(session_id=sid, accepted=accepted, max_nodes=max_nodes, report_only=report_only,
                                  step_seconds=step, plain_step_seconds=plain)
        code, reply = self.service.call("Draft", lambda: self.service.stub.Draft(request, timeout=DEADLINE_S))
        valid = self._draft_valid(sid, accepted, max_nodes, step, plain)
        assert (code == grpc.StatusCode.OK) == valid, (code, valid)
        if valid:
            ns, out = self.live[sid]
            self.live[sid] = (ns, out + len(accepted))
            check_tree(reply, VOCAB[ns], max_nodes or LIMITS["nodes"])
            assert not report_only or len(reply.token_ids) == 0
            assert 0 <= reply.confirmed <= len(accepted)
            self.trees[sid] = (tuple(reply.token_ids), tuple(reply.parents))

    @rule(data=st.data(), steps=st.lists(st.tuples(TOKENS, BUDGETS, st.booleans()), max_size=6), default=BUDGETS)
    def draft_batch(self, data, steps, default):
        """One engine step of several sessions: each step succeeds or fails alone, in order."""
        sids = [self._sid(data) for _ in steps]
        request = pb.DraftBatchRequest(max_nodes=default, steps=[
            pb.BatchStep(session_id=sid, accepted=a, max_nodes=b, report_only=r)
            for sid, (a, b, r) in zip(sids, steps, strict=True)])
        code, reply = self.service.call("DraftBatch",
                                        lambda: self.service.stub.DraftBatch(request, timeout=DEADLINE_S))
        if not 0 <= default <= LIMITS["nodes"]:
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            return
        assert code == grpc.StatusCode.OK, code
        failed = {e.index for e in reply.step_errors}
        trees = trees_of_batch(reply)
        assert len(trees) == len(steps) and len(reply.tree_offsets) == len(steps) + 1
        for i, (sid, (accepted, budget, report_only)) in enumerate(zip(sids, steps, strict=True)):
            valid = self._draft_valid(sid, accepted, budget or default, 0.0, 0.0)
            assert (i not in failed) == valid, (i, valid)
            if valid:
                ns, out = self.live[sid]
                self.live[sid] = (ns, out + len(accepted))
                trees[i].check_invariants()
                assert len(trees[i]) <= (budget or default or LIMITS["nodes"])
                assert all(0 <= t < VOCAB[ns] for t in trees[i].token_ids)
                assert not report_only or len(trees[i]) == 0
                self.trees[sid] = (trees[i].token_ids, trees[i].parents)
            else:
                assert len(trees[i]) == 0

    @rule(data=st.data(), steps=st.lists(st.tuples(TOKENS, BUDGETS, st.booleans()), max_size=5))
    def draft_stream(self, data, steps):
        sid = self._sid(data)
        requests = [pb.DraftRequest(session_id=sid, accepted=a, max_nodes=b, report_only=r) for a, b, r in steps]
        replies: list[pb.DraftResponse] = []

        def run():
            for reply in self.service.stub.DraftStream(iter(requests), timeout=DEADLINE_S):
                replies.append(reply)
            return replies
        code, _ = self.service.call("DraftStream", run, clean=lambda: not replies)
        expect_ok = 0  # the stream answers in order and stops at the first refusal
        for accepted, budget, _ in steps:
            if not self._draft_valid(sid, accepted, budget, 0.0, 0.0):
                break
            ns, out = self.live[sid]
            self.live[sid] = (ns, out + len(accepted))
            expect_ok += 1
        assert len(replies) == expect_ok and (code == grpc.StatusCode.OK) == (expect_ok == len(steps))
        for reply, (_, budget, report_only) in zip(replies, steps, strict=False):
            check_tree(reply, VOCAB[self.live[sid][0]], budget or LIMITS["nodes"])
            assert not report_only or len(reply.token_ids) == 0

    @rule(data=st.data(), accepted=TOKENS)
    def end_session(self, data, accepted):
        sid = self._sid(data)
        before = self.service.state()
        code, reply = self.service.call("EndSession", lambda: self.service.stub.EndSession(
            pb.EndSessionRequest(session_id=sid, accepted=accepted), timeout=DEADLINE_S))
        valid = self._draft_valid(sid, accepted, 0, 0.0, 0.0)
        assert (code == grpc.StatusCode.OK) == valid, (code, valid)
        if valid:
            ns, _ = self.live.pop(sid)
            after = self.service.state()
            if before[ns][0] + reply.stored_tokens + 1 <= CAPACITY:
                assert after[ns][1] == before[ns][1] + 1 and after[ns][2] == before[ns][2] + 1
                assert after[ns][0] == before[ns][0] + reply.stored_tokens + 1

    @rule(namespace=NAMESPACES, reqs=SEQUENCES, skip=st.booleans())
    def ingest(self, namespace, reqs, skip):
        before = self.service.state()
        code, reply = self.service.call("Ingest", lambda: self.service.stub.Ingest(pb.IngestRequest(
            namespace=namespace, requests=[pb.Sequence(prompt=p, output=o, request_id=r) for p, o, r in reqs],
            skip_duplicates=skip), timeout=DEADLINE_S))
        ns = self.known(namespace)
        valid = (ns is not None and 1 <= len(reqs) <= LIMITS["ingest"]
                 and all(in_limits(p) and in_limits(o) and p + o and valid_tokens(p + o, VOCAB[ns])
                         for p, o, _ in reqs))
        assert (code == grpc.StatusCode.OK) == valid, (code, valid)
        if valid:
            assert reply.ingested + reply.skipped == len(reqs) and (skip or reply.skipped == 0)
            after = self.service.state()
            if before[ns][0] + reply.tokens + reply.ingested <= CAPACITY:
                assert after[ns][1] == before[ns][1] + reply.ingested
                assert after[ns][0] == before[ns][0] + reply.tokens + reply.ingested

    @rule(namespace=NAMESPACES)
    def get_stats(self, namespace):
        code, reply = self.service.call("GetStats", lambda: self.service.stub.GetStats(
            pb.GetStatsRequest(namespace=namespace), timeout=DEADLINE_S), may_change=False)
        ns = self.known(namespace)
        assert (code == grpc.StatusCode.OK) == (ns is not None)
        if ns is not None:
            assert reply.namespace == ns and reply.vocab_size == VOCAB[ns]
            assert reply.active_sessions == sum(n == ns for n, _ in self.live.values())

    @rule(chunks=TABLES)
    def put_frozen(self, chunks):
        code, reply = self.service.call("PutFrozenTable", lambda: self.service.stub.PutFrozenTable(
            iter(chunks), timeout=DEADLINE_S))
        valid = table_valid(chunks)
        assert (code == grpc.StatusCode.OK) == valid, (code, valid)
        if valid:
            ns = chunks[0].namespace or "default"
            assert reply.name == chunks[0].name and reply.leaders == sum(len(c.fanout) for c in chunks)
            assert reply.name in self.service.runtime.service.namespaces[ns].drafter.frozen

    @rule(namespace=NAMESPACES)
    def list_frozen(self, namespace):
        code, reply = self.service.call("ListFrozenTables", lambda: self.service.stub.ListFrozenTables(
            pb.ListFrozenTablesRequest(namespace=namespace), timeout=DEADLINE_S), may_change=False)
        ns = self.known(namespace)
        assert (code == grpc.StatusCode.OK) == (ns is not None)
        if ns is not None:
            assert [t.name for t in reply.tables] == sorted(self.service.runtime.service.namespaces[ns].drafter.frozen)

    @rule(namespace=NAMESPACES, name=TABLE_NAMES)
    def remove_frozen(self, namespace, name):
        ns = self.known(namespace)
        had = ns is not None and name in self.service.runtime.service.namespaces[ns].drafter.frozen
        code, reply = self.service.call("RemoveFrozenTable", lambda: self.service.stub.RemoveFrozenTable(
            pb.RemoveFrozenTableRequest(namespace=namespace, name=name), timeout=DEADLINE_S))
        if code == grpc.StatusCode.OK:
            assert reply.removed == had
        else:
            assert not had

    @rule(method=st.sampled_from(sorted(METHODS)), data=st.data())
    def raw_bytes(self, method, data):
        payload = data.draw(REQUEST_BYTES)
        send_raw(self.service, method, payload)
        self.live.clear()  # a payload may parse as a real StartSession or EndSession: the model no longer knows
        self.live.update(self._live_now())

    def _live_now(self) -> dict[str, tuple[str, int]]:
        routes = {}
        for name, ns in self.service.runtime.service.namespaces.items():
            for key, sess in ns.drafter.sessions.items():
                routes[key.split("\x00")[0]] = (name, len(sess) - sess.prompt_len)
        return routes

    @rule(now=st.integers(0, 9))
    def oversized(self, now):
        if now:  # one time in ten: a transport refusal costs about 0.2 s
            return
        too_big = [999] * (LIMITS["message"] // 2 + 10)  # 2 bytes each: just over the message size limit
        code, _ = self.service.call("oversized Ingest", lambda: self.service.stub.Ingest(pb.IngestRequest(
            requests=[pb.Sequence(prompt=[1], output=too_big)]), timeout=DEADLINE_S))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED

    @rule()
    def rebuild(self):
        self.service.runtime.service.rebuild_due()

    @invariant()
    def consistent(self):
        self.service.check()


def test_every_rpc_in_any_order_keeps_the_service_consistent(fuzzed):
    ApiMachine.service = fuzzed
    run_state_machine_as_test(ApiMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=25, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_raw_bytes_as_any_request_are_refused_cleanly(fuzzed, method):
    @settings(max_examples=EXAMPLES * 4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(payload=REQUEST_BYTES)
    def case(payload):
        fuzzed.cases += 1
        send_raw(fuzzed, method, payload)
        fuzzed.check()
    case()


def test_concurrent_calls_on_the_same_sessions_store_each_request_once(fuzzed):
    """Engines misbehaving at once: EndSession and Draft of the same sessions from several threads."""
    stub = fuzzed.stub
    for round_ in range(EXAMPLES // 2 + 1):
        fuzzed.cases += 1
        sids = [f"c{round_}-{i}" for i in range(3)]
        for sid in sids:
            stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=[1, 2, 3]), timeout=DEADLINE_S)
        barrier = threading.Barrier(6)
        outcomes: list[tuple[str, str, str]] = []  # (method, session id, status code name), appended by the threads

        def hammer(k: int, barrier: threading.Barrier, sids: list[str], outcomes: list[tuple[str, str, str]]) -> None:
            barrier.wait()
            for sid in sids:
                method = "Draft" if k % 2 else "EndSession"
                try:
                    if k % 2:
                        stub.Draft(pb.DraftRequest(session_id=sid, accepted=[4, 5, k]), timeout=DEADLINE_S)
                    else:
                        stub.EndSession(pb.EndSessionRequest(session_id=sid, accepted=[7]), timeout=DEADLINE_S)
                    outcomes.append((method, sid, "OK"))
                except grpc.RpcError as exc:
                    outcomes.append((method, sid, exc.code().name))
        threads = [threading.Thread(target=hammer, args=(k, barrier, sids, outcomes)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert len(outcomes) == 6 * len(sids)  # no thread hung or failed
        for method, _, code in outcomes:
            by_code = fuzzed.calls.setdefault(f"concurrent {method}", {})
            by_code[code] = by_code.get(code, 0) + 1
        assert {code for _, _, code in outcomes} <= {"OK", "NOT_FOUND"}, outcomes
        ended = collections.Counter(sid for method, sid, code in outcomes if method == "EndSession" and code == "OK")
        assert all(ended[sid] == 1 for sid in sids), ended  # each ended once, the others found it gone
        fuzzed.check()
    fuzzed.check_contents()  # memory holds what Redis holds, Draft calls racing with the ends included
