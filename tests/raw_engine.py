"""Raw engines on loopback for the agent's engine client and its sessions.

Each engine is a TCP server written for a test, so it can do what a real engine only
does when broken: an endless head, a bad chunk size, a close in the middle, a head
dribbled a byte at a time.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial

import trio

Handler = Callable[["Conn"], Awaitable[None]]
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()


class Engine:
    """A raw engine on a loopback port: every connection runs `handler`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = trio.Event()  # a connection ended from the agent's side


class Conn:
    """One connection of an engine, as its handler sees it."""

    def __init__(self, stream: trio.SocketStream, engine: Engine) -> None:
        self.stream = stream
        self.engine = engine

    async def send_all(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive_some(self) -> bytes:
        return await self.stream.receive_some(65536)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def read_request(conn: Conn, buf: bytearray) -> bool:
    """One request (head and Content-Length body) off the connection; False at its end."""
    while b"\r\n\r\n" not in buf:
        data = await conn.receive_some()
        if not data:
            conn.engine.closed.set()
            return False
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end]).lower()
    length = 0
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(buf) < end + length:
        buf += await conn.receive_some()
    conn.engine.requests.append(bytes(buf[: end + length]))
    del buf[: end + length]
    return True


def json_answer(body: bytes = ANSWER, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (extra, len(body), body)
    )


def answering(*answers: bytes) -> Handler:
    """Answer each request on a connection with the next of `answers`, then wait."""

    async def handler(conn: Conn) -> None:
        buf = bytearray()
        for answer in answers:
            if not await read_request(conn, buf):
                return
            await conn.send_all(answer)
        await read_request(conn, buf)

    return handler


async def start_engine(nursery: trio.Nursery, handler: Handler) -> Engine:
    """An engine on a loopback port of its own, served in `nursery` (the `serve`
    fixture, tests/conftest.py)."""
    engine = Engine(0)

    async def counted(stream: trio.SocketStream) -> None:
        engine.connections += 1
        try:
            await handler(Conn(stream, engine))
        except trio.BrokenResourceError:
            engine.closed.set()

    serve_tcp = partial(trio.serve_tcp, host="127.0.0.1")
    listeners = await nursery.start(serve_tcp, counted, 0)
    engine.port = listeners[0].socket.getsockname()[1]
    return engine
