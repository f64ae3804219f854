"""Token usage of one forwarded request, for the router's tenant quotas.

Only when the router asks (`report_usage` on the request frame): the engine's own
count is read from its answer and sent back on `response_end`. The agent does this
rather than the router, whose CPU per request is the fleet's bottleneck. An OpenAI
stream carries usage only when asked (`stream_options.include_usage`), so the agent
asks the engine for it and removes that extra chunk when the client did not ask.
"""

from __future__ import annotations

import json

from protocol.usage import StreamUsage, usage_of_body

# OpenAI endpoints whose streams need `stream_options` to carry usage.
_INCLUDE_USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")


class UsageTap:
    def __init__(self, msg: dict) -> None:
        self.body: bytes = msg["body"]
        self.stream = StreamUsage()
        self.whole: dict[str, int] | None = None
        if msg["stream"] and msg["path"] in _INCLUDE_USAGE_PATHS:
            rewritten = _ask_for_usage(self.body)
            if rewritten is not None:
                self.body = rewritten
                self.stream.strip = True

    def of_body(self, body: bytes) -> None:
        self.whole = usage_of_body(body)

    @property
    def usage(self) -> dict[str, int] | None:
        return self.whole if self.whole is not None else self.stream.usage


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
