"""Token usage as engines report it, in one shape: prompt and completion tokens.

OpenAI-style answers (vLLM, SGLang, llama.cpp, Ollama's OpenAI API) carry
`usage.{prompt_tokens, completion_tokens}`; Anthropic's `usage.{input_tokens,
output_tokens}` (plus cache reads and writes, which are input too). Streams carry it in
their events: OpenAI's last chunk (with `stream_options.include_usage`), Anthropic's
`message_start` and `message_delta`. The agent reads it; the router charges it.
"""

from __future__ import annotations

import json
import re

PROMPT = "prompt_tokens"
COMPLETION = "completion_tokens"
# An SSE event ends at a blank line.
_BOUNDARY = re.compile(rb"\r?\n\r?\n")
# An engine that never ends an event must not grow the buffer without bound.
MAX_EVENT_BYTES = 1024 * 1024
_ANTHROPIC_INPUT = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def normalize(usage: object) -> dict[str, int] | None:
    """`{prompt_tokens, completion_tokens}` from either vendor's `usage` object."""
    if not isinstance(usage, dict):
        return None
    if PROMPT in usage or COMPLETION in usage or "total_tokens" in usage:
        prompt = _count(usage.get(PROMPT))
        completion = _count(usage.get(COMPLETION)) or 0
        if prompt is None:
            # Rerank answers report only a total.
            prompt = _count(usage.get("total_tokens"))
        return None if prompt is None else {PROMPT: prompt, COMPLETION: completion}
    if "input_tokens" in usage or "output_tokens" in usage:
        prompt = sum(_count(usage.get(k)) or 0 for k in _ANTHROPIC_INPUT)
        return {PROMPT: prompt, COMPLETION: _count(usage.get("output_tokens")) or 0}
    return None


def usage_of_body(body: bytes) -> dict[str, int] | None:
    """The usage of a whole (non-streaming) JSON answer."""
    if b'"usage"' not in body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return normalize(data.get("usage")) if isinstance(data, dict) else None


def valid_usage(value: object) -> dict[str, int] | None:
    """A `usage` field from the link, trusted only in its exact shape."""
    if not isinstance(value, dict):
        return None
    prompt, completion = _count(value.get(PROMPT)), _count(value.get(COMPLETION))
    if prompt is None or completion is None:
        return None
    return {PROMPT: prompt, COMPLETION: completion}


class StreamUsage:
    """Reads usage out of an SSE stream as it passes, chunk by chunk.

    With `strip`, the OpenAI usage-only chunk (`choices: []`) is removed: the agent
    asked the engine for it on the router's behalf, and the client did not.
    """

    def __init__(self, strip: bool = False) -> None:
        self.strip = strip
        self.buffer = b""
        self.usage: dict[str, int] | None = None

    def feed(self, data: bytes) -> bytes:
        """`data` as the client should see it (unchanged unless stripping)."""
        buf = self.buffer + data
        kept: list[bytes] = []
        start = 0
        for match in _BOUNDARY.finditer(buf):
            event = buf[start : match.end()]
            start = match.end()
            if not (self._scan(event) and self.strip):
                kept.append(event)
        self.buffer = buf[start:]
        if len(self.buffer) > MAX_EVENT_BYTES:
            kept.append(self.buffer)
            self.buffer = b""
        return b"".join(kept) if self.strip else data

    def flush(self) -> bytes:
        """What is left at the end of the stream (an event without its blank line)."""
        rest, self.buffer = self.buffer, b""
        usage_only = self._scan(rest) if rest else False
        return rest if self.strip and not usage_only else b""

    def _scan(self, event: bytes) -> bool:
        """Record the event's usage; True when it is an OpenAI usage-only chunk."""
        if b'"usage"' not in event:
            return False
        data = b"".join(
            line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
        )
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False
        if not isinstance(obj, dict):
            return False
        raw = obj.get("usage")
        message = obj.get("message")
        if raw is None and isinstance(message, dict):  # Anthropic's message_start
            raw = message.get("usage")
        usage = normalize(raw)
        if usage is None:
            return False
        if self.usage is None:
            self.usage = usage
        else:
            # Anthropic reports input at the start and output (cumulative) at the end.
            self.usage = {k: max(self.usage[k], usage[k]) for k in (PROMPT, COMPLETION)}
        return obj.get("choices") == []
