"""CPU per small socket write: trio's `send_all` against the stdlib socket first, as
router/http/server.py `_Connection._write` writes to clients.

    python -m bench.socket_io [--count 20000] [--rounds 7]

300-byte writes (a few SSE events) to a loopback TCP peer in another process that
reads as fast as it can, each write followed by one pass through trio's scheduler, as
the relay's wait for the agent's next frame makes. The two ways run in turn, round
after round; printed: the median over rounds of this process's CPU per write.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import trio

MESSAGE = b"x" * 300


async def write_many(port: int, count: int, raw_path: bool) -> float:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    raw = stream.socket._sock  # type: ignore[attr-defined]
    started = time.process_time()
    for _ in range(count):
        if raw_path:
            # What `_Connection._write` does.
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                sent = raw.send(MESSAGE)
            except BlockingIOError:
                sent = 0
            if sent != len(MESSAGE):
                await stream.send_all(MESSAGE[sent:])
        else:
            await stream.send_all(MESSAGE)
        await trio.lowlevel.checkpoint()
    spent = time.process_time() - started
    await stream.aclose()
    return spent / count


def drain(listener: socket.socket) -> None:
    """The other process: reads each connection to its end."""
    while True:
        conn, _ = listener.accept()
        while conn.recv(65536):
            pass
        conn.close()


def measure(count: int, rounds: int) -> dict[str, float]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    child = os.fork()
    if child == 0:
        try:
            drain(listener)
        finally:
            os._exit(0)
    listener.close()
    spent: dict[str, list[float]] = {"trio": [], "stdlib socket first": []}
    try:
        for round_ in range(rounds):
            for raw_path in (False, True) if round_ % 2 == 0 else (True, False):
                name = "stdlib socket first" if raw_path else "trio"
                spent[name].append(trio.run(write_many, port, count, raw_path))
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
    return {name: statistics.median(values) * 1e6 for name, values in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    result = measure(args.count, args.rounds)
    for name, micros in result.items():
        print(f"{name}: {micros:.1f} µs CPU per 300-byte write")


if __name__ == "__main__":
    main()
