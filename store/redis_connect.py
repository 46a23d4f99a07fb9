"""Redis URLs to redis-py clients: one server, a Sentinel-managed primary, or a Redis Cluster."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from store.sentinel_master import PromptSentinel

logger = logging.getLogger(__name__)

RedisClient = redis.Redis | RedisCluster
"""What ``connect`` returns: a client of one server (Sentinel's included) or of a cluster."""
RedisPipeline = redis.client.Pipeline | ClusterPipeline
"""What such a client's ``pipeline()`` returns."""

URL_FORMS = ("redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS) or unix://PATH[?db=DB] (one server); "
             "redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB] (the primary the sentinels "
             "name MASTER; ?sentinel_password=... when the sentinels need one); "
             "redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...] (a Redis Cluster, from any of its nodes)")
"""The accepted URL forms, for help texts and errors."""

SINGLE, SENTINEL, CLUSTER = "single", "sentinel", "cluster"
DEFAULT_PORTS = {SENTINEL: 26379, CLUSTER: 6379}

# The same timeouts for every kind of client: connecting is quick or failing; a blocking read (XREAD) stays well
# inside the socket timeout. ``connect(url, timeout_s=...)`` gives a client whose every wait is short instead.
CLIENT_OPTIONS: dict[str, float | int | bool] = {"decode_responses": False, "socket_connect_timeout": 5,
                                                 "socket_timeout": 60, "health_check_interval": 30}
SENTINEL_OPTIONS: dict[str, float] = {"socket_connect_timeout": 5, "socket_timeout": 5}
"""Connections to the sentinels themselves (with no retries: one that does not answer is passed over for the
next)."""

_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\[\]:/@,]+)(?::(\d{1,5}))?$")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL.

    Attributes:
        kind: "single", "sentinel" or "cluster".
        url: the URL as given (``redis.Redis.from_url`` reads it for "single").
        nodes: (host, port) of the sentinels ("sentinel") or of the cluster's startup nodes ("cluster").
        master: the master name the sentinels monitor ("sentinel"; "" otherwise).
        db: database number ("sentinel"; a cluster has only 0).
        username: ACL user of the data nodes (None: the default user).
        password: password of the data nodes (None: none).
        sentinel_password: password of the sentinels (None: none).
    """

    kind: str
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def redact(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hosts}{slash}{path}"


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"bad Redis URL {redact(url)!r}: {why}. Accepted forms: {URL_FORMS}")


def _nodes(url: str, hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    nodes = []
    for part in hosts.split(","):
        found = _HOST_PORT.match(part.strip())
        if not found:
            raise _bad(url, f"{part.strip()!r} is not HOST:PORT")
        host = found.group(1).strip("[]")
        port = int(found.group(2) or default_port)
        if not 0 < port < 65536:
            raise _bad(url, f"port {port} outside 1..65535")
        nodes.append((host, port))
    return tuple(nodes)


def parse_redis_url(url: str) -> RedisTarget:
    """Read a Redis URL (see ``URL_FORMS``) without connecting anywhere.

    Raises:
        ValueError: a URL of no accepted form, naming the forms (its password is not repeated).
    """
    if not isinstance(url, str) or "://" not in url:
        raise _bad(str(url), "no scheme")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        return RedisTarget(SINGLE, url)
    kind = {"redis+sentinel": SENTINEL, "redis+cluster": CLUSTER}.get(scheme)
    if kind is None:
        raise _bad(url, f"unknown scheme {scheme + '://'!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    if not hosts:
        raise _bad(url, "no HOST:PORT")
    nodes = _nodes(url, hosts, DEFAULT_PORTS[kind])
    options = parse_qs(query, keep_blank_values=True, strict_parsing=False) if query else {}
    allowed = {"sentinel_password"} if kind == SENTINEL else set()
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise _bad(url, f"unknown option {unknown[0]!r}")
    parts = [p for p in path.split("/") if p] if path else []
    if kind == CLUSTER:
        if parts not in ([], ["0"]):
            raise _bad(url, "a cluster URL has no path (a Redis Cluster has database 0 only)")
        return RedisTarget(CLUSTER, url, nodes, username=username, password=password)
    if not parts or len(parts) > 2:
        raise _bad(url, "a Sentinel URL names the master: redis+sentinel://HOST:PORT[,...]/MASTER[/DB]")
    if len(parts) == 2 and not parts[1].isdigit():
        raise _bad(url, f"database {parts[1]!r} is not a number")
    sentinel_password = options.get("sentinel_password", [None])[-1]
    return RedisTarget(SENTINEL, url, nodes, master=unquote(parts[0]), db=int(parts[1]) if len(parts) == 2 else 0,
                       username=username, password=password, sentinel_password=sentinel_password)


def client_options(timeout_s: float | None = None) -> tuple[dict, dict]:
    """The options of a client's data-node connections and of its sentinel connections.

    Args:
        timeout_s: None for ``CLIENT_OPTIONS`` and ``SENTINEL_OPTIONS``; else the longest wait for a reply, with
            half of it to connect and a quarter for each sentinel asked where the primary is (sentinels that
            answer at all answer in milliseconds; one that does not is passed over for the next).
    """
    if timeout_s is None:
        return dict(CLIENT_OPTIONS), dict(SENTINEL_OPTIONS)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    ask = min(SENTINEL_OPTIONS["socket_timeout"], timeout_s / 4)
    return ({**CLIENT_OPTIONS, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s / 2},
            {"socket_connect_timeout": ask, "socket_timeout": ask})


def connect(url: str, timeout_s: float | None = None) -> RedisClient:
    """A redis-py client for ``url`` (see ``URL_FORMS``) that never decodes responses.

    ``redis://``, ``rediss://`` and ``unix://`` give ``redis.Redis.from_url``; ``redis+sentinel://`` gives
    ``PromptSentinel(...).master_for(MASTER)``, whose connections follow the primary through failovers (each new
    connection asks the sentinels where it is; one that fails or gets a READONLY reply is closed, so the next
    command asks again); ``redis+cluster://`` gives ``RedisCluster``, which routes each key to the node that holds
    its slot and connects now, to read the slot table.

    Args:
        url: the Redis URL.
        timeout_s: None for the usual timeouts (a reply may take up to 60 s: blocking reads); else the longest a
            command waits for its reply, and about the longest a connection with master discovery takes
            (``client_options``).

    Raises:
        ValueError: a URL of no accepted form.
        redis.RedisError, redis.exceptions.RedisClusterException: a cluster none of whose nodes answer.
    """
    target = parse_redis_url(url)
    auth = {"username": target.username, "password": target.password}
    options, sentinel_options = client_options(timeout_s)
    if target.kind == SINGLE:
        return redis.Redis.from_url(url, **options)
    if target.kind == SENTINEL:
        sentinel_kwargs: dict[str, object] = {**sentinel_options, "retry": Retry(NoBackoff(), 0)}
        if target.sentinel_password is not None:
            sentinel_kwargs["password"] = target.sentinel_password
        sentinel = PromptSentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
        return sentinel.master_for(target.master, db=target.db, **auth, **options)
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                        **auth, **options)  # type: ignore[arg-type]


def node_client(client: RedisClient, key: str) -> redis.Redis:
    """The client of the one server that holds ``key``: ``client`` itself unless it is a cluster's.

    Commands about a server rather than a key (INFO, WAITAOF, PING) go there, and so does a pipeline that must
    run on one connection (a write followed by the WAITAOF and WAIT that wait for it).

    Raises:
        redis.RedisError, redis.exceptions.RedisClusterException: the cluster has no node for the key's slot.
    """
    if isinstance(client, RedisCluster):
        return client.get_redis_connection(client.get_node_from_key(key))
    return client


def refresh_slots(client: RedisClient) -> None:
    """Have a cluster client read the slot table again (after MOVED or a node that stopped answering).

    Does nothing for other clients, and only logs when no node answers (the next command tries again).
    """
    if isinstance(client, RedisCluster):
        try:
            client.nodes_manager.initialize()
        except Exception as exc:  # reported; the caller's own error is the one raised
            logger.debug("could not read the cluster's slot table again: %s", exc)


def server_name(client: RedisClient, key: str) -> str:
    """``host:port`` of the server that holds ``key`` now: the cluster node of its slot, the primary the sentinels
    name, or the one server ("" when it cannot be found out, e.g. no sentinel answers)."""
    try:
        if isinstance(client, RedisCluster):
            return str(client.get_node_from_key(key).name)
        pool = client.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            host, port = pool.get_master_address()
            return f"{host}:{port}"
        kwargs = pool.connection_kwargs
    except Exception:  # only a label
        return ""
    return f"{kwargs['host']}:{kwargs.get('port', 6379)}" if kwargs.get("host") else str(kwargs.get("path", ""))
