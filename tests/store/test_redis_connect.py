"""Redis URLs: one server, Sentinel and Cluster forms parsed (no server needed), clients of the right kind."""

import pytest
import redis
from redis.sentinel import MasterNotFoundError, SentinelConnectionPool

from store.redis_connect import (
    CLUSTER,
    SENTINEL,
    SINGLE,
    RedisTarget,
    client_options,
    connect,
    node_client,
    parse_redis_url,
    redact,
    server_name,
)
from store.sentinel_master import PromptSentinel


@pytest.mark.parametrize("url", ["redis://localhost:6379/0", "rediss://:pw@cache.example:6380/2",
                                 "unix:///run/redis.sock?db=1", "REDIS://h"])
def test_single_server_urls_are_left_to_redis_py(url):
    assert parse_redis_url(url) == RedisTarget(SINGLE, url)


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_database():
    url = "redis+sentinel://:s3cret@10.0.0.1:26379,sentinel-b:26380,[::1]:26381/my-primary/3"
    assert parse_redis_url(url) == RedisTarget(
        SENTINEL, url, (("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381)), master="my-primary", db=3,
        password="s3cret")


def test_sentinel_url_defaults_user_and_sentinel_password():
    assert parse_redis_url("redis+sentinel://s1/m") == RedisTarget(
        SENTINEL, "redis+sentinel://s1/m", (("s1", 26379),), master="m", db=0)
    target = parse_redis_url("redis+sentinel://app:p%40ss@s1:1,s2:2/m/?sentinel_password=x")
    assert (target.username, target.password, target.sentinel_password, target.db) == ("app", "p@ss", "x", 0)
    assert target.nodes == (("s1", 1), ("s2", 2))


def test_a_cluster_url_lists_startup_nodes():
    url = "redis+cluster://:pw@n1:7000,n2:7001,n3"
    assert parse_redis_url(url) == RedisTarget(CLUSTER, url, (("n1", 7000), ("n2", 7001), ("n3", 6379)),
                                               password="pw")
    assert parse_redis_url("redis+cluster://n1:7000/0").nodes == (("n1", 7000),)


@pytest.mark.parametrize(("url", "why"), [
    ("localhost:6379", "no scheme"),
    ("http://localhost:6379", "unknown scheme 'http://'"),
    ("redis+sentinel://s1:26379", "names the master"),
    ("redis+sentinel://s1:26379/m/x", "database 'x' is not a number"),
    ("redis+sentinel://s1:26379/m/0/extra", "names the master"),
    ("redis+sentinel:///m", "no HOST:PORT"),
    ("redis+sentinel://s1:26379,/m", "'' is not HOST:PORT"),
    ("redis+sentinel://s1:99999/m", "port 99999 outside"),
    ("redis+sentinel://s1:port/m", "'s1:port' is not HOST:PORT"),
    ("redis+sentinel://s1/m?ssl=1", "unknown option 'ssl'"),
    ("redis+cluster://n1:7000/1", "database 0 only"),
    ("redis+cluster://n1:7000?sentinel_password=x", "unknown option"),
])
def test_a_bad_url_names_the_accepted_forms(url, why):
    with pytest.raises(ValueError, match="bad Redis URL") as caught:
        parse_redis_url(url)
    message = str(caught.value)
    assert why in message
    for form in ("redis://", "redis+sentinel://", "redis+cluster://"):
        assert form in message


def test_a_bad_url_does_not_repeat_its_password():
    with pytest.raises(ValueError) as caught:
        parse_redis_url("redis+cluster://user:hunter2@n1:7000/5")
    assert "hunter2" not in str(caught.value) and "user:***@n1:7000" in str(caught.value)
    assert redact("redis+sentinel://:pw@a:1,b:2/m") == "redis+sentinel://:***@a:1,b:2/m"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def test_connect_gives_a_plain_client_or_a_sentinel_managed_one_without_connecting():
    single = connect("redis://127.0.0.1:1/4")
    assert type(single) is redis.Redis and single.get_connection_kwargs()["db"] == 4
    assert not single.get_connection_kwargs()["decode_responses"]
    assert node_client(single, "any") is single and server_name(single, "any") == "127.0.0.1:1"
    managed = connect("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/primary/2")
    pool = managed.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "primary"
    kwargs = managed.get_connection_kwargs()
    assert (kwargs["db"], kwargs["password"], kwargs["decode_responses"], kwargs["socket_timeout"]) == \
        (2, "pw", False, 60)
    assert [(s.get_connection_kwargs()["host"], s.get_connection_kwargs()["port"])
            for s in pool.sentinel_manager.sentinels] == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert server_name(managed, "any") == ""  # no sentinel answers there


def test_a_client_with_a_timeout_bounds_every_wait_and_asks_sentinels_briefly():
    quick = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/primary", timeout_s=1.0)
    kwargs = quick.get_connection_kwargs()
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (1.0, 0.5)
    manager = quick.connection_pool.sentinel_manager
    assert isinstance(manager, PromptSentinel)
    assert {s.get_connection_kwargs()["socket_timeout"] for s in manager.sentinels} == {0.25}
    single = connect("redis://127.0.0.1:1/0", timeout_s=0.4).get_connection_kwargs()
    assert (single["socket_timeout"], single["socket_connect_timeout"]) == (0.4, 0.2)
    assert client_options()[0]["socket_timeout"] == 60
    with pytest.raises(ValueError, match="positive"):
        client_options(0)


class FakeSentinel:
    """Answers GET-MASTER-ADDR-BY-NAME and SENTINEL MASTER (in one pipeline) as a sentinel would, or fails."""

    def __init__(self, given, state):
        self.given, self.state = given, state

    def pipeline(self, transaction=False):
        return self

    def execute_command(self, *args):
        return self

    def execute(self):
        if isinstance(self.state, Exception):
            raise self.state
        return [self.given, self.state]


def state(port, *flags):
    names = {"master", *flags}
    return {"ip": "10.0.0.1", "port": port, "is_master": True, "is_sdown": "s_down" in names,
            "is_odown": "o_down" in names, "num-other-sentinels": 2, "flags": names}


def discover(*sentinels):
    manager = PromptSentinel([])
    manager.sentinels = list(sentinels)
    return manager.discover_master("primary"), manager


def test_a_promoted_replica_is_found_from_the_sentinel_leading_the_failover():
    down = FakeSentinel((b"10.0.0.1", b"7000"), state(7000, "s_down", "o_down"))
    leader = FakeSentinel((b"10.0.0.2", b"7001"), state(7000, "s_down", "o_down", "failover_in_progress"))
    address, manager = discover(down, leader)
    assert address == ("10.0.0.2", 7001)
    assert manager.sentinels[0] is leader  # asked first next time


def test_an_up_master_is_taken_and_a_down_one_passed_over():
    refused = FakeSentinel(None, redis.ConnectionError("refused"))
    up = FakeSentinel((b"10.0.0.1", b"7000"), state(7000))
    assert discover(refused, up)[0] == ("10.0.0.1", 7000)
    down = FakeSentinel((b"10.0.0.1", b"7000"), state(7000, "s_down"))
    with pytest.raises(MasterNotFoundError, match="No master found for 'primary'.*refused"):
        discover(refused, down)
