"""A bare byte relay on trio: what one Python process in a request's path costs when
it does nothing but pass bytes on.

    python -m bench.relay LISTEN_PORT TARGET_PORT

Each client connection gets its own connection to TARGET_PORT; bytes go both ways as
they arrive. `python -m bench.peers --peers trio-relays` chains two, engine <- relay <-
relay <- client, as hivenet chains agent and router: its added latency is the floor
under any two Python processes in series, before either parses or routes anything.
"""

from __future__ import annotations

import contextlib
import sys

import trio


async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    while data := await source.receive_some(65536):
        await sink.send_all(data)
    await sink.send_eof()


async def relay(client: trio.SocketStream, target: int) -> None:
    upstream = await trio.open_tcp_stream("127.0.0.1", target)
    async with client, upstream, trio.open_nursery() as nursery:
        nursery.start_soon(pump, client, upstream)
        nursery.start_soon(pump, upstream, client)


async def main(listen: int, target: int) -> None:
    async def handler(client: trio.SocketStream) -> None:
        # One side left; the other goes with it.
        with contextlib.suppress(trio.BrokenResourceError, OSError):
            await relay(client, target)

    await trio.serve_tcp(handler, listen, host="127.0.0.1")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
