"""`python -m tests.egress_recorder PORT LOG`: the refusing proxy of
tests/client_fleet.py (`EgressRecorder`).

Each connection's first line (`CONNECT registry.npmjs.org:443 HTTP/1.1`, or a plain
proxy request) is appended to LOG and answered with a 403, so a client that tries to
reach the internet is seen doing so and fails at once. Its own process: the test's
clients run while the test waits on them.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import trio

# A request line is short; more is not read.
MAX_LINE = 4096
REFUSAL = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


async def _record(stream: trio.SocketStream, log: Path) -> None:
    data = b""
    with trio.move_on_after(5):
        while b"\r\n" not in data and len(data) < MAX_LINE:
            chunk = await stream.receive_some(MAX_LINE)
            if not chunk:
                break
            data += chunk
    line = data.split(b"\r\n", 1)[0].decode("latin-1")[:200]
    async with await trio.open_file(log, "a") as out:
        await out.write(line + "\n")
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.send_all(REFUSAL)
    await stream.aclose()


async def main(port: int, log: Path) -> None:
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    await trio.Path(log).write_text("listening\n")

    async def handle(stream: trio.SocketStream) -> None:
        await _record(stream, log)

    await trio.serve_listeners(handle, listeners)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), Path(sys.argv[2]))
