"""NamespaceStats and the GetStats message it becomes."""

from __future__ import annotations

from dataclasses import fields

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.core.config import DrafterConfig
from drafter_service.namespaces.namespace import Namespace
from drafter_service.namespaces.stats import DraftCounters, estimated_speedup
from drafter_service.rpc.servicer import stats_message


def test_the_figures_and_the_message_have_the_same_fields():
    assert sorted(f.name for f in fields(Namespace("n", DrafterConfig(vocab_size=50), None).stats())) == \
        sorted(f.name for f in pb.GetStatsResponse.DESCRIPTOR.fields)


def test_a_namespace_reports_what_it_stored_and_drafted():
    ns = Namespace("n", DrafterConfig(vocab_size=50), None)
    stored, tokens, skipped = ns.ingest([([1, 2, 3], [4, 5, 1, 2, 3, 4], "r")])
    sess = ns.drafter.start("s", [1, 2, 3])
    tree, confirmed = ns.draft(sess, ns.drafter.tokens([4], "accepted"), 8)
    stats = ns.stats()
    assert (stats.namespace, stats.vocab_size, stats.stored_requests) == ("n", 50, 1)
    assert stats.stored_tokens == tokens + 1  # the request and the separator after it
    assert (stats.active_sessions, stats.drafts, stats.drafted_tokens) == (1, 1, len(tree))
    assert stats.persistence_healthy and len(tree) > 0  # "5 1 2 3 4" followed "4" before
    message = stats_message(stats)
    assert (message.stored_requests, message.drafts, message.namespace) == (1, 1, "n")


def test_counters_sum_sources_and_speedup():
    c = DraftCounters()
    c.count_sources(c.drafted_by_source, ("store", "store", ""), 4)
    assert c.drafted_by_source == {"store": 2, "unspecified": 2}
    c.record_step(3, 0.02, 0.01)
    c.record_step(1, 0.01, 0.01)
    assert c.mean_accepted_length == 2.0
    assert c.estimated_speedup == estimated_speedup(2, 4, 0.03, 0.02) == 4 / 0.03 * 0.01
