"""A prefill replica's KV-listener check before SERVING (``services.replica.readiness``), on
real sockets: it waits for a listener that comes up late, and gives up on one that never
does, naming it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.replica.readiness import NotReady, wait_listening
from tests.replica_process import free_port


def test_waits_until_the_listener_answers() -> None:
    port = free_port()

    async def run() -> float:
        server: list[socket.socket] = []

        def listen() -> None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            server.append(sock)

        asyncio.get_running_loop().call_later(0.5, listen)
        try:
            return await wait_listening("127.0.0.1", port, timeout_s=10)
        finally:
            for sock in server:
                sock.close()

    assert asyncio.run(run()) >= 0.4


def test_a_listener_that_never_answers_is_not_ready() -> None:
    port = free_port()
    with pytest.raises(NotReady, match=f"127.0.0.1:{port} does not accept connections"):
        asyncio.run(wait_listening("127.0.0.1", port, timeout_s=0.5))
