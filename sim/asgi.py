"""ASGI plumbing shared by every look-alike API: one response, the request body, JSON."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Receive, Send], Awaitable[None]]

JSON_TYPE = b"application/json"
TEXT_TYPE = b"text/plain; charset=utf-8"
HTML_TYPE = b"text/html; charset=utf-8"
SSE_TYPE = b"text/event-stream; charset=utf-8"
SSE_HEADERS = [(b"content-type", SSE_TYPE), (b"cache-control", b"no-cache")]
SSE_DONE = b"data: [DONE]\n\n"


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    """A named server-sent event, as Anthropic's API sends them."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class Exchange:
    """One response; `done` is set before the last body message is handed over.

    Hypercorn reports `http.disconnect` while that last message is being sent; the flag
    tells the watcher that the client got the whole answer and did not leave early.
    """

    __slots__ = ("_send", "done")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.done = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes) -> None:
        self.done = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def reply(self, status: int, body: bytes, content_type: bytes = JSON_TYPE) -> None:
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        await self.start(status, headers)
        await self.finish(body)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client left before sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
