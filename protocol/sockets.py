"""A plain TCP connection's reads and writes, without trio's extra passes.

trio's `SocketStream` tries each read before waiting for data, which on a connection
that mostly waits (a client between requests, an engine between tokens, the link
between frames) is a system call that finds nothing, and it passes through the
scheduler after every read that found data and every write that went out whole: one
task step more on the critical path of each request and answer. The router's HTTP
server, the agent's engine client and the link (protocol/p2p.py) read and write their
sockets through these instead, and through trio only when the kernel has no room.
"""

from __future__ import annotations

import select
import socket
from typing import Any

import trio


def stdlib_socket(stream: object) -> socket.socket | None:
    """The stdlib socket under a plain trio TCP stream; None for any other stream (TLS,
    a memory stream, a test's)."""
    if not isinstance(stream, trio.SocketStream):
        return None
    return getattr(stream.socket, "_sock", None)


async def receive_when_ready(raw: socket.socket, size: int) -> bytes:
    """Wait until `raw` has data (or its end), then read it: one system call per read.

    OSError as the socket raises it; trio's ClosedResourceError when it is closed here
    while waiting."""
    while True:
        await trio.lowlevel.wait_readable(raw)
        try:
            return raw.recv(size)
        except BlockingIOError:
            continue


def send_at_once(raw: socket.socket, data: bytes | memoryview) -> int:
    """What the kernel takes of `data` now, without waiting: the bytes sent, 0 when it
    has no room. OSError as the socket raises it."""
    try:
        return raw.send(data)
    except BlockingIOError:
        return 0


def readable_now(sock: Any) -> bool:
    """`sock` (anything with a `fileno()`) has something to read, or its end, now: one
    poll, no read. poll, not select: a daemon with a thousand sessions has descriptors
    past select's limit of 1,024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
