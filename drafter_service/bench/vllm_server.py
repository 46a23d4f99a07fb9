"""vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``, vLLM's venv) as users start it."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from drafter_service.bench.vllm_engine import COUNTERS, speculative_config
from drafter_service.bench.vllm_process import vllm_python


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> each sample name's value summed over its label sets.

    Counters keep their ``_total`` suffix (``vllm:generation_tokens_total``).
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class VllmApiServer:
    """``python -m vllm.entrypoints.openai.api_server`` in a child process of its own group, on a free port.

    The model is served with ``--skip-tokenizer-init`` (token ids in and out), float32 and eager mode, the
    command docs/vllm.md shows. ``method`` ``drafter`` adds the proposer's ``--speculative-config``.

    Args:
        model: folder of the target model.
        method: none, ngram, suffix or drafter (``vllm_engine.speculative_config``).
        k: speculative tokens per step.
        env: extra environment (DRAFTER_ADDRESS and the proposer's settings for ``drafter``).
        log_path: file that receives the server's output (stdout and stderr).
        max_model_len: vLLM's ``--max-model-len``.
        python: vLLM's interpreter (default ``vllm_process.vllm_python()``).
        extra_args: more command-line arguments for the server.
    """

    def __init__(self, model: str | os.PathLike[str], method: str, log_path: str | os.PathLike[str], k: int = 4,
                 env: Mapping[str, str] | None = None, max_model_len: int = 2048,
                 python: str | os.PathLike[str] | None = None, extra_args: Sequence[str] = ()) -> None:
        self.model, self.method = str(model), method
        self.log_path = pathlib.Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = pathlib.Path(python) if python else vllm_python()
        if not exe.exists():
            raise FileNotFoundError(f"{exe} not found: run `make vllm` (or set DRAFTER_VLLM_PYTHON)")
        self.cmd = [str(exe), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                    "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
                    "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(self.port),
                    *extra_args]
        spec = speculative_config(method, k)
        if spec is not None:
            self.cmd += ["--speculative-config", json.dumps(spec)]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds = 0.0

    def start(self, timeout: float = 600.0) -> float:
        """Start the server and wait until ``/health`` answers 200; returns the seconds it took.

        Raises:
            RuntimeError: the server exited first (with the tail of its log).
            TimeoutError: not healthy within ``timeout`` (the server is stopped; the message has its log's tail).
        """
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"vLLM's server ({self.method}) exited with {code} before it was healthy:\n"
                                   f"{self.log_tail()}")
            if self._healthy():
                self.startup_seconds = time.monotonic() - t0
                return self.startup_seconds
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise TimeoutError(f"vLLM's server ({self.method}) not healthy within {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                answer: dict[str, Any] = json.loads(reply.read())
                return answer
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path} answered {exc.code}: {exc.read()[:2000]!r}") from None

    def complete(self, prompts: Sequence[Sequence[int]], max_tokens: int, timeout: float = 300.0,
                 **params: Any) -> list[list[int]]:
        """Greedy completions of token-id ``prompts`` in one ``/v1/completions`` request.

        Args:
            prompts: token ids of each prompt (one request with several prompts: vLLM runs them together).
            max_tokens: tokens generated per prompt at most.
            timeout: seconds the request may take.
            params: more fields of the request (vLLM's sampling parameters).

        Returns:
            The generated token ids of each prompt, in prompt order.
        """
        body = {"model": self.model, "prompt": [list(map(int, p)) for p in prompts], "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, **params}
        answer = self._post("/v1/completions", body, timeout)
        choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
        return [[int(t) for t in c["token_ids"]] for c in choices]

    def metrics(self, timeout: float = 30.0) -> dict[str, float]:
        """vLLM's ``/metrics``: every sample name's value, summed over label sets."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout) as reply:
            return parse_metrics(reply.read().decode())

    def counters(self, timeout: float = 30.0) -> dict[str, float]:
        """vLLM's cumulative counters named as ``Generation.counters`` (``vllm_engine.COUNTERS``)."""
        samples = self.metrics(timeout)
        return {name: samples.get(f"{name}_total", 0.0) for name in COUNTERS}

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL to what is left of the server's process group once the
        server and its engine processes have exited, or after ``timeout``. An engine killed while it shuts down
        leaves its shared memory (``/dev/shm/psm_*``, hundreds of MB) behind: the group gets the whole ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        deadline = time.monotonic() + timeout
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        while _group_alive(proc.pid) and time.monotonic() < deadline:  # the engine core and workers finish
            time.sleep(0.2)
        try:  # the engine core and workers are in the server's group: none outlives it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def __enter__(self) -> VllmApiServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
