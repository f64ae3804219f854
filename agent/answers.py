"""What an engine's successful answer must look like before the client gets any of it.

A proxy's error page, a truncated write or a crashed engine can come back as a 200. The
client's SDK would fail on it, and once it is relayed no other agent can be tried. So
the agent checks the answer first: a whole answer must be one JSON object, a stream
must be server-sent events whose `data` is a JSON object or `[DONE]`. A stream is
checked incrementally: each byte is scanned once and each event's data parsed once.
That parse is the only one: what else reads the answer (the token usage of
agent/usage.py) is handed the parsed values. It is orjson's (`parse_json`), which
halved the check's CPU: 68 → 36 µs per 16-token stream, 2.9 → 0.7 µs per whole answer.
An event nobody reads further is only checked, by msgspec, which builds nothing
(`_kind_of`); one whose token counts are read is read by msgspec too, for those counts
alone (`read`, agent/usage.py `of_data`): a 16-token stream with its running count in
every event, 63 → 41 µs.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec
import orjson

from agent.engine_http import DECODABLE, decompressed


class MalformedAnswer(Exception):
    """The engine's 2xx answer is not what its API promises (`backend_error`)."""


DONE = b"[DONE]"
# The last event of a stream that ends without `[DONE]`: Anthropic's, and the Responses
# API's three terminal events.
LAST_EVENTS = frozenset(
    {"message_stop", "response.completed", "response.incomplete", "response.failed"}
)
# Engines send events of a few hundred bytes; the agent holds one unfinished event, so
# one that never ends must not grow without bound.
MAX_EVENT_BYTES = 8 * 1024 * 1024
# A compressed whole answer is decoded for the check up to this size (its compressed
# bytes fit one frame, 16 MiB); one that decodes past it is malformed, not a memory
# exhaustion.
MAX_DECODED_BYTES = 128 * 1024 * 1024


class _EventKind(msgspec.Struct):
    """What the check needs of an event nobody observes: that its data is a JSON
    object, and its `type`."""

    type: object = None


# msgspec reads those two without building the object: 0.22 µs for an OpenAI chunk
# against orjson's 0.67 for the whole of it. It does not check the UTF-8 of what it
# skips, so only UTF-8 data is read this way (`is_utf8`); what it refuses takes the full
# parse, so every refusal, and its message, is the full parse's (tests/test_answers.py).
_read_kind = msgspec.json.Decoder(_EventKind).decode


def parse_json(data: bytes) -> object:
    """The JSON value of `data`; ValueError (or RecursionError) when it is not JSON.

    What orjson refuses and Python's json reads (NaN and Infinity, integers past 64
    bits, lone surrogate escapes, UTF-16 text) is read by json, so no answer that
    passed the check before fails it now; orjson's refusal costs only that second try.
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def is_event_stream(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


def check_json_answer(body: bytes, content_encoding: str = "") -> dict | None:
    """The JSON object `body` holds; MalformedAnswer when it is not one.

    None when the encoding cannot be looked into.
    """
    encoding = content_encoding.strip().lower()
    if encoding and encoding != "identity":
        if encoding not in DECODABLE:
            return None  # cannot look inside; relayed as the engine sent it
        try:
            body = decompressed(body, MAX_DECODED_BYTES)
        except ValueError as exc:
            raise MalformedAnswer(f"answer does not decode as {encoding}: {exc}") from None
    if not body.strip():
        raise MalformedAnswer("empty answer")
    try:
        value = parse_json(body)
    except (ValueError, UnicodeDecodeError):
        raise MalformedAnswer(f"answer is not JSON: {_excerpt(body)}") from None
    except RecursionError:
        raise MalformedAnswer("answer is JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise MalformedAnswer(f"answer is JSON but not an object: {_excerpt(body)}")
    return value


class SSEChecker:
    """Incremental check of a server-sent event stream.

    `feed` takes the engine's chunks as they come and returns the bytes of the events
    completed so far, each checked. An unfinished event waits for the next chunk, so the
    client only ever receives whole events; and nothing is returned before the first
    event with data has been checked, so until then another agent can still be tried.
    `close` says whether the stream ended well. Lines end with LF, CRLF or CR (the SSE
    grammar); an event ends at an empty line.

    `observe`, when given, is handed each event's parsed data object as soon as the
    event is checked; when it returns True the event is left out of what `feed` returns.
    `read`, given with `observe`, reads an event's data in its stead without building
    it (agent/usage.py `of_data`): the event's `type` and whether it is left out, or
    None when it cannot tell, and the full parse and `observe` then take the event. It is
    handed only UTF-8 data, which the check's full parse would read alike (`is_utf8`).
    `finished` turns true at the answer's last event: OpenAI's `[DONE]`, Anthropic's
    `message_stop`, the Responses API's `response.completed` (or incomplete, failed).
    """

    __slots__ = (
        "_after_cr",
        "_data",
        "_drop_lf",
        "_observe",
        "_open",
        "_pending",
        "_read",
        "_ready",
        "_scanned",
        "data_events",
        "finished",
    )

    def __init__(
        self,
        observe: Callable[[dict], bool] | None = None,
        read: Callable[[bytes], tuple[object, bool] | None] | None = None,
    ) -> None:
        self._observe = observe
        self._read = read
        self._pending = bytearray()  # bytes not yet returned
        self._ready = 0  # _pending[:_ready] are whole, checked events
        self._scanned = 0  # _pending[:_scanned] are whole lines, already read
        self._data: list[bytes] = []  # data lines of the unfinished event
        self._open = False  # the unfinished event has had a line
        self._after_cr = False
        self._drop_lf = False  # the CR that _after_cr waits on ended an event left out
        self.data_events = 0
        self.finished = False

    def feed(self, chunk: bytes) -> bytes:
        if self._pending or self._open or self._after_cr or b"\r" in chunk:
            return self._feed(chunk)
        # At an event boundary, as an engine's reads nearly always begin: the leading
        # one-line `data: ` events are checked without the line scan (a 17-event
        # stream in two-event reads: 35.4 → 27.2 µs; the JSON parse is most of the
        # rest). The rest of the chunk, from the first event of another shape or the
        # unfinished one at its end, takes the line scan.
        kept: list[bytes] | None = None  # set once an event is left out
        start = 0
        verdict = self._verdict
        for event in chunk.split(b"\n\n")[:-1]:
            if event[:6] != b"data: " or b"\n" in event:
                break
            end = start + len(event) + 2
            if verdict(event[6:]):
                if kept is None:
                    kept = [chunk[:start]]
            elif kept is not None:
                kept.append(chunk[start:end])
            start = end
        if not start:
            return self._feed(chunk)
        if kept is None:
            return chunk if start == len(chunk) else chunk[:start] + self._feed(chunk[start:])
        if start < len(chunk):
            kept.append(self._feed(chunk[start:]))
        return b"".join(kept)

    def _feed(self, chunk: bytes) -> bytes:
        pending = self._pending
        pending += chunk
        pos = self._scanned
        end = len(pending)
        if self._after_cr and pos < end:
            # The last chunk ended with a CR: a LF now is the second half of that CRLF.
            self._after_cr = False
            if pending[pos] == 0x0A:
                if self._drop_lf:
                    del pending[pos]  # it ends an event left out: it goes with it
                    end -= 1
                else:
                    if self._ready == pos:
                        self._ready += 1  # it ends an event already complete: it goes with it
                    pos += 1
            self._drop_lf = False
        while pos < end:
            lf = pending.find(b"\n", pos)
            cr = pending.find(b"\r", pos, lf if lf >= 0 else end)
            if cr >= 0:
                if cr + 1 == end:
                    self._after_cr = True
                    line_end, after = cr, end
                else:
                    line_end, after = cr, cr + 2 if pending[cr + 1] == 0x0A else cr + 1
            elif lf >= 0:
                line_end, after = lf, lf + 1
            else:
                break
            if line_end == pos:
                if self._end_event():
                    # The event began where the previous one ended, at _ready.
                    del pending[self._ready : after]
                    end -= after - self._ready
                    after = self._ready
                    self._drop_lf = self._after_cr
                self._ready = after
            else:
                self._line(bytes(pending[pos:line_end]))
            pos = after
        self._scanned = pos
        ready = self._ready
        if end - ready > MAX_EVENT_BYTES:
            raise MalformedAnswer(f"an event larger than {MAX_EVENT_BYTES} bytes")
        if not ready or not self.data_events:
            return b""
        out = bytes(pending[:ready])
        del pending[:ready]
        self._scanned -= ready
        self._ready = 0
        return out

    def close(self) -> None:
        """Raise MalformedAnswer when the stream stopped inside an event or said nothing."""
        rest = bytes(self._pending[self._ready :])
        if self._open or rest.strip():
            raise MalformedAnswer(f"event stream broke off inside an event: {_excerpt(rest)}")
        if not self.data_events:
            raise MalformedAnswer("event stream ended without any data event")

    def _line(self, line: bytes) -> None:
        self._open = True
        if line.startswith(b"data"):
            field, _, value = line.partition(b":")
            if field == b"data":
                # One space after the colon belongs to the syntax, not to the value.
                self._data.append(value[1:] if value[:1] == b" " else value)
                return
        if line[:1] != b":" and b":" not in line and line not in (b"event", b"id", b"retry"):
            # Neither a comment nor a field: this is not an event stream at all.
            raise MalformedAnswer(f"not a server-sent event line: {_excerpt(line)}")

    def _end_event(self) -> bool:
        """Check the event just ended; True when it is to be left out."""
        self._open = False
        parts = self._data
        if not parts:
            return False  # a comment or an event without data: nothing for the client to parse
        self._data = []
        return self._verdict(parts[0] if len(parts) == 1 else b"\n".join(parts))

    def _verdict(self, data: bytes) -> bool:
        """Check an event's data; True when the event is to be left out."""
        self.data_events += 1
        if data == DONE:
            self.finished = True
            return False
        observe = self._observe
        read = self._read
        if read is not None and is_utf8(data):
            got = read(data)
            if got is not None:
                kind, drop = got
                if kind is not None and type(kind) is str and kind in LAST_EVENTS:
                    self.finished = True
                return drop
        value = None if observe is None else _event_object(data)
        kind = _kind_of(data) if value is None else value.get("type")
        # OpenAI's chunks have no `type`: one comparison for them; a hostile list or
        # dict `type` is not hashable, so it is checked before the set lookup.
        if kind is not None and type(kind) is str and kind in LAST_EVENTS:
            self.finished = True
        return value is not None and observe is not None and observe(value)


def is_utf8(data: bytes) -> bool:
    """Whether `data` is UTF-8, so that a reader which skips what it does not need
    (msgspec, which checks the syntax of what it skips but not its UTF-8) accepts
    exactly what the full parse accepts, or refuses it and leaves it to that parse."""
    if data.isascii():
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _kind_of(data: bytes) -> object:
    """The `type` of the JSON object an event's data holds, read without building the
    object where msgspec can; MalformedAnswer when it holds no object."""
    if is_utf8(data):
        try:
            return _read_kind(data).type
        except (msgspec.MsgspecError, RecursionError):  # deep nesting raises the latter
            pass
    return _event_object(data).get("type")


def _event_object(data: bytes) -> dict:
    """The JSON object an event's data holds; MalformedAnswer when it holds none."""
    try:
        value = parse_json(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise MalformedAnswer(f"event data is not JSON: {_excerpt(data)}") from None
    if not isinstance(value, dict):
        raise MalformedAnswer(f"event data is not a JSON object: {_excerpt(data)}")
    return value


def _excerpt(data: bytes, limit: int = 120) -> str:
    text = data[:limit].decode("utf-8", "replace")
    return repr(text + ("…" if len(data) > limit else ""))
