"""The HTTP port over real sockets: pages and vendored assets, the JSON API, its errors, and `drafter serve` flags."""

import json
import urllib.error
import urllib.request

import pytest

from drafter_service.cli.main import build_parser
from drafter_service.cli.serve import config_from_args
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import NamespaceSpec, ServiceConfig


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    cfg = ServiceConfig(address="127.0.0.1:0", data_dir=str(tmp_path_factory.mktemp("data")),
                        http_address="127.0.0.1:0", default_vocab_size=100, namespaces=(NamespaceSpec("other", 50),),
                        drafter=DrafterConfig(capacity=1 << 12), rebuild_in_subprocess=False, metrics_interval_s=3600)
    with Runtime(cfg) as running:  # the embedded Redis, as `drafter serve` runs it
        for _ in range(5):
            running.rollup.roll()
        yield running


def request(runtime, path, method="GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{runtime.http_port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.status, reply.headers.get("Content-Type"), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type"), err.read()


def test_the_page_and_every_file_it_loads_are_served_without_any_other_host(runtime):
    status, kind, page = request(runtime, "/")
    assert status == 200 and kind.startswith("text/html")
    html = page.decode()
    for asset in ("/static/vendor/uPlot.iife.min.js", "/static/vendor/uPlot.min.css", "/static/dashboard.js",
                  "/static/dashboard.css"):
        assert f'"{asset}"' in html
        status, kind, body = request(runtime, asset)
        assert status == 200 and len(body) > 1000, asset
        assert kind.split(";")[0] in ("text/javascript", "application/javascript", "text/css")
    assert "http://" not in html and "https://" not in html  # no CDN
    assert b"uPlot" in request(runtime, "/static/vendor/uPlot.iife.min.js")[2][:200]
    assert request(runtime, "/", method="HEAD")[0] == 200


@pytest.mark.parametrize("path", ["/static/../http_server.py", "/static/%2e%2e/http_server.py", "/static/nope.js",
                                  "/static/.hidden", "/static/vendor/../../metrics.py", "/nowhere"])
def test_paths_outside_the_dashboard_files_are_not_found(runtime, path):
    status, kind, body = request(runtime, path)
    assert status == 404 and kind == "application/json" and "error" in json.loads(body)


def test_namespaces_series_and_health(runtime):
    status, _, body = request(runtime, "/api/namespaces")
    assert status == 200
    listed = json.loads(body)
    assert listed["namespaces"] == ["default", "other"] and listed["default"] == "default"
    assert listed["interval_s"] == 3600
    status, _, body = request(runtime, "/api/series?namespace=other")
    points = json.loads(body)["points"]
    assert status == 200 and len(points) == 5 and all(p["namespace"] == "other" for p in points)
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)
    newest = json.loads(request(runtime, "/api/series?namespace=other&limit=2")[2])["points"]
    assert newest == points[-2:]
    later = json.loads(request(runtime, f"/api/series?namespace=other&since={points[2]['t']}")[2])["points"]
    assert later == [p for p in points if p["t"] > points[2]["t"]]
    merged = json.loads(request(runtime, "/api/series?namespace=other&max_points=2")[2])["points"]
    assert len(merged) == 2 and merged[-1]["t"] == points[-1]["t"]
    assert sum(p["interval_s"] for p in merged) == pytest.approx(sum(p["interval_s"] for p in points))
    assert json.loads(request(runtime, "/api/series")[2])["namespace"] == "default"
    status, _, body = request(runtime, "/healthz")
    both = dict.fromkeys(("default", "other"))
    assert status == 200 and json.loads(body) == {"status": "ok", "persistence_healthy": dict.fromkeys(both, True),
                                                  "spooled_requests": dict.fromkeys(both, 0),
                                                  "redis_replicas_connected": dict.fromkeys(both, 0),
                                                  "redis_replica_acks": dict.fromkeys(both, 0),
                                                  "persistence_detail": dict.fromkeys(both, "")}
    status, kind, body = request(runtime, "/metrics")
    assert status == 200 and kind.startswith("text/plain") and b'drafter_drafts_total{namespace="other"}' in body


@pytest.mark.parametrize("query, status, words", [
    ("namespace=nope", 404, "unknown namespace 'nope'"),
    ("since=abc", 400, "'since' must be an integer"),
    ("since=-5", 400, "'since' must be in [0,"),
    ("since=1&since=2", 400, "'since' given 2 times"),
    ("limit=0", 400, "'limit' must be in [1,"),
    ("max_points=x", 400, "'max_points' must be an integer"),
    ("namespace=default&namespace=other", 400, "'namespace' given more than once"),
    ("from=3", 400, "unknown parameters ['from']"),
])
def test_bad_series_queries_get_a_clear_json_error(runtime, query, status, words):
    got, kind, body = request(runtime, f"/api/series?{query}")
    assert got == status and kind == "application/json"
    assert words in json.loads(body)["error"]


def test_other_methods_are_refused(runtime):
    status, _, body = request(runtime, "/api/series", method="POST")
    assert status == 405 and "GET" in json.loads(body)["error"]


def test_a_busy_http_address_refuses_to_start_with_a_clear_message(runtime, tmp_path):
    cfg = ServiceConfig(address="127.0.0.1:0", data_dir=str(tmp_path / "data"),
                        http_address=f"127.0.0.1:{runtime.http_port}", default_vocab_size=100,
                        drafter=DrafterConfig(capacity=1 << 12), rebuild_in_subprocess=False)
    busy = Runtime(cfg)
    with pytest.raises(OSError, match="for the dashboard and /metrics"):
        busy.start()
    busy.stop(grace=0)


def test_serve_flags_and_environment_fill_the_http_settings(monkeypatch):
    args = build_parser().parse_args(["serve"])
    cfg = config_from_args(args)
    assert (cfg.http_address, cfg.metrics_interval_s, cfg.metrics_history) == ("127.0.0.1:8050", 5.0, 120960)
    monkeypatch.setenv("DRAFTER_HTTP_ADDRESS", "")
    monkeypatch.setenv("DRAFTER_METRICS_INTERVAL", "0.5")
    cfg = config_from_args(build_parser().parse_args(["serve", "--metrics-history", "10"]))
    assert (cfg.http_address, cfg.metrics_interval_s, cfg.metrics_history) == ("", 0.5, 10)
    with pytest.raises(ValueError, match="HOST:PORT"):
        config_from_args(build_parser().parse_args(["serve", "--http-address", "8050"]))
