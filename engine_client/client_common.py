"""What both drafter clients share besides sessions: errors, statistics, backoff, the buffer of unsent requests."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from drafter_service.api.backoff import BackoffClock, ExponentialBackoff
from drafter_service.api.drafter.v1 import drafter_pb2 as pb

logger = logging.getLogger(__name__)

CALLER_ERRORS = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION", "UNAUTHENTICATED",
                           "PERMISSION_DENIED"})
"""Status codes (names) that mean the request itself (or its credentials) was wrong: raised, never retried."""
INGEST_BATCH = 256
"""Most buffered requests sent in one Ingest call."""


class DrafterRequestError(ValueError):
    """The caller's request was wrong (bad token ids, budgets, unknown session or namespace); never retried.

    Attributes:
        code: the gRPC status code name ("INVALID_ARGUMENT", "NOT_FOUND", ...), "LOCAL" when caught before sending.
    """

    def __init__(self, message: str, code: str = "LOCAL") -> None:
        super().__init__(message)
        self.code = code


class DrafterUnavailable(ConnectionError):
    """Raised only by calls that must answer (``stats``) when the service cannot be reached."""


class ServiceDown(Exception):
    """Inside the clients: the service could not be used for this call (already counted in the backoff)."""


@dataclass
class ClientStats:
    """What a client did, for benchmarks: how many steps reuse served, and what each kind of step cost.

    Acceptance is attributed to the kind of draft it was measured on (``len(accepted) - 1`` draft tokens on the
    step after a non-empty draft), so reused subtrees can be compared with fresh drafts.
    """

    steps: int = 0
    reused_steps: int = 0
    fetched_steps: int = 0
    empty_steps: int = 0
    round_trip_ns: int = 0
    reuse_ns: int = 0
    reused_nodes: int = 0
    fetched_nodes: int = 0
    scored_after_reuse: int = 0
    accepted_after_reuse: int = 0
    scored_after_fetch: int = 0
    accepted_after_fetch: int = 0
    reports_sent: int = 0
    reopened_sessions: int = 0
    outages: int = 0
    buffered_requests: int = 0
    flushed_requests: int = 0
    dropped_requests: int = 0

    @property
    def reuse_share(self) -> float:
        """Share of draft steps served from an earlier tree without a round trip."""
        return self.reused_steps / self.steps if self.steps else 0.0

    @property
    def mean_round_trip_us(self) -> float:
        """Mean time of a draft step that went to the service, in microseconds."""
        return self.round_trip_ns / self.fetched_steps / 1e3 if self.fetched_steps else 0.0

    @property
    def mean_reuse_us(self) -> float:
        """Mean time of a draft step served locally, in microseconds."""
        return self.reuse_ns / self.reused_steps / 1e3 if self.reused_steps else 0.0

    @property
    def saved_ms(self) -> float:
        """Time reuse saved, estimated at the mean round trip, in milliseconds."""
        return self.reused_steps * max(0.0, self.mean_round_trip_us - self.mean_reuse_us) / 1e3

    @property
    def mean_accepted_after_reuse(self) -> float:
        """Draft tokens accepted per step on reused subtrees."""
        return self.accepted_after_reuse / self.scored_after_reuse if self.scored_after_reuse else 0.0

    @property
    def mean_accepted_after_fetch(self) -> float:
        """Draft tokens accepted per step on fresh drafts."""
        return self.accepted_after_fetch / self.scored_after_fetch if self.scored_after_fetch else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Counters and derived figures as a plain dictionary."""
        out = asdict(self)
        for name in ("reuse_share", "mean_round_trip_us", "mean_reuse_us", "saved_ms", "mean_accepted_after_reuse",
                     "mean_accepted_after_fetch"):
            out[name] = getattr(self, name)
        return out


class Backoff:
    """Exponential backoff between attempts to reach the service; one warning when an outage starts and ends.

    Waits follow ``ExponentialBackoff(initial, maximum, jitter=0.2)``: each wait is 80-100 % of the doubled one, so
    clients that lost the service together do not all come back at once. Nothing here sleeps: callers ask ``ready``.
    """

    def __init__(self, address: str, initial: float = 0.1, maximum: float = 5.0) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError(f"need 0 < initial_backoff <= max_backoff, got {initial}, {maximum}")
        self.address = address
        self.clock = BackoffClock(ExponentialBackoff(initial, maximum, jitter=0.2))
        self.outages = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether an attempt may be made now."""
        return self.clock.ready()

    @property
    def down(self) -> bool:
        """Whether the last attempt failed."""
        return self.clock.failures > 0

    def failure(self, reason: str) -> None:
        """An attempt failed: wait longer before the next one."""
        with self._lock:
            first = self.clock.failures == 0
            wait = self.clock.failure()
            if first:
                self._since = time.monotonic()
                self.outages += 1
        if first:
            logger.warning("drafter service at %s unavailable (%s): decoding without drafts until it is back",
                           self.address, reason)
        else:
            logger.debug("drafter service at %s still unavailable (%s); next try in %.2f s", self.address, reason,
                         wait)

    def success(self) -> None:
        """An attempt succeeded: the outage, if any, is over."""
        if self.clock.failures:
            with self._lock:
                self.clock.reset()
            logger.warning("drafter service at %s reachable again after %.1f s", self.address,
                           time.monotonic() - self._since)


class IngestBuffer:
    """Completed requests the service could not take yet; bounded, the oldest dropped first with a warning."""

    def __init__(self, stats: ClientStats, capacity: int = 1000) -> None:
        if capacity < 0:
            raise ValueError(f"max_buffered must be >= 0, got {capacity}")
        self._stats = stats
        self._items: deque[pb.Sequence] = deque()
        self._capacity = capacity
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, seqs: Sequence[pb.Sequence], front: bool = False) -> None:
        """Keep requests for later (``front``: put back ones whose sending failed)."""
        with self._lock:
            if front:
                self._items.extendleft(reversed(seqs))
            else:
                self._items.extend(seqs)
                self._stats.buffered_requests += len(seqs)
            dropped = max(0, len(self._items) - self._capacity)
            for _ in range(dropped):
                self._items.popleft()
            self._stats.dropped_requests += dropped
        if dropped:
            logger.warning("drafter client: %d completed requests dropped (buffer of %d full while the service is "
                           "away)", dropped, self._capacity)

    def take(self, n: int = INGEST_BATCH) -> list[pb.Sequence]:
        """Remove and return up to ``n`` of the oldest requests."""
        with self._lock:
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def sent(self, batch: Sequence[pb.Sequence], stored: bool, details: str = "") -> None:
        """Count a batch the service stored, or refused (then it is dropped: retrying cannot help)."""
        with self._lock:
            if stored:
                self._stats.flushed_requests += len(batch)
            else:
                self._stats.dropped_requests += len(batch)
        if not stored:
            logger.warning("drafter service refused %d buffered requests (%s): dropped", len(batch), details)


def channel_options(max_backoff: float) -> list[tuple[str, int]]:
    """gRPC channel options: reconnect soon after the service is back; large messages."""
    return [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", max(100, int(1000 * max_backoff))),
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def rpc_code(exc: BaseException) -> tuple[str, str]:
    """(status code name, details) of a failed gRPC call; UNAVAILABLE for anything that is not one."""
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            found = code()
            return (getattr(found, "name", None) or "UNKNOWN"), (exc.details() or "")  # type: ignore[attr-defined]
        except Exception:
            pass
    return "UNAVAILABLE", repr(exc)


def stats_dict(reply: Any) -> dict[str, Any]:
    """A protobuf message (GetStatsResponse) as a plain dictionary."""
    return {f.name: list(getattr(reply, f.name)) if f.is_repeated else getattr(reply, f.name)
            for f in reply.DESCRIPTOR.fields}


def check_tokens(tokens: Sequence[int], vocab_size: int | None, what: str) -> list[int]:
    """``tokens`` as a list of ints; DrafterRequestError for negative or out-of-vocabulary ids."""
    try:
        out = list(map(int, tokens))
    except (TypeError, ValueError) as exc:
        raise DrafterRequestError(f"{what} must hold integer token ids: {exc}") from None
    if out and (min(out) < 0 or (vocab_size is not None and max(out) >= vocab_size)):
        _refuse_ids(out, vocab_size, what)
    return out


def check_token_lists(lists: Iterable[Sequence[int]], vocab_size: int | None, what: str) -> list[list[int]]:
    """``check_tokens`` for the lists of a batch at once (one range check over all of them)."""
    try:
        out = [list(map(int, tokens)) for tokens in lists]
    except (TypeError, ValueError) as exc:
        raise DrafterRequestError(f"{what} must hold integer token ids: {exc}") from None
    flat = list(itertools.chain.from_iterable(out))
    if flat and (min(flat) < 0 or (vocab_size is not None and max(flat) >= vocab_size)):
        _refuse_ids(flat, vocab_size, what)
    return out


def _refuse_ids(ids: list[int], vocab_size: int | None, what: str) -> NoReturn:
    bad = next(t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size))
    raise DrafterRequestError(f"{what} holds token id {bad}, outside [0, {vocab_size or 'vocab_size'})")


def to_sequences(requests: Iterable[Sequence[Any]], vocab_size: int | None) -> list[pb.Sequence]:
    """(prompt, output[, request_id]) tuples as validated Ingest sequences."""
    return [pb.Sequence(prompt=check_tokens(r[0], vocab_size, "prompt"),
                        output=check_tokens(r[1], vocab_size, "output"),
                        request_id=str(r[2]) if len(r) > 2 else "") for r in requests]
