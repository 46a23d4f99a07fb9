"""Whether a namespace's draft model pays on this machine, measured while the service drafts.

A draft model adds acceptance and costs compute. Where it shares a CPU with the engine, the compute it takes makes
every engine step slower; where its nodes are worse than the model-free ones they displace, it lowers acceptance.
Neither can be known before it runs, so the gate measures both and serves the model's nodes only while their
product pays:

- **Acceptance.** Every step scores two trees against the tokens the target confirmed: the model-free tree and the
  tree with the model's nodes merged in. One was served, the other is a shadow; the number of confirmed tokens
  each holds as one branch is its figure. (The served tree's outcome ends at the target's own token, so a shadow
  that holds all of it might have done better still: the figure is a lower bound for the shadow.)
- **Step time.** The interval between a session's consecutive steps, while the model's worker runs against while
  it is paused, in alternating phases: whatever slows the engine down while the model runs (CPU contention, the
  interpreter lock, memory bandwidth) shows in it, whatever its cause.

The model pays while ``(1 + model tokens) / (1 + model-free tokens) * min(1, paused interval / running interval)``
exceeds ``1 + margin`` (tokens: confirmed tokens per step, so the ratio is tokens per second). Until enough steps of
each kind were seen it does not serve; acceptance alone decides sooner when it shows no gain, since time can only
lower the ratio. Once it pays the worker pauses for short measuring phases only; once it does not, the worker runs
for short probes only, further apart while the verdict stands. With ``count_time`` False (the
model has compute of its own, or a replay in which time does not count) the worker always runs and acceptance
alone decides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["GateFigures", "ModelGate"]


@dataclass(frozen=True)
class GateFigures:
    """What the gate measured (decayed means) and decided.

    Attributes:
        serving: whether the model's nodes are served now.
        running: whether the model's worker runs now.
        verdict: "learning", "pays" or "does not pay".
        model_tokens, free_tokens: confirmed tokens per step held by the tree with the model's nodes and by the
            model-free tree.
        running_interval_ms, paused_interval_ms: mean interval between a session's steps while the worker runs
            and while it is paused (0 while unmeasured).
        empty_share: share of steps at which the model's cache had nothing to add (it could not keep up).
        ratio: the estimated tokens-per-second ratio of drafting with the model against without it.
    """

    serving: bool
    running: bool
    verdict: str
    model_tokens: float
    free_tokens: float
    running_interval_ms: float
    paused_interval_ms: float
    empty_share: float
    ratio: float


class _Mean:
    """A mean over recent samples (each sample's weight decays by ``1 - 1/memory`` per later sample)."""

    def __init__(self, memory: float) -> None:
        self.keep = 1.0 - 1.0 / memory
        self.total = 0.0
        self.weight = 0.0
        self.count = 0

    def add(self, x: float) -> None:
        self.total = self.total * self.keep + x
        self.weight = self.weight * self.keep + 1.0
        self.count += 1

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight else 0.0


class ModelGate:
    """Decides, from measured acceptance and step times, whether the draft model's nodes are served and whether its
    worker runs (see the module docstring).

    Args:
        count_time: weigh the step time (False: acceptance alone; the worker always runs).
        phase: seconds of one running or paused phase while learning, and of a probe or a measuring pause later.
        min_steps: steps of each kind (shadow-scored, running, paused) before a verdict.
        margin: the ratio must exceed ``1 + margin`` for the model to be served.
        probe_gap: seconds between probes while the model does not pay, doubling up to ``max_probe_gap``.
        max_learning: seconds of learning after which a model still unmeasured does not pay (the engine asked for
            too few drafts for it to matter).
        memory: samples over which the means decay.
        clock: monotonic seconds.
        on_running: called with the new worker state whenever it changes (from the thread that recorded a step).
        name: the namespace, for the log.
    """

    def __init__(self, count_time: bool = True, phase: float = 0.5, min_steps: int = 48, margin: float = 0.03,
                 probe_gap: float = 20.0, max_probe_gap: float = 300.0, max_learning: float = 60.0,
                 memory: float = 400.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_running: Callable[[bool], None] | None = None, name: str = "") -> None:
        self.count_time, self.phase, self.min_steps, self.margin = count_time, phase, min_steps, margin
        self.first_probe_gap, self.max_probe_gap = probe_gap, max_probe_gap
        self._learn_until = clock() + max_learning
        self.clock, self.on_running, self.name = clock, on_running, name
        self._lock = threading.Lock()
        self._model = _Mean(memory)
        self._free = _Mean(memory)
        self._empty = _Mean(memory)
        self._intervals = {True: _Mean(memory), False: _Mean(memory)}  # worker running -> step interval
        self.verdict = "learning"
        self.serving = False
        self.running = True
        self.phase_id = 0  # counts phase changes: an interval spanning one is not a phase's own
        self._phase_end = clock() + phase
        self._probe_gap = probe_gap

    # -- measurements ------------------------------------------------------------------------------------

    def record(self, model_tokens: int, free_tokens: int, model_empty: bool) -> None:
        """One step's shadow score: confirmed tokens held by the tree with the model's nodes and by the model-free
        tree, and whether the model had nothing to add. Only steps drafted while the worker ran count."""
        with self._lock:
            self._model.add(model_tokens)
            self._free.add(free_tokens)
            self._empty.add(1.0 if model_empty else 0.0)

    def record_interval(self, seconds: float, running: bool, phase_id: int) -> None:
        """The time since the session's previous step, both steps in the phase ``phase_id`` whose worker state
        was ``running``."""
        if not self.count_time or phase_id != self.phase_id:
            return
        with self._lock:
            self._intervals[running].add(seconds)

    # -- decisions ---------------------------------------------------------------------------------------

    def ratio(self) -> float:
        """Estimated tokens per second with the model's nodes over without them (1.0 while unmeasured)."""
        gain = self._gain()
        if not self.count_time:
            return gain
        run, paused = self._intervals[True].value, self._intervals[False].value
        # The model cannot make a step faster: a running phase measured faster is noise, not a gain.
        return gain * min(1.0, paused / run) if run and paused else gain

    def _measured(self) -> bool:
        if self._model.count < self.min_steps:
            return False
        if not self.count_time or self._gain() <= 1.0 + self.margin:
            return True  # time can only lower the ratio: acceptance alone says it does not pay
        return min(m.count for m in self._intervals.values()) >= self.min_steps

    def _gain(self) -> float:
        return (1.0 + self._model.value) / (1.0 + self._free.value)

    def tick(self) -> None:
        """Advance the phase schedule and revise the verdict; call on every step (cheap between phase ends)."""
        now = self.clock()
        if now < self._phase_end:
            return
        with self._lock:
            if now < self._phase_end:
                return
            before = self.verdict
            if self._measured():
                self.verdict = "pays" if self.ratio() > 1.0 + self.margin else "does not pay"
            elif self.verdict == "learning" and now >= self._learn_until:
                self.verdict = "does not pay"  # too few drafted steps to measure: the model cannot matter much
            if self.verdict != before:
                self._probe_gap = self.first_probe_gap
                self._announce(before)
            running = self._next_running()
            self.serving = self.verdict == "pays"
            self._phase_end = now + self._phase_length(running)
            changed = running != self.running
            self.running = running
            self.phase_id += 1
        if changed and self.on_running is not None:
            self.on_running(running)

    def _next_running(self) -> bool:
        # Phases alternate; their lengths (``_phase_length``) follow the verdict.
        return not self.count_time or not self.running

    def _phase_length(self, running: bool) -> float:
        if not self.count_time or self.verdict == "learning":
            return self.phase
        if self.verdict == "pays":
            return 9 * self.phase if running else self.phase
        if running:
            return self.phase
        gap = self._probe_gap
        self._probe_gap = min(self.max_probe_gap, 2 * gap)
        return gap

    def _announce(self, before: str) -> None:
        f = self._figures()
        where = f"namespace {self.name}: " if self.name else ""
        detail = (f"confirmed tokens per step {f.model_tokens:.2f} with its nodes against {f.free_tokens:.2f} "
                  f"without")
        if self.count_time and f.running_interval_ms and f.paused_interval_ms:
            detail += (f"; steps take {f.running_interval_ms:.1f} ms while it runs against "
                       f"{f.paused_interval_ms:.1f} ms while it is paused")
        if self._model.count < self.min_steps:
            detail += f"; only {self._model.count} drafted steps to score it on"
        if f.empty_share > 0.5:
            detail += f"; it could not keep up: nothing to add at {100 * f.empty_share:.0f}% of steps"
        if self.verdict == "does not pay":
            logger.warning("%sthe draft model does not pay on this machine (%s; %.2fx): drafting without it, "
                           "probing again now and then", where, detail, f.ratio)
        elif before != "learning":
            logger.warning("%sthe draft model pays again (%s; %.2fx): its nodes are served", where, detail, f.ratio)
        else:
            logger.info("%sthe draft model pays (%s; %.2fx): its nodes are served", where, detail, f.ratio)

    def _figures(self) -> GateFigures:
        return GateFigures(self.serving, self.running, self.verdict, self._model.value, self._free.value,
                           1e3 * self._intervals[True].value, 1e3 * self._intervals[False].value,
                           self._empty.value, self.ratio())

    def figures(self) -> GateFigures:
        """What the gate measured and decided, now."""
        with self._lock:
            return self._figures()
