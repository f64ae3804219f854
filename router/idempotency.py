"""Safe client retries: a request that arrives again gets the first one's answer.

A request with an `Idempotency-Key` header, or an `X-Request-ID` the client set, is
remembered while it runs and for `--idempotency-window` (60 s) after it succeeded. The
same key again, from the same tenant and the same credentials, with the same body,
joins the running answer (what was sent so far, then what follows) or gets the finished
one replayed; the engine generates once. The same `Idempotency-Key` with another body
is 409 `idempotency_conflict`, as Stripe answers; the same `X-Request-ID` with another
body is another request, served as usual (clients and the seeds' recipes reuse a
request ID to correlate logs, not to name one answer). Only successful answers are
kept (a status under 300 and no error event in the stream); a failed one is
forgotten, so a retry generates anew.

Memory is bounded: an answer over `MAX_ANSWER_BYTES` is not kept (a retry of it
generates again), and past `MAX_KEPT_BYTES` or `MAX_ENTRIES` the oldest finished
answers are dropped first. The table is local to one router process.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import trio

from protocol.logs import quote
from router.http.asgi import Scope, Send, kept_request_id

log = logging.getLogger("http")

IDEMPOTENCY_HEADER = b"idempotency-key"
DEFAULT_WINDOW = 60.0
# 1 MiB holds a 6,000-token OpenAI stream (about 150 bytes an event); longer answers
# are rarely retried within the window, and would take the table's room.
MAX_ANSWER_BYTES = 1 << 20
MAX_KEPT_BYTES = 64 << 20
MAX_ENTRIES = 10_000
# A key longer than this is refused as a key (Stripe's limit is 255).
MAX_KEY_LENGTH = 255
REPLAYED_HEADER = ("idempotent-replayed", "true")


class EntryState(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # finished with a success, kept until `expires`
    DROPPED = "dropped"  # failed, abandoned, or too large: forgotten


@dataclass(eq=False)
class Entry:
    """One key's answer: the response start and body parts as the client got them."""

    fingerprint: bytes
    slot: bytes  # its place in the table
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    state: EntryState = EntryState.RUNNING
    started: bool = False
    failed: bool = False
    expires: float = 0.0
    # Set and replaced on every change, so each joiner waits for the next one.
    changed: trio.Event = field(default_factory=trio.Event)

    def _touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


@dataclass(frozen=True, slots=True)
class Conflict:
    """The key is in use with another body."""


@dataclass(frozen=True, slots=True)
class Join:
    """Serve the running or finished answer of `entry`."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class RequestKey:
    text: str
    explicit: bool  # an Idempotency-Key; else the client's X-Request-ID


def request_key(scope: Scope) -> RequestKey | None:
    """The client's idempotency key: `Idempotency-Key`, else an `X-Request-ID` it set
    (a UUID; the router replaces any other, so it names no request of the client's)."""
    request_id = None
    for key, value in scope["headers"]:
        if key == IDEMPOTENCY_HEADER:
            text = value.decode("latin-1").strip()
            return RequestKey(text, True) if text and len(text) <= MAX_KEY_LENGTH else None
        if key == b"x-request-id":
            request_id = kept_request_id(value.decode("latin-1"))
    return None if request_id is None else RequestKey(request_id, False)


def _credentials(scope: Scope) -> bytes:
    """What tells one client key from another (hashed with the rest of the key)."""
    return b"\x00".join(
        value for key, value in scope["headers"] if key in (b"authorization", b"x-api-key")
    )


class IdempotencyTable:
    def __init__(self, window: float = DEFAULT_WINDOW) -> None:
        self.window = window
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.kept = 0  # bytes of finished answers

    def __repr__(self) -> str:
        return f"<IdempotencyTable {len(self.entries)} keys, {self.kept} bytes kept>"

    def claim(
        self, scope: Scope, tenant: str, path: str, body: bytes
    ) -> Entry | Join | Conflict | None:
        """A new entry to record into (this request generates), the entry to serve
        from, a conflict, or None when the request carries no key (or the table is off)."""
        if self.window <= 0:
            return None
        key = request_key(scope)
        if key is None:
            return None
        self._expire(trio.current_time())
        digest = hashlib.sha256()
        # The key's kind is part of it: an Idempotency-Key never meets a request ID.
        kind = b"key" if key.explicit else b"request-id"
        for part in (tenant.encode(), _credentials(scope), path.encode(), kind, key.text.encode()):
            digest.update(hashlib.sha256(part).digest())
        slot = digest.digest()
        fingerprint = hashlib.sha256(body).digest()
        entry = self.entries.get(slot)
        if entry is not None:
            if entry.fingerprint == fingerprint:
                return Join(entry)
            # A request ID reused for another body names another request.
            return Conflict() if key.explicit else None
        entry = Entry(fingerprint, slot)
        self.entries[slot] = entry
        self.entries.move_to_end(slot)
        self._bound()
        return entry

    async def once(
        self,
        scope: Scope,
        tenant: str,
        body: bytes,
        send: Send,
        rid: str,
        refuse: Callable[[], Awaitable[int]],
        abandoned: bytes,
        generate: Callable[[Send, Callable[[bytes], None] | None], Awaitable[int]],
    ) -> int:
        """Serve a request once per key: `generate` it (recorded), or send the answer
        of the same request already running or done; `refuse` a key reused with
        another body. `abandoned` ends a joined stream whose first request failed.
        `generate` is given the send to answer with and, when it records, what records
        a body part written past that send."""
        path = scope["path"]
        while True:
            claim = self.claim(scope, tenant, path, body)
            if claim is None:
                return await generate(send, None)
            if isinstance(claim, Conflict):
                return await refuse()
            if isinstance(claim, Join):
                state = claim.entry.state.value
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("req=%s idempotent_join of=%s tenant=%s", rid, state, quote(tenant))
                status = await serve_join(claim.entry, send, rid, abandoned)
                if status is not None:
                    log.info("req=%s idempotent_replay of=%s tenant=%s", rid, state, quote(tenant))
                    return status
                continue  # the first one failed before its answer began: generate
            status = 499  # cancelled (client gone, deadline) unless generate returns
            try:
                record_part = partial(self.record_part, claim)
                status = await generate(self.recorder(claim, send), record_part)
            finally:
                self.finish(claim, status)
            return status

    def recorder(self, entry: Entry, send: Send) -> Send:
        """`send`, recording what it sends into `entry`."""

        async def recording(message: dict) -> None:
            if message["type"] != "http.response.start":
                self.record_part(entry, message.get("body", b""))
            elif entry.state is EntryState.RUNNING:
                entry.status = message["status"]
                entry.headers = list(message.get("headers", []))
                entry.started = True
                entry._touch()
            await send(message)

        return recording

    def record_part(self, entry: Entry, body: bytes) -> None:
        """One body part of `entry`'s answer, sent through the recorder or written
        past it (a stream's parts that the link's reader writes, router/link.py)."""
        if entry.state is not EntryState.RUNNING:
            return
        if not entry.failed and _carries_error(body):
            entry.failed = True
        entry.size += len(body)
        if entry.size > MAX_ANSWER_BYTES:
            self.drop(entry)
        else:
            entry.parts.append(body)
        entry._touch()

    def finish(self, entry: Entry, status: int) -> None:
        """The generating request ended: keep a success for the window, drop the rest."""
        if entry.state is not EntryState.RUNNING:
            return
        if status >= 300 or entry.failed or not entry.started:
            self.drop(entry)
            return
        entry.state = EntryState.DONE
        entry.expires = trio.current_time() + self.window
        self.kept += entry.size
        # The table stays in order of expiry among finished entries: `_expire` stops at
        # the first one still valid.
        self.entries.move_to_end(entry.slot)
        entry._touch()
        self._bound()

    def drop(self, entry: Entry) -> None:
        """Forget `entry` and its answer; joiners still waiting on it are told."""
        if entry.state is EntryState.DONE:
            self.kept -= entry.size
        entry.state = EntryState.DROPPED
        entry.parts = []
        if self.entries.get(entry.slot) is entry:
            del self.entries[entry.slot]
        entry._touch()

    def _expire(self, now: float) -> None:
        # Running entries (as many as requests in flight) are passed over; finished
        # ones expire in table order.
        stale = []
        for entry in self.entries.values():
            if entry.state is EntryState.DONE:
                if entry.expires > now:
                    break
                stale.append(entry)
        for entry in stale:
            self.drop(entry)

    def _bound(self) -> None:
        """Drop the oldest finished answers past the table's bounds."""
        while len(self.entries) > MAX_ENTRIES or self.kept > MAX_KEPT_BYTES:
            oldest = next((e for e in self.entries.values() if e.state is EntryState.DONE), None)
            if oldest is None:
                return
            self.drop(oldest)


# An error event opens a part or follows another event in it: the link joins the
# frames that arrive together, and an engine's error event (vLLM's `data: {"error": …}`)
# comes after its content events. Neither pattern can occur inside an event's JSON,
# where a quote is escaped and a line break too.
_ERROR_EVENTS = (b'data: {"error"', b"event: error")
_ERROR_EVENTS_AFTER = tuple(b"\n" + pattern for pattern in _ERROR_EVENTS)


def _carries_error(body: bytes) -> bool:
    """Whether a stream's part holds an error event (the stream failed)."""
    return body.startswith(_ERROR_EVENTS) or any(p in body for p in _ERROR_EVENTS_AFTER)


async def serve_join(entry: Entry, send: Send, rid: str, abandoned: bytes) -> int | None:
    """Send `entry`'s answer as it is and as it grows; None when it was dropped before
    anything was sent (the caller then generates)."""
    sent = 0
    started = False
    while True:
        if entry.state is EntryState.DROPPED:
            if not started:
                return None
            # The first request failed or was abandoned part way: end this one too,
            # with the error event a broken stream gets.
            await send({"type": "http.response.body", "body": abandoned, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return entry.status
        if entry.started and not started:
            headers = [(k, v) for k, v in entry.headers if k != b"x-request-id"]
            headers += [(b"x-request-id", rid.encode())]
            headers.append((REPLAYED_HEADER[0].encode(), REPLAYED_HEADER[1].encode()))
            await send({"type": "http.response.start", "status": entry.status, "headers": headers})
            started = True
        parts = entry.parts
        while started and sent < len(parts):
            body = parts[sent]
            sent += 1
            last = entry.state is EntryState.DONE and sent == len(parts)
            await send({"type": "http.response.body", "body": body, "more_body": not last})
            if last:
                return entry.status
        if entry.state is EntryState.DONE and started and sent >= len(parts):
            await send({"type": "http.response.body", "body": b""})
            return entry.status
        await entry.changed.wait()
