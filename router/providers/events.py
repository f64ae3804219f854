"""Server-sent events from a provider's stream, and the pass-through translator.

`EventParser` is pure (no I/O, as h11 is): `feed` takes the provider's bytes as they
arrive and returns the events completed so far. A translator takes one event at a time
and returns the bytes the client gets for it, so each event reaches the client as soon
as the provider has sent it; `end` says what is still owed when the provider's stream
ends, or raises ValueError when it broke off before its last event.

`PassThrough` serves a client that speaks the provider's own format (OpenAI to OpenAI,
Anthropic to Anthropic): each event is sent on as it came, only read for its usage, and
an OpenAI usage-only chunk the router asked for (the client did not) is left out.

The provider's own error event (Anthropic's `overloaded_error` mid-stream, OpenAI's
`{"error": …}` chunk) is not relayed: every translator raises `ProviderErrorEvent` for
it, so the router ends the client's stream with its own error event (`code`, `source`)
and counts the answer as failed, as it does when the provider's connection breaks.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from protocol.usage import COMPLETION, PROMPT, normalize

# A provider's event is a few hundred bytes; one that never ends must not grow forever.
MAX_EVENT_BYTES = 8 * 1024 * 1024


class EventParser:
    """Incremental SSE parsing: `feed(bytes)` returns the completed (event, data) pairs."""

    def __init__(self) -> None:
        self._buffer = b""
        self._name: str | None = None
        self._data: list[str] = []
        self._size = 0  # of the unfinished event's data

    def feed(self, chunk: bytes) -> list[tuple[str | None, str]]:
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise ValueError(f"an event line longer than {MAX_EVENT_BYTES} bytes")
        events: list[tuple[str | None, str]] = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if self._data:
                    events.append((self._name, "\n".join(self._data)))
                self._name, self._data, self._size = None, [], 0
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    self._name = value
                elif field == "data":
                    self._size += len(value)
                    if self._size > MAX_EVENT_BYTES:
                        raise ValueError(f"an event larger than {MAX_EVENT_BYTES} bytes")
                    self._data.append(value)
        return events

    def pending(self) -> bool:
        """Whether an event was begun and not finished."""
        return bool(self._data or self._buffer.strip())


def sse(data: Any, event: str | None = None) -> bytes:
    """One event; `data` a JSON value (or the literal `[DONE]`)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def parse_data(data: str) -> dict[str, Any]:
    """An event's data as a JSON object; ValueError when it is not one."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError("an event's data is nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError("an event's data is not a JSON object")
    return value


# An error type is a word (`overloaded_error`, `server_error`): past this, not one.
MAX_KIND = 80


class ProviderErrorEvent(Exception):
    """The provider ended its stream with an error event of `kind` (its error type)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def check_error_event(value: dict[str, Any]) -> None:
    """Raise ProviderErrorEvent when `value` is a provider's error event: OpenAI's
    `{"error": {"type", "message"}}` chunk, Anthropic's `{"type": "error", "error":
    {"type", "message"}}`, or the Responses API's `{"type": "error", "code", "message"}`."""
    inner = value.get("error")
    if isinstance(inner, dict):
        fields = inner
    elif value.get("type") == "error":
        fields = value
    else:
        return
    kind = fields.get("type") if fields is inner else fields.get("code")
    message = fields.get("message")
    raise ProviderErrorEvent(
        # The provider's word for it goes into a log line and a client's message.
        kind[:MAX_KIND] if isinstance(kind, str) and kind else "error",
        message if isinstance(message, str) and message else "no message",
    )


class Translator(Protocol):
    # The answer's token usage, once the stream has told it (prompt/completion tokens).
    usage: dict[str, int] | None

    def event(self, name: str | None, data: str) -> bytes: ...

    def end(self) -> bytes: ...


class UsageSeen:
    """Usage as a stream reports it, in parts: Anthropic's input at the start, output at
    the end; OpenAI's in one chunk."""

    def __init__(self) -> None:
        self.usage: dict[str, int] | None = None

    def add(self, raw: object) -> None:
        usage = normalize(raw)
        if usage is None:
            return
        if self.usage is None:
            self.usage = usage
        else:
            self.usage = {k: max(self.usage[k], usage[k]) for k in (PROMPT, COMPLETION)}


# The event after which a stream has said everything, per format.
_LAST = frozenset({"message_stop", "response.completed", "response.incomplete", "response.failed"})


class PassThrough:
    """Same format both sides: events go on unchanged, read only for usage."""

    def __init__(self, strip_usage_chunk: bool) -> None:
        self._seen = UsageSeen()
        self._strip = strip_usage_chunk
        self._finished = False

    @property
    def usage(self) -> dict[str, int] | None:
        return self._seen.usage

    def event(self, name: str | None, data: str) -> bytes:
        if data == "[DONE]":
            self._finished = True
            return sse(data, name)
        value = parse_data(data)
        check_error_event(value)
        kind = value.get("type")
        if isinstance(kind, str) and kind in _LAST:
            self._finished = True
        usage = value.get("usage")
        inner = value.get("message") or value.get("response")
        if usage is None and isinstance(inner, dict):
            usage = inner.get("usage")  # Anthropic's message_start, response.completed
        self._seen.add(usage)
        if self._strip and value.get("choices") == [] and value.get("usage") is not None:
            return b""
        return sse(data, name)

    def end(self) -> bytes:
        if not self._finished:
            raise ValueError("the provider's stream ended before its last event")
        return b""
