"""Small ASGI helpers: reading bounded bodies, sending JSON, request ids."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
OnDisconnect = Callable[[Callable[[], None]], None]

# The request's root span in its ASGI scope (only with tracing on), for the handlers.
SPAN = "hivenet.span"
# A scope extension of router/http/server.py: `on_disconnect(callback)` has the server
# call `callback` when the client leaves while the request is answered, so that the app
# needs no task waiting in receive() for `http.disconnect`.
ON_DISCONNECT = "hivenet.on_disconnect"
# Another: `body_ready()` is True when the whole request body has arrived, so that
# reading it cannot wait and needs no deadline (a cancel scope with one costs about
# 5 µs, 2% of a whole answer's router CPU).
BODY_READY = "hivenet.body_ready"
# Another: the connection's own cancel scope, for the app's answer to run in instead of
# one of its own, which cost a tenth of the router's CPU per whole answer at 64 clients
# (`python -m bench.stream_relay --whole`): `limit(deadline)` ends the answer at its
# deadline (within a quarter of the server's `answer_timeout`), `lift()` once it is
# over in time, `end()` ends it now. Either ending cancels the connection's scope for
# good: the app may catch that Cancelled where it answers, must shield what it still
# awaits, and the connection closes after the request. `part_writer()`, once a stream's
# head is sent, gives a function that writes the stream's next part at once from any
# task (True: done; False: the kernel took part of it, and the app must write next),
# so that a part need not wake the app's task (router/continuation_relay.py).
ANSWER_SCOPE = "hivenet.answer_scope"
# A key of router/http/server.py's `http.response.start` messages: True when the app
# sends the first part of a streamed body at once, so that the head waits for it and
# both leave in one write (as a head with a Content-Length always does): one system
# call, and one wake of the client, less per stream.
HOLD_HEAD = "hivenet.hold_head"


class AnswerScope(Protocol):
    def limit(self, deadline: float) -> None: ...

    def lift(self) -> None: ...

    def end(self) -> None: ...

    def part_writer(self) -> Callable[[bytes], bool] | None: ...


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The request ended before its body did: the client left, or the server refused the
    body and has answered for the app (`status` then says what the client got)."""

    def __init__(self, status: int = 499) -> None:
        super().__init__(status)
        self.status = status


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


# The spellings of a UUID that upstream's router (Go's uuid.Parse) accepts, and keeps
# as sent: the usual 8-4-4-4-12 form, in braces, as a `urn:uuid:`, or 32 bare digits.
_UUID_SPELLINGS = re.compile(
    r"(?:\{|(?i:urn:uuid:))?[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}\}?"
    r"|[0-9a-fA-F]{32}"
)


class RequestIds:
    """New request IDs: random (version 4) UUIDs in the usual form, from the OS's random
    source 256 at a time. `str(uuid.uuid4())` makes a system call and a UUID object for
    each: 2.0 against 0.7 µs here."""

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def new(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(16 * 256), 0
        self._at = at + 16
        raw = bytearray(self._pool[at : at + 16])
        raw[6] = raw[6] & 0x0F | 0x40  # version 4
        raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
        h = raw.hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def request_id(scope: Scope, ids: RequestIds) -> str:
    """The client's X-Request-ID when it is a valid UUID, kept as sent (so the client's
    own string finds the router's log lines), otherwise a new one. Valid: what
    upstream's router accepts, the usual form, `{…}`, `urn:uuid:…` or 32 hex digits."""
    return kept_request_id(header(scope, b"x-request-id")) or ids.new()


def kept_request_id(given: str | None) -> str | None:
    """A client's X-Request-ID value as the router keeps it (stripped), or None when it
    is missing or not a UUID (the router then makes one)."""
    if given:
        given = given.strip()
        if is_request_id(given):
            return given
    return None


def is_request_id(text: str) -> bool:
    """Whether a client's X-Request-ID (stripped) is a UUID the router keeps."""
    return _UUID_SPELLINGS.fullmatch(text) is not None and (text[0] == "{") == (text[-1] == "}")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; BodyTooLarge past `limit` (declared or sent), ClientGone
    when the client leaves first."""
    declared = (header(scope, b"content-length") or "").strip()
    # isdigit() alone also accepts digits int() refuses, such as "²".
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone(message.get("status", 499))
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def encode_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    headers = list(headers)
    try:
        # Nearly every head is Latin-1 whole: one comprehension, no call per name and
        # value (two calls each cost a whole answer's head about 2 µs).
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    except UnicodeEncodeError:
        return [(_header_bytes(k), _header_bytes(v)) for k, v in headers]


def _header_bytes(text: str) -> bytes:
    # An engine's UTF-8 header value reaches us decoded as UTF-8 (httpx): send it back
    # as the engine did, rather than failing the answer on it.
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


async def start_response(
    send: Send, status: int, headers: Iterable[tuple[str, str]], hold: bool = False
) -> None:
    """`hold`: the body's first part follows at once (HOLD_HEAD)."""
    message = {"type": "http.response.start", "status": status, "headers": encode_headers(headers)}
    if hold:
        message[HOLD_HEAD] = True
    await send(message)


Headers = list[tuple[bytes, bytes]]


def with_headers(send: Send, extra: Callable[[], Headers]) -> Send:
    """`send`, adding the headers `extra()` returns to the response's start. It is
    called when the start is sent, so they may say what the request came to."""

    async def added(message: dict) -> None:
        if message["type"] == "http.response.start":
            more = extra()
            if more:
                message = {**message, "headers": [*message.get("headers", ()), *more]}
        await send(message)

    return added


async def send_body(send: Send, data: bytes, more: bool = False) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    extra: Iterable[tuple[str, str]] = (),
) -> None:
    headers = [("content-type", content_type), ("content-length", str(len(body))), *extra]
    await send(
        {"type": "http.response.start", "status": status, "headers": encode_headers(headers)}
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: object, extra: Iterable[tuple[str, str]] = ()
) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    await send_bytes(send, status, body, "application/json", extra)
