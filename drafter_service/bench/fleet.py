"""A fleet of engine replicas replayed: routing, restarts, per-replica peers beside one shared drafter.

Recorded requests are served one after another, in order, as ``bench replay`` serves them; each goes to one of N
replicas (round robin, or by prefix affinity: to the replica that served the longest matching prompt prefix, as
cache-aware routers route, see ``prefix_router``). Every replica has its own in-process peers, which learn only from
the requests that replica served; drafter is one core shared by the whole fleet, so a request any replica completed
reaches the others only through drafter's store. Every R requests one replica, in turn, restarts: its peers start
empty, drafter keeps everything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from drafter_service.bench.oracle import RetrievalOracle, SeenPrefixes
from drafter_service.bench.prefix_router import PrefixRouter
from drafter_service.bench.protocol import ReplayDrafter
from drafter_service.bench.replay import Mode, replay
from drafter_service.datasets.loaders import Request

__all__ = ["AFTER_RESTART", "ROUTINGS", "Fleet", "FleetPlan", "RequestLog", "replay_fleet", "replay_replica_oracles",
           "replay_shared", "replica_histories", "route"]

#: How requests are routed to replicas: in turn, or to the replica that served the longest matching prompt prefix.
ROUTINGS = ("round-robin", "prefix")

#: Requests a replica serves after a restart that count as "after the restart".
AFTER_RESTART = 50


def route(requests: Sequence[Request], replicas: int, routing: str) -> np.ndarray:
    """The replica each request goes to.

    Args:
        requests: the requests, in the order the fleet serves them.
        replicas: N, at least 1.
        routing: ``"round-robin"`` (request i to replica i mod N) or ``"prefix"`` (``PrefixRouter``: to the
            replica that served the prompt sharing the longest prefix with it, beyond what every prompt shares,
            else to the least-loaded one).

    Returns:
        (len(requests),) int64 replica indexes.

    Raises:
        ValueError: on ``replicas < 1`` or an unknown routing.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if routing == "round-robin":
        return np.arange(len(requests), dtype=np.int64) % replicas
    if routing == "prefix":
        router = PrefixRouter(replicas)
        return np.array([router.route(r.prompt) for r in requests], dtype=np.int64)
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")


@dataclass(frozen=True)
class FleetPlan:
    """Where each request goes and when replicas restart, fixed before the replay.

    Attributes:
        replicas: N.
        routing: one of ``ROUTINGS``.
        restart_every: R; after every R-th request of the fleet one replica restarts, in turn (0: never).
        replica_of: (requests,) int64, the replica serving each request.
        restart_after: (requests,) int64, the replica restarting once request i is done, -1 for none.
        after_restart: (requests,) bool, request i is among the first ``window`` its replica serves after one of its
            restarts (and before the next).
        window: requests per replica counted after a restart.
    """

    replicas: int
    routing: str
    restart_every: int
    replica_of: np.ndarray
    restart_after: np.ndarray
    after_restart: np.ndarray
    window: int = AFTER_RESTART

    @classmethod
    def build(cls, requests: Sequence[Request], replicas: int, routing: str, restart_every: int = 0,
              window: int = AFTER_RESTART) -> FleetPlan:
        """Route ``requests`` and schedule the restarts.

        Raises:
            ValueError: on ``replicas < 1``, an unknown routing, ``restart_every < 0`` or ``window < 0``.
        """
        if restart_every < 0 or window < 0:
            raise ValueError(f"restart_every and window must be >= 0, got {restart_every} and {window}")
        replica_of = route(requests, replicas, routing)
        n = len(requests)
        restart_after = np.full(n, -1, dtype=np.int64)
        if restart_every:
            ends = np.arange(restart_every - 1, n, restart_every)
            restart_after[ends] = np.arange(ends.size) % replicas
        after = np.zeros(n, dtype=bool)
        left = np.zeros(replicas, dtype=np.int64)  # requests each replica still counts after its last restart
        for i in range(n):
            r = replica_of[i]
            if left[r] > 0:
                after[i] = True
                left[r] -= 1
            if restart_after[i] >= 0:
                left[restart_after[i]] = window
        return cls(replicas, routing, restart_every, replica_of, restart_after, after, window)

    @property
    def restarts(self) -> int:
        """Restarts in the whole replay."""
        return int((self.restart_after >= 0).sum())

    def key(self) -> tuple[bytes, bytes]:
        """What the peers' results depend on: two plans with equal keys give the same per-replica replay."""
        return self.replica_of.tobytes(), self.restart_after.tobytes()


class Fleet:
    """N replicas' in-process peers, made by a factory; a restart replaces a replica's peers with fresh ones."""

    def __init__(self, replicas: int, make_peers: Callable[[], list[ReplayDrafter]]) -> None:
        """Start N replicas with fresh peers each.

        Raises:
            ValueError: on ``replicas < 1``.
        """
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.make_peers = make_peers
        self._peers = [make_peers() for _ in range(replicas)]
        self.restarts = [0] * replicas

    def peers(self, replica: int) -> list[ReplayDrafter]:
        """The replica's current peers."""
        return self._peers[replica]

    def restart(self, replica: int) -> None:
        """The replica restarts: its peers start empty."""
        self._peers[replica] = self.make_peers()
        self.restarts[replica] += 1


@dataclass
class RequestLog:
    """One drafter's counts per request of a replay, to sum over any subset of the requests.

    Attributes:
        name: the drafter's name.
        steps: (requests,) int64 verification steps per request.
        emitted: (requests,) int64 tokens emitted per request (accepted draft tokens plus the target's own).
        hits: (requests,) int64 steps that accepted at least one draft token.
        nodes: (requests,) int64 nodes drafted.
    """

    name: str
    steps: np.ndarray
    emitted: np.ndarray
    hits: np.ndarray
    nodes: np.ndarray

    @classmethod
    def empty(cls, name: str, requests: int) -> RequestLog:
        """A log of ``requests`` requests, all counts zero."""
        return cls(name, *(np.zeros(requests, dtype=np.int64) for _ in range(4)))

    def record(self, i: int, drafter: ReplayDrafter, request: Request, budget: int, mode: Mode) -> None:
        """Replay request ``i`` through ``drafter`` (``replay`` on it alone) and keep its counts."""
        one = replay(drafter, [request], budget, mode=mode)
        self.steps[i], self.emitted[i], self.hits[i], self.nodes[i] = one.steps, one.emitted, one.hits, one.nodes

    def mat(self, where: np.ndarray | None = None) -> float:
        """Mean accepted length over the requests ``where`` selects ((requests,) bool; None: all of them)."""
        steps = int(self.steps.sum() if where is None else self.steps[where].sum())
        emitted = int(self.emitted.sum() if where is None else self.emitted[where].sum())
        return emitted / steps if steps else 0.0

    def hit_rate(self, where: np.ndarray | None = None) -> float:
        """Share of the steps of the requests ``where`` selects that accepted at least one draft token."""
        steps = int(self.steps.sum() if where is None else self.steps[where].sum())
        hits = int(self.hits.sum() if where is None else self.hits[where].sum())
        return hits / steps if steps else 0.0


def replay_shared(drafter: ReplayDrafter, requests: Sequence[Request], budget: int, mode: Mode = "chain",
                  progress: Callable[[int], None] | None = None) -> RequestLog:
    """Replay every request through one drafter the whole fleet shares (drafter, the retrieval oracle): whichever
    replica serves a request, the same drafter drafts it and learns from it, so routing and restarts do not change
    its counts."""
    log = RequestLog.empty(drafter.name, len(requests))
    for i, req in enumerate(requests):
        log.record(i, drafter, req, budget, mode)
        if progress is not None:
            progress(i + 1)
    return log


def replay_fleet(requests: Sequence[Request], plan: FleetPlan, make_peers: Callable[[], list[ReplayDrafter]],
                 budget: int, mode: Mode = "chain", shared: Sequence[ReplayDrafter] = (),
                 progress: Callable[[int], None] | None = None,
                 fleet: Fleet | None = None) -> dict[str, RequestLog]:
    """Serve the requests in order on the plan's replicas and count every drafter's steps per request.

    Each request is replayed (``replay``, one request at a time) through every ``shared`` drafter and through the
    peers of the replica the plan routes it to; once it is done, the replica the plan restarts there (if any) gets
    fresh peers. A peer's log holds zeros for the requests other replicas served, and its counts sum, over the fleet,
    the requests each replica's own instance of it drafted.

    Args:
        requests: the requests, in serving order.
        plan: ``FleetPlan.build`` of those requests.
        make_peers: fresh peers for one replica (their names are the same every call).
        budget: tree nodes, or chain length ``k`` in chain mode.
        mode: "tree" or "chain", as in ``replay``.
        shared: drafters the whole fleet shares.
        progress: called with the requests done after each one.
        fleet: the replicas to use (default: a new ``Fleet``; pass one to inspect it afterwards).

    Returns:
        One log per drafter name: the shared ones, then the peers.

    Raises:
        ValueError: when the plan is for another number of requests or replicas.
    """
    if plan.replica_of.size != len(requests):
        raise ValueError(f"the plan routes {plan.replica_of.size} requests, not {len(requests)}")
    fleet = fleet or Fleet(plan.replicas, make_peers)
    if len(fleet.restarts) != plan.replicas:
        raise ValueError(f"the fleet has {len(fleet.restarts)} replicas, the plan {plan.replicas}")
    logs = {d.name: RequestLog.empty(d.name, len(requests)) for d in shared}
    logs.update({p.name: RequestLog.empty(p.name, len(requests)) for p in fleet.peers(0)})
    for i, req in enumerate(requests):
        for drafter in shared:
            logs[drafter.name].record(i, drafter, req, budget, mode)
        for peer in fleet.peers(int(plan.replica_of[i])):
            logs[peer.name].record(i, peer, req, budget, mode)
        if plan.restart_after[i] >= 0:
            fleet.restart(int(plan.restart_after[i]))
        if progress is not None:
            progress(i + 1)
    return logs


def replica_histories(plan: FleetPlan) -> list[list[int]]:
    """What each replica has seen between its restarts: the requests (indexes, in serving order) of every
    stretch one replica served from a start or restart to its next restart or the end, one list per stretch."""
    open_: dict[int, list[int]] = {}
    out: list[list[int]] = []
    for i, replica in enumerate(plan.replica_of.tolist()):
        open_.setdefault(replica, []).append(i)
        restarting = int(plan.restart_after[i])
        if restarting >= 0 and restarting in open_:
            out.append(open_.pop(restarting))
    return out + list(open_.values())


def replay_replica_oracles(requests: Sequence[Request], plan: FleetPlan, budget: int, mode: Mode = "chain",
                           name: str = "oracle-replica") -> RequestLog:
    """The retrieval oracle of each replica over its own history: at every step, the longest prefix of the rest
    of the output that the replica has seen since its last restart (the requests it served, this one's prompt and
    output so far). No per-replica drafter that copies what it has seen gets more accepted; over the shared
    oracle's MAT it says how much of the fleet's gain over per-replica history a perfect copier could take."""
    log = RequestLog.empty(name, len(requests))
    for stretch in replica_histories(plan):
        served = [requests[i] for i in stretch]
        oracle = RetrievalOracle(SeenPrefixes.of(served, budget), 0, name)
        for i, req in zip(stretch, served, strict=True):
            log.record(i, oracle, req, budget, mode)
    return log
