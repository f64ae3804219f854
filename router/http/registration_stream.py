"""`GET /admin/registration-stream`: the registration feed as Server-Sent Events.

Each event is one `data:` line of JSON, as upstream's router writes it, so its
consumers read this one unchanged. A follower that stops reading only ever holds up
its own connection: the feed drops it once its buffer is full, and a write that a
client leaves waiting WRITE_TIMEOUT ends the response.
"""

from __future__ import annotations

import json

import trio

from protocol.errors import ErrorCode, RouterError, error_payload
from router.http.asgi import Receive, Send, send_json, start_response
from router.registrations import KEEPALIVE_SECONDS, RegistrationFeed, TooManySubscribers

# A follower that accepts no bytes for this long is not following any more.
WRITE_TIMEOUT = 10.0
_KEEPALIVE = b": keepalive\n\n"
_DROPPED = (
    b"data: "
    + json.dumps(
        {
            "event_type": "subscriber_dropped",
            "reason": "this subscriber fell behind; resynchronise from /admin/routing-table",
        },
        separators=(",", ":"),
    ).encode()
    + b"\n\n"
)


async def registration_stream(
    feed: RegistrationFeed, receive: Receive, send: Send, extra: list[tuple[str, str]]
) -> int:
    try:
        sub = feed.subscribe()
    except TooManySubscribers as exc:
        err = RouterError(ErrorCode.NO_CAPACITY, str(exc))
        await send_json(send, 503, error_payload("openai", err), extra)
        return 503
    try:
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *extra]
        await start_response(send, 200, headers)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_gone, receive, nursery.cancel_scope)
            await _relay(sub.receive, send)
            nursery.cancel_scope.cancel()
    finally:
        feed.unsubscribe(sub)
    return 200


async def _relay(events: trio.MemoryReceiveChannel, send: Send) -> None:
    while True:
        event = None
        with trio.move_on_after(KEEPALIVE_SECONDS):
            try:
                event = await events.receive()
            except trio.EndOfChannel:
                break
        # The keepalive's deadline bounds the wait only: a write it cut short would lose
        # the event and leave half a frame on the wire.
        data = _KEEPALIVE if event is None else event.sse()
        if not await _write(send, data, more=True):
            return
    await _write(send, _DROPPED, more=False)


async def _write(send: Send, data: bytes, more: bool) -> bool:
    """False when the client left this write waiting WRITE_TIMEOUT."""
    with trio.move_on_after(WRITE_TIMEOUT):
        await send({"type": "http.response.body", "body": data, "more_body": more})
        return True
    return False


async def _until_gone(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
