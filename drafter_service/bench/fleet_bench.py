"""`drafter bench fleet`: recorded requests replayed through N engine replicas with their own peers beside one
shared drafter, by routing and restarts."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from drafter_service.bench.fleet import (
    AFTER_RESTART,
    ROUTINGS,
    FleetPlan,
    RequestLog,
    replay_fleet,
    replay_replica_oracles,
    replay_shared,
)
from drafter_service.bench.oracle import RetrievalOracle, SeenPrefixes
from drafter_service.bench.peers import arctic_available
from drafter_service.bench.protocol import ReplayDrafter
from drafter_service.bench.replay import CoreDrafter, Mode
from drafter_service.bench.replay_inputs import PEERS, add_request_flags, chain_peer, load_sets, make_peer, peer_names
from drafter_service.datasets.loaders import Request

logger = logging.getLogger(__name__)

__all__ = ["FleetResult", "add_fleet_bench", "format_fleet", "run_fleet"]

#: Verification modes run when neither ``--chain`` nor ``--budget`` is given.
DEFAULT_ROWS: tuple[tuple[Mode, int], ...] = (("chain", 4), ("chain", 8), ("tree", 8), ("tree", 32))

#: The shared drafters' names, and the oracle over each replica's own history; every other log is a per-replica
#: peer's.
DRAFTER, ORACLE, REPLICA_ORACLE = "drafter", "oracle", "oracle-replica"

#: ArcticInference's two settings: the cold suffix decoder a restarted replica starts with.
SUFFIX_PEERS = ("arctic", "arctic-f4")


def add_fleet_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench fleet``."""
    fp = bench.add_parser("fleet", help="replay completed requests through N engine replicas, each with its own "
                          "peers, beside one drafter they all share")
    add_request_flags(fp)
    fp.add_argument("--chain", type=int, action="append", default=[], metavar="K",
                    help="chain mode with chains of at most K tokens (repeatable; default 4 and 8, with trees of 8 "
                    "and 32, when neither --chain nor --budget is given)")
    fp.add_argument("--budget", type=int, action="append", default=[], help="tree mode with trees of at most this "
                    "many nodes (repeatable)")
    fp.add_argument("--replicas", default="1,2,4,8,16", help="comma-separated numbers of engine replicas N")
    fp.add_argument("--routing", default=",".join(ROUTINGS), help="comma-separated routings: round-robin (in turn), "
                    "prefix (to the replica that served the longest matching prompt prefix, at least 32 tokens and "
                    "longer than what all prompts share; else the least-loaded)")
    fp.add_argument("--restart-every", default="0", help="comma-separated R: every R requests of the fleet one "
                    "replica, in turn, restarts with empty peers (0: never)")
    fp.add_argument("--after-restart", type=int, default=AFTER_RESTART, help="requests a replica serves after a "
                    "restart that the after-restart table counts")
    fp.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated per-replica peers among "
                    f"{', '.join(PEERS)}")
    fp.add_argument("--no-oracle", action="store_true", help="leave out the retrieval oracle")
    fp.add_argument("--json", help="also write the results as JSON to this file")
    fp.set_defaults(func=run_fleet)


def _ints(spec: str, flag: str, least: int) -> list[int]:
    try:
        values = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {spec!r}") from None
    if not values or min(values) < least:
        raise SystemExit(f"{flag} takes comma-separated integers >= {least}, got {spec!r}")
    return values


def _routings(spec: str) -> list[str]:
    names = [r.strip() for r in spec.split(",") if r.strip()]
    if not names or any(r not in ROUTINGS for r in names):
        raise SystemExit(f"--routing takes a comma-separated subset of {', '.join(ROUTINGS)}, got {spec!r}")
    return names


@dataclass
class FleetResult:
    """Every drafter's per-request counts in one fleet replay of one data set and verification mode.

    Attributes:
        dataset: the data set's name.
        mode: "chain" or "tree".
        budget: chain length k or tree nodes.
        plan: routing and restarts.
        logs: drafter name -> counts; ``DRAFTER`` and ``ORACLE`` are shared, ``REPLICA_ORACLE`` the oracle over each
            replica's own history, the others per-replica peers.
    """

    dataset: str
    mode: Mode
    budget: int
    plan: FleetPlan
    logs: dict[str, RequestLog]

    @property
    def label(self) -> str:
        return f"{self.mode} {self.budget}"

    @property
    def peers(self) -> list[str]:
        return [n for n in self.logs if n not in (DRAFTER, ORACLE, REPLICA_ORACLE)]

    def scope(self, name: str) -> np.ndarray | None:
        """The requests a scope counts: None for all of them, or the plan's after-restart mask."""
        if name == "all":
            return None
        if name == "after-restart":
            return self.plan.after_restart
        raise ValueError(f"unknown scope {name!r}")

    def mats(self, scope: str = "all") -> dict[str, float]:
        """MAT per drafter over the scope's requests; drafters with no step there (an empty scope) are left out."""
        where = self.scope(scope)
        return {name: log.mat(where) for name, log in self.logs.items()
                if (log.steps if where is None else log.steps[where]).any()}

    def best_peer(self, scope: str = "all", among: Sequence[str] | None = None) -> tuple[str, float] | None:
        """The peer (among ``among``, default all) with the highest MAT in the scope, with it; None without peers."""
        mats = self.mats(scope)
        names = [n for n in (among if among is not None else self.peers) if n in mats]
        if not names:
            return None
        best = max(names, key=lambda n: mats[n])
        return best, mats[best]

    def ratio(self, scope: str = "all", among: Sequence[str] | None = None) -> float | None:
        """drafter's MAT over the best peer's (among ``among``) in the scope; None when either is missing."""
        best = self.best_peer(scope, among)
        mats = self.mats(scope)
        return mats[DRAFTER] / best[1] if best and best[1] and DRAFTER in mats else None

    def history_gain(self, scope: str = "all") -> float | None:
        """The shared oracle's MAT over the per-replica oracle's in the scope: what the fleet's whole history holds
        beyond each replica's own for a drafter that copies perfectly; None without both oracles."""
        mats = self.mats(scope)
        return mats[ORACLE] / mats[REPLICA_ORACLE] if mats.get(ORACLE) and mats.get(REPLICA_ORACLE) else None

    def requests(self, scope: str = "all") -> int:
        """Requests the scope counts."""
        where = self.scope(scope)
        return int(self.plan.replica_of.size if where is None else where.sum())

    def as_dict(self, scope: str = "all") -> dict[str, object]:
        """The scope's figures: MAT, steps and hit rate per drafter, the best peer and drafter's ratios."""
        where = self.scope(scope)
        best = self.best_peer(scope)
        mats = self.mats(scope)
        ratio, suffix, gain = self.ratio(scope), self.ratio(scope, SUFFIX_PEERS), self.history_gain(scope)
        return {"dataset": self.dataset, "mode": self.mode, "budget": self.budget,
                "k": self.budget if self.mode == "chain" else None, "replicas": self.plan.replicas,
                "routing": self.plan.routing, "restart_every": self.plan.restart_every,
                "restarts": self.plan.restarts, "scope": scope,
                "requests": self.requests(scope),
                "mat": {n: round(v, 4) for n, v in mats.items()},
                "steps": {n: int(log.steps.sum() if where is None else log.steps[where].sum())
                          for n, log in self.logs.items()},
                "hit_rate": {n: round(log.hit_rate(where), 4) for n, log in self.logs.items()},
                "best_peer": best[0] if best else None,
                "drafter_vs_best_peer": round(ratio, 4) if ratio else None,
                "drafter_vs_best_suffix": round(suffix, 4) if suffix else None,
                "oracle_vs_replica_oracle": round(gain, 4) if gain else None}


def run_fleet(args: argparse.Namespace) -> int:
    """Replay each data set through every fleet setting and verification mode; print the tables."""
    rows: list[tuple[Mode, int]] = [("chain", k) for k in args.chain] + [("tree", b) for b in args.budget]
    rows = rows or list(DEFAULT_ROWS)
    if any(n < 1 for _, n in rows):
        raise SystemExit("--budget and --chain must be at least 1")
    replicas = _ints(args.replicas, "--replicas", 1)
    routings = _routings(args.routing)
    restarts = _ints(args.restart_every, "--restart-every", 0)
    if args.after_restart < 1:
        raise SystemExit("--after-restart must be at least 1")
    peers = peer_names(args.peers)
    if not arctic_available() and any(p in SUFFIX_PEERS for p in peers):
        logger.warning("arctic-inference is not installed (make bench-peers): the fleet runs without %s",
                       ", ".join(p for p in peers if p in SUFFIX_PEERS))
        peers = [p for p in peers if p not in SUFFIX_PEERS]
    results: list[FleetResult] = []
    for name, reqs in load_sets(args):
        seen = None if args.no_oracle else SeenPrefixes.of(reqs, max(n for _, n in rows))
        for mode, budget in rows:
            results += _run_mode(name, reqs, mode, budget, peers, seen, replicas, routings, restarts,
                                 args.after_restart)
    print(format_fleet(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict(s) for r in results for s in ("all", "after-restart")
                       if s == "all" or r.plan.restarts], f, indent=1)
    return 0


def _run_mode(dataset: str, reqs: list[Request], mode: Mode, budget: int, peers: Sequence[str],
              seen: SeenPrefixes | None, replicas: Sequence[int], routings: Sequence[str],
              restarts: Sequence[int], window: int) -> list[FleetResult]:
    """Every fleet setting of one data set and mode: the shared drafters once (routing and restarts do not change
    what they see), the per-replica peers once per distinct plan."""
    shared: list[RequestLog] = []
    for drafter in _shared_drafters(seen):
        with _bar(f"{dataset} {mode} {budget} shared {drafter.name}", len(reqs)) as bar:
            shared.append(replay_shared(drafter, reqs, budget, mode, lambda _: bar.update()))
    new_peer = chain_peer if mode == "chain" else make_peer

    def make_peers() -> list[ReplayDrafter]:
        return [p for p in map(new_peer, peers) if p is not None]

    done: dict[tuple[bytes, bytes], dict[str, RequestLog]] = {}
    out: list[FleetResult] = []
    for n in replicas:
        for routing in routings:
            for every in restarts:
                plan = FleetPlan.build(reqs, n, routing, every, window)
                if plan.key() not in done:
                    with _bar(f"{dataset} {mode} {budget} N={n} {routing} R={every}", len(reqs)) as bar:
                        done[plan.key()] = replay_fleet(reqs, plan, make_peers, budget, mode,
                                                        progress=lambda _: bar.update())
                    if seen is not None:
                        done[plan.key()][REPLICA_ORACLE] = replay_replica_oracles(reqs, plan, budget, mode,
                                                                                  REPLICA_ORACLE)
                logs = {log.name: log for log in shared} | done[plan.key()]
                out.append(FleetResult(dataset, mode, budget, plan, logs))
    return out


def _shared_drafters(seen: SeenPrefixes | None) -> list[ReplayDrafter]:
    out: list[ReplayDrafter] = [CoreDrafter(name=DRAFTER)]
    if seen is not None:
        out.append(RetrievalOracle(seen, 0, ORACLE))
    return out


def _bar(desc: str, total: int) -> tqdm:
    """A progress bar on stderr, one step per request."""
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


def _cell(value: float | None, ratio: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}×" if ratio else f"{value:.3f}"


def format_fleet(results: Sequence[FleetResult]) -> str:
    """Two markdown tables: MAT over all requests per setting (drafter, each per-replica peer, the oracles over the
    shared and over each replica's own history; drafter over the best peer, the shared oracle over the per-replica
    one), then over the first requests each replica served after its restarts (settings with restarts), drafter
    against the best cold peer and the best cold suffix decoder, and the two oracles there."""
    if not results:
        return "(no results)"
    peers = list(dict.fromkeys(p for r in results for p in r.peers))
    oracle = any(ORACLE in r.logs for r in results)
    oracles = " | oracle | oracle per replica" if oracle else ""
    head = "| data set | mode | N | routing | R | drafter | " + " | ".join(peers) + oracles \
        + " | best peer | drafter / best peer |" + (" oracle / per replica |" if oracle else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(_row(r, "all", peers, oracle))
    restarted = [r for r in results if r.plan.restarts]
    if restarted:
        window = restarted[0].plan.window
        lines += ["", f"After restarts: the first {window} requests each replica served after each of its restarts "
                  "(its peers cold, drafter's store whole).", ""]
        head = "| data set | mode | N | routing | R | requests | drafter | " + " | ".join(peers) + oracles \
            + " | best peer | drafter / best peer | drafter / best cold suffix |" \
            + (" oracle / per replica |" if oracle else "")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in restarted:
            lines.append(_row(r, "after-restart", peers, oracle))
    return "\n".join(lines)


def _row(r: FleetResult, scope: str, peers: Sequence[str], oracle: bool) -> str:
    mats = r.mats(scope)
    cells = [r.dataset, r.label, str(r.plan.replicas), r.plan.routing, str(r.plan.restart_every)]
    if scope != "all":
        cells.append(str(r.requests(scope)))
    cells.append(_cell(mats.get(DRAFTER)))
    cells += [_cell(mats.get(p)) for p in peers]
    if oracle:
        cells += [_cell(mats.get(ORACLE)), _cell(mats.get(REPLICA_ORACLE))]
    best = r.best_peer(scope)
    cells.append(f"{best[0]} {best[1]:.3f}" if best else "-")
    cells.append(_cell(r.ratio(scope), ratio=True))
    if scope != "all":
        cells.append(_cell(r.ratio(scope, SUFFIX_PEERS), ratio=True))
    if oracle:
        cells.append(_cell(r.history_gain(scope), ratio=True))
    return "| " + " | ".join(cells) + " |"
