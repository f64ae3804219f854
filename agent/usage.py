"""Token usage of one forwarded request, for the router's tenant quotas.

Only when the router asks (`report_usage` on the request frame): the engine's own
count is read from its answer and sent back on `response_end`. The agent does this
rather than the router, whose CPU per request is the fleet's bottleneck. An OpenAI
stream carries usage only when asked (`stream_options.include_usage`), so the agent
asks the engine for it and removes that extra chunk when the client did not ask.

The answer is parsed once, by the check of agent/answers.py: a whole answer's object
is handed to `of_answer`, a stream's events to `of_event` as the SSEChecker's observer.
Where that check does not run on a stream (an error status, a compressed stream) its
usage is not read and its usage-only chunk stays; a compressed stream could not be
read before either.
"""

from __future__ import annotations

import json

from protocol.paths import CHAT, COMPLETIONS
from protocol.usage import COMPLETION, PROMPT, normalize, usage_of_answer, usage_of_body

# OpenAI endpoints whose streams need `stream_options` to carry usage.
_INCLUDE_USAGE_PATHS = (CHAT, COMPLETIONS)


class UsageTap:
    def __init__(self, msg: dict) -> None:
        self.body: bytes = msg["body"]
        # Whether the usage-only chunk (`choices: []`) was asked for by the agent alone.
        self.strip = False
        self.usage: dict[str, int] | None = None
        if msg["stream"] and msg["path"] in _INCLUDE_USAGE_PATHS:
            rewritten = _ask_for_usage(self.body)
            if rewritten is not None:
                self.body = rewritten
                self.strip = True

    def of_answer(self, answer: dict | None, body: bytes) -> None:
        """Read a whole answer: `answer` is its object as the check parsed it; only an
        answer the check did not parse (None: an error status, an encoding it cannot
        decode) is parsed here."""
        self.usage = usage_of_body(body) if answer is None else usage_of_answer(answer)

    def of_event(self, event: dict) -> bool:
        """Read one stream event's data; True when the client must not see the event."""
        raw = event.get("usage")
        if raw is None:
            # Anthropic's message_start, the Responses API's response.completed.
            inner = event.get("message") or event.get("response")
            if not isinstance(inner, dict):
                return False
            raw = inner.get("usage")
        usage = normalize(raw)
        if usage is None:
            return False
        if self.usage is None:
            self.usage = usage
        else:
            # Anthropic reports input at the start and output (cumulative) at the end.
            self.usage = {k: max(self.usage[k], usage[k]) for k in (PROMPT, COMPLETION)}
        return self.strip and event.get("choices") == []


def _ask_for_usage(body: bytes) -> bytes | None:
    """The body with `include_usage` set; None when the client already asked (or the
    body is not a JSON object: the engine answers that one with its own error)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    payload["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return json.dumps(payload, separators=(",", ":")).encode()
