"""The event-loop server's runner: a server that cannot listen is stopped, and so is the loop."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from drafter_service.rpc.loop_server import LoopServer


def loop_threads() -> int:
    return sum(t.name == "grpc-loop" and t.is_alive() for t in threading.enumerate())


def test_a_server_that_cannot_listen_is_stopped_before_the_error_is_raised() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = loop_threads()
        runner = LoopServer(2)
        made: list[grpc.aio.Server] = []
        stopped: list[float | None] = []

        def build() -> grpc.aio.Server:
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            real_stop = server.stop

            async def stop(grace: float | None) -> None:
                stopped.append(grace)
                await real_stop(grace)
            server.stop = stop
            made.append(server)
            return server

        def listen(server: grpc.aio.Server) -> None:
            if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
                raise OSError("cannot listen")

        with pytest.raises((OSError, RuntimeError)):
            runner.start(build, listen)
        assert len(made) == 1 and stopped == [None]
        assert runner.server is None
        assert runner.stop(None).wait(10)
        assert loop_threads() == before
