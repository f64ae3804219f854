"""The router's HTTP server alone: CPU per request over an in-memory stream, no sockets.

    python -m bench.http_server [--requests 3000] [--repeat 5]

One keep-alive connection carries `--requests` chat requests (a 138-byte body) to an
ASGI app that answers at once, whole (Content-Length) or as 18 chunks like a 16-token
stream. The figure is process CPU seconds per request, client side included, the best
of `--repeat` runs: no other process takes part, so it holds on a loaded host where
`bench.overhead` cannot separate a 10% change from the noise. Run it from each
checkout to compare two builds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable

import trio
import trio.testing

from router.http.server import HttpServer

Send = Callable[[dict], Awaitable[None]]
BODY = b'{"model":"bench-model","messages":[{"role":"user","content":"' + b"w" * 80 + b'"}]}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    b"content-type: application/json\r\nauthorization: Bearer bench\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
ANSWER = b'{"id":"chatcmpl-1","choices":[{"message":{"content":"' + b"t" * 160 + b'"}}]}'
EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"0" * 36)]


async def whole(scope: dict, receive: Callable[[], Awaitable[dict]], send: Send) -> None:
    await receive()
    headers = [*HEADERS, (b"content-length", b"%d" % len(ANSWER))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


async def streamed(scope: dict, receive: Callable[[], Awaitable[dict]], send: Send) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    for _ in range(17):
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def serve(app: Callable, end: bytes, requests: int) -> float:
    client, server_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(HttpServer(app, keep_alive_timeout=60).run_connection, server_side)
        began = time.process_time()
        for _ in range(requests):
            await client.send_all(REQUEST)
            received = b""
            while not received.endswith(end):
                received += await client.receive_some(65536)
        spent = time.process_time() - began
        await client.aclose()
    return spent / requests


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for name, app, end in (("whole", whole, b'"}}]}'), ("streamed", streamed, b"0\r\n\r\n")):
        best = min(trio.run(serve, app, end, args.requests) for _ in range(args.repeat))
        print(f"{name}: {best * 1e6:.1f} us of CPU per request")


if __name__ == "__main__":
    main()
