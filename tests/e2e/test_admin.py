"""Operator commands against a real server: drafter ingest (with malformed lines) and drafter stats."""

import json

import pytest

from drafter_service.cli.main import main
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig


@pytest.fixture
def address():
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=100)
    server, port = create_server(cfg, "127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_ingest_skips_malformed_lines_and_stats_sees_the_rest(address, tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    lines = [json.dumps({"prompt": [1, 2], "output": [3, 4, 5], "request_id": "a"}),
             "{not json",
             json.dumps({"prompt": [1, "x"], "output": [3]}),
             "",
             json.dumps({"prompt": [7], "output": [8, 9]})]
    path.write_text("\n".join(lines) + "\n")
    assert main(["ingest", str(path), "--address", address, "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "ingested 2 requests (8 tokens); 2 malformed lines skipped" in out
    assert main(["stats", "--address", address]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["stored_requests"] == 2 and stats["namespace"] == "default"
