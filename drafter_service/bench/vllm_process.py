"""A vLLM engine process (``vllm_engine`` in vLLM's venv) seen from this one: start it, generate, stop it."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from drafter_service.bench.vllm_engine import RESULT

#: vLLM's venv made by ``make vllm`` in a checkout of the project.
DEFAULT_VLLM_PYTHON = pathlib.Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_python() -> pathlib.Path:
    """The interpreter of vLLM's venv: DRAFTER_VLLM_PYTHON, else ``.venv-vllm`` of this checkout."""
    return pathlib.Path(os.environ.get("DRAFTER_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)


@dataclass
class Generation:
    """One ``generate`` answer: outputs in prompt order, its seconds, and vLLM's cumulative counters."""

    outputs: list[list[int]]
    seconds: float
    counters: dict[str, float]


class VllmEngineProcess:
    """A vLLM ``LLM`` in a child process, driven over stdin/stdout (see ``vllm_engine``).

    Args:
        model: folder of the target model.
        method: none, ngram, suffix or drafter.
        k: speculative tokens per step.
        env: extra environment (DRAFTER_ADDRESS and the proposer's settings for ``drafter``).
        log: where the engine's own output goes (a file; None: discarded).
        start_timeout: seconds to wait for the engine to be ready.
        one_process: vLLM's engine core and model runner in the child process itself, not in two more processes
            of their own (vLLM's default, as deployed): half the start-up time on a 2-core machine.
    """

    def __init__(self, model: str | os.PathLike[str], method: str, k: int = 4, env: Mapping[str, str] | None = None,
                 log: TextIO | None = None, start_timeout: float = 600.0, max_model_len: int = 2048,
                 python: str | os.PathLike[str] | None = None, one_process: bool = False) -> None:
        exe = pathlib.Path(python) if python else vllm_python()
        if not exe.exists():
            raise FileNotFoundError(f"{exe} not found: run `make vllm` (or set DRAFTER_VLLM_PYTHON)")
        self.method, self.log = method, log
        cmd = [str(exe), "-m", "drafter_service.bench.vllm_engine", "--model", str(model), "--method", method,
               "--k", str(k), "--max-model-len", str(max_model_len)] + (["--one-process"] if one_process else [])
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env, bufsize=1)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self._next(start_timeout)
        self.startup_seconds = float(ready.get("seconds", 0.0))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                self._answers.put(json.loads(line[len(RESULT):]))
            elif self.log is not None:
                self.log.write(line)
        self._answers.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise TimeoutError(f"vLLM ({self.method}) gave no answer within {timeout:.0f} s") from None
        if answer is None:
            raise RuntimeError(f"vLLM ({self.method}) exited with {self.proc.wait()} (its log has the reason)")
        if "error" in answer:
            raise RuntimeError(f"vLLM ({self.method}): {answer['error']}")
        return answer

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int], timeout: float = 1800.0,
                 ignore_eos: bool = False) -> Generation:
        """Greedy outputs of ``prompts`` (one batch), with the time and vLLM's counters after it; ``max_tokens``:
        one limit for all, or one per prompt."""
        limits = max_tokens if isinstance(max_tokens, int) else [int(n) for n in max_tokens]
        self._send({"op": "generate", "prompts": [list(map(int, p)) for p in prompts], "max_tokens": limits,
                    "ignore_eos": ignore_eos})
        answer = self._next(timeout)
        return Generation(answer["outputs"], float(answer["seconds"]), answer["counters"])

    def _send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 60.0) -> None:
        """Ask the engine to quit; kill it when it does not within ``timeout``."""
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VllmEngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(condition: Any, timeout: float, what: str, poll: float = 0.2) -> None:
    """Poll ``condition()`` until it is true; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(poll)


