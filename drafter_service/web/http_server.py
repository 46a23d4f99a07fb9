"""The service's HTTP port: Prometheus /metrics, the live dashboard, its JSON API and /healthz."""

from __future__ import annotations

import json
import logging
import mimetypes
import re
import socket
import threading
import time
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, unquote, urlsplit

from prometheus_client import CollectorRegistry

from drafter_service.api.names import DEFAULT_NAMESPACE
from drafter_service.service.auth import HttpAuth
from drafter_service.service.health import health_report
from drafter_service.web.metrics import CONTENT_TYPE_LATEST, exposition, metrics_registry
from drafter_service.web.timeseries import downsample

if TYPE_CHECKING:
    from drafter_service.service.service import DrafterService
    from drafter_service.web.timeseries import MetricsRollup

logger = logging.getLogger(__name__)

__all__ = ["DashboardServer", "HttpError"]

_ASSET_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_SERIES_PARAMS = {"namespace", "since", "limit", "max_points"}
MAX_LIMIT = 500_000
"""Most points one /api/series call reads."""
TOKEN_COOKIE = "drafter_token"
"""Cookie set when the page is opened with ``?token=``, so its own API calls carry the token."""
_TOKEN_PARAM = re.compile(r"([?&]token=)[^&\s\"]*")
PUBLIC_PATHS = frozenset({"/healthz"})
"""Paths served without a token (/healthz then answers only its overall status)."""


class HttpError(Exception):
    """A request the API refuses: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _int_param(query: dict[str, list[str]], name: str, default: int, lo: int, hi: int) -> int:
    values = query.get(name)
    if not values:
        return default
    if len(values) > 1:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"parameter {name!r} given {len(values)} times")
    raw = values[0].strip()
    if not re.fullmatch(r"-?\d{1,18}", raw):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"parameter {name!r} must be an integer, got {values[0]!r}")
    value = int(raw)
    if not lo <= value <= hi:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"parameter {name!r} must be in [{lo}, {hi}], got {value}")
    return value


class DashboardServer:
    """A threading HTTP server on its own daemon thread.

    Routes (GET and HEAD):
        /metrics            Prometheus text exposition of ``registry``
        /                   the dashboard page; /static/<file> its scripts, styles and vendored uPlot
        /api/namespaces     {"namespaces": [...], "default", "interval_s", "now"}
        /api/series         {"namespace", "points": [...], "now"}; query: namespace (default "default"),
                            since (ms, exclusive, default 0), limit (newest points, default 20000),
                            max_points (merge runs of points down to this many; 0 keeps them all)
        /healthz            {"status": "ok" or "degraded", "persistence_healthy": {namespace: bool},
                            "spooled_requests", "redis_replicas_connected", "redis_replica_acks": {namespace:
                            int}, "persistence_detail": {namespace: why degraded}} (degraded: Redis away, too
                            few replicas online, or requests spooled)
    Bad query parameters answer 400, an unknown namespace or path 404, other methods 405; always JSON.

    With ``auth`` requiring a token, every path but /healthz needs it (401 otherwise) as
    ``Authorization: Bearer <token>``, a ``token`` query parameter (which also sets an HttpOnly cookie, so the
    page's own API calls carry it) or that cookie; /healthz without it answers only ``{"status": ...}``.
    """

    def __init__(self, service: DrafterService, rollup: MetricsRollup, address: str,
                 registry: CollectorRegistry | None = None, interval_s: float = 5.0,
                 auth: HttpAuth | None = None) -> None:
        self.service = service
        self.auth = auth if auth is not None else HttpAuth()
        self.rollup = rollup
        self.registry = registry if registry is not None else metrics_registry(service)
        self.interval_s = float(interval_s)
        self.address = address
        self._assets: dict[str, tuple[bytes, str]] = {}
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (0 before ``start``)."""
        return self._httpd.server_address[1] if self._httpd is not None else 0

    @property
    def url(self) -> str:
        """http://host:port/ of the dashboard."""
        host = self.address.rpartition(":")[0]
        return f"http://{host}:{self.port}/"

    def start(self) -> DashboardServer:
        """Bind and serve on a daemon thread.

        Raises:
            OSError: the address cannot be bound (in use, bad host).
        """
        host, _, port = self.address.rpartition(":")
        server_class = _Server6 if host.startswith("[") else _Server
        self._httpd = server_class((host.strip("[]"), int(port)), _Handler)
        self._httpd.app = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="drafter-http", daemon=True)
        self._thread.start()
        logger.info("dashboard and /metrics on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket. Safe to call twice."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)

    # -- routes ---------------------------------------------------------------------------------------

    def route(self, path: str, query: dict[str, list[str]], authorized: bool = True
              ) -> tuple[HTTPStatus, bytes, str]:
        """(status, body, content type) for a GET of ``path`` (``authorized``: the request's token is good).

        Raises:
            HttpError: refused requests.
        """
        if not authorized and path not in PUBLIC_PATHS:
            raise HttpError(HTTPStatus.UNAUTHORIZED, "this page needs the HTTP or admin token: send "
                            "'Authorization: Bearer <token>' or open it with ?token=<token>")
        if path == "/metrics":
            return HTTPStatus.OK, exposition(self.registry), CONTENT_TYPE_LATEST
        if path in ("/", "/index.html"):
            return (HTTPStatus.OK, *self.asset("index.html"))
        if path.startswith("/static/"):
            return (HTTPStatus.OK, *self.asset(path[len("/static/"):]))
        if path == "/api/namespaces":
            return self._json({"namespaces": list(self.service.namespaces), "default": DEFAULT_NAMESPACE,
                               "interval_s": self.interval_s, "now": int(time.time() * 1000)})
        if path == "/api/series":
            return self._json(self.series(query))
        if path == "/healthz":
            report = health_report(self.service)
            if not authorized:  # namespace names and their health stay private
                return self._json({"status": report["status"]})
            return self._json(report)
        raise HttpError(HTTPStatus.NOT_FOUND, f"no such path {path!r}")

    def series(self, query: dict[str, list[str]]) -> dict:
        """The body of /api/series."""
        unknown = sorted(set(query) - _SERIES_PARAMS)
        if unknown:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"unknown parameters {unknown}; expected some of "
                            f"{sorted(_SERIES_PARAMS)}")
        names = query.get("namespace") or [DEFAULT_NAMESPACE]
        if len(names) > 1:
            raise HttpError(HTTPStatus.BAD_REQUEST, "parameter 'namespace' given more than once")
        name = names[0]
        since = _int_param(query, "since", 0, 0, 1 << 53)
        limit = _int_param(query, "limit", 20000, 1, MAX_LIMIT)
        max_points = _int_param(query, "max_points", 0, 0, MAX_LIMIT)
        if name not in self.service.namespaces:
            raise HttpError(HTTPStatus.NOT_FOUND, f"unknown namespace {name!r}")
        points = downsample(self.rollup.series(name, since, limit), max_points)
        return {"namespace": name, "points": points, "now": int(time.time() * 1000)}

    def asset(self, name: str) -> tuple[bytes, str]:
        """(bytes, content type) of a dashboard file (package data of ``drafter_service.web.dashboard``)."""
        found = self._assets.get(name)
        if found is not None:
            return found
        parts = name.split("/")
        if len(parts) > 3 or not all(_ASSET_PART.fullmatch(p) for p in parts):
            raise HttpError(HTTPStatus.NOT_FOUND, f"no such file {name!r}")
        entry = resources.files("drafter_service.web.dashboard").joinpath(*parts)
        if not entry.is_file():
            raise HttpError(HTTPStatus.NOT_FOUND, f"no such file {name!r}")
        kind = mimetypes.guess_type(parts[-1])[0] or "application/octet-stream"
        if kind.startswith("text/") or kind == "application/javascript":
            kind += "; charset=utf-8"
        found = self._assets[name] = (entry.read_bytes(), kind)
        return found

    @staticmethod
    def _json(body: object, status: HTTPStatus = HTTPStatus.OK) -> tuple[HTTPStatus, bytes, str]:
        return status, json.dumps(body, separators=(",", ":")).encode(), "application/json"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: DashboardServer


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "drafter"

    def do_GET(self) -> None:  # noqa: N802 (the http.server naming)
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, json.dumps({"error": f"method {self.command} not allowed; "
                                                                       "use GET"}).encode(),
                   "application/json", True, {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    def _token(self, query: dict[str, list[str]]) -> tuple[str | None, bool]:
        """(the request's token or None, whether it came as ``?token=``); the parameter leaves ``query``."""
        given = query.pop("token", None)
        if given:
            return given[-1], True
        header = self.headers.get("Authorization") or ""
        if header[:7].lower() == "bearer ":
            return header[7:].strip(), False
        try:
            cookie = SimpleCookie(self.headers.get("Cookie") or "").get(TOKEN_COOKIE)
        except CookieError:
            cookie = None
        return (unquote(cookie.value) if cookie is not None else None), False

    def _answer(self, body: bool) -> None:
        url = urlsplit(self.path)
        headers: dict[str, str] = {}
        try:
            query = parse_qs(url.query, keep_blank_values=True, strict_parsing=False)
            token, from_query = self._token(query)
            authorized = self.server.app.auth.allows(token)
            if authorized and from_query and token is not None and self.server.app.auth.required:
                headers["Set-Cookie"] = f"{TOKEN_COOKIE}={quote(token, safe='')}; Path=/; HttpOnly; SameSite=Strict"
            status, payload, kind = self.server.app.route(url.path, query, authorized)
        except HttpError as exc:
            status, payload, kind = exc.status, json.dumps({"error": str(exc)}).encode(), "application/json"
            if status == HTTPStatus.UNAUTHORIZED:
                headers["WWW-Authenticate"] = 'Bearer realm="drafter"'
        except Exception:
            logger.exception("HTTP %s failed", url.path)
            status, payload, kind = (HTTPStatus.INTERNAL_SERVER_ERROR,
                                     json.dumps({"error": "internal error; see the service log"}).encode(),
                                     "application/json")
        self._send(status, payload, kind, body, headers)

    def _send(self, status: HTTPStatus, payload: bytes, kind: str, body: bool,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        logger.debug("%s %s", self.address_string(), _TOKEN_PARAM.sub(r"\1***", format % args))  # no tokens logged
