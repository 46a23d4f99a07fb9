"""A ``grpc.aio`` server on an event loop of its own thread, driven from synchronous code.

Why: in grpcio's thread-pool server a unary call needs the interpreter lock in its poll thread and again in a pool
thread, and each of those wake-ups waits its turn while an ``Ingest`` keeps the lock busy. On the event loop a
drafting call is received, run and answered by one thread. Handlers that may block (storing requests, Redis, uploads)
are plain functions, which the aio server runs in its thread pool as the thread-pool server did.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent import futures

import grpc


class LoopServer:
    """Owns the event loop thread, the thread pool for blocking handlers and the ``grpc.aio.Server`` on them.

    ``stop(grace)`` answers like ``grpc.Server.stop``: an event set once every call has ended and the loop has stopped.
    """

    def __init__(self, workers: int) -> None:
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="grpc-loop", daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server | None = None
        self._stopped = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self, build: Callable[[], grpc.aio.Server], listen: Callable[[grpc.aio.Server], None]) -> None:
        """Build the server on the loop (``build`` runs there, as ``grpc.aio.server`` requires), let ``listen`` add
        its ports, and start it.

        Raises:
            whatever ``build``, ``listen`` or the start raise; a server ``listen`` failed on is stopped, and the loop
            is stopped then.
        """
        async def start() -> None:
            server = build()
            try:
                listen(server)
            except BaseException:
                await server.stop(None)
                raise
            self.server = server
            await server.start()
        try:
            asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        except BaseException:
            with self._lock:
                self._stopping = True  # a later stop() answers the event set here
            self._close()
            raise

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls, give running ones ``grace`` seconds, then stop the loop and the pool; safe twice."""
        with self._lock:
            if self._stopping:
                return self._stopped
            self._stopping = True
        server = self.server
        if server is None:
            self._close()
            return self._stopped
        future = asyncio.run_coroutine_threadsafe(server.stop(grace), self.loop)
        # the callback runs on the loop's thread, which _close joins: it closes from a thread of its own
        future.add_done_callback(lambda _: threading.Thread(target=self._close, daemon=True).start())
        return self._stopped

    def _close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
