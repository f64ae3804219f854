"""Token usage of one forwarded request, for the router's tenant quotas.

Only when the router asks (`report_usage` on the request frame): the engine's own
count is read from its answer and sent back on `response_end`. The agent does this
rather than the router, whose CPU per request is the fleet's bottleneck. An OpenAI
stream carries usage only when asked (`stream_options.include_usage`), so the agent
asks the engine for it and removes that extra chunk when the client did not ask.

The answer is parsed once, by the check of agent/answers.py: a whole answer's object
is handed to `of_answer`, a stream's events to `of_event` as the SSEChecker's observer.
A chat stream the router may continue (`stream_tokens` on the request frame) needs what
the client was sent counted in tokens, not events: vLLM packs several tokens into one
event when its reader lags. On engines that can, the agent asks for the running count
in every chunk (`continuous_usage_stats`); those chunks reach the client with their
`usage` (OpenAI's chunks carry the field anyway), and router/continuation.py reads it
when a stream breaks.

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
# Engines that put the usage so far in every chunk when asked
# (`stream_options.continuous_usage_stats`, with `include_usage`).
CONTINUOUS_USAGE_ENGINES = frozenset({"vllm", "sglang", "sim"})
# Engines that put their running counts in every chunk's `timings` when asked
# (llama.cpp's `timings_per_token`: `predicted_n`, and the prompt's `prompt_n` +
# `cache_n`); router/continuation.py reads them as it reads a running `usage`.
TIMINGS_ENGINES = frozenset({"llamacpp"})
RUNNING_COUNT_ENGINES = CONTINUOUS_USAGE_ENGINES | TIMINGS_ENGINES


def wanted(msg: dict, engine: str) -> bool:
    """Whether a request needs a UsageTap: the router asked for usage, or for a stream's
    running token count on an engine that gives one."""
    return bool(msg.get("report_usage")) or (
        bool(msg.get("stream_tokens")) and engine in RUNNING_COUNT_ENGINES
    )


class UsageTap:
    def __init__(self, msg: dict, engine: str = "") -> None:
        self.body: bytes = msg["body"]
        # Whether the usage-only chunk (`choices: []`) was asked for by the agent alone.
        self.strip = False
        self.usage: dict[str, int] | None = None
        if msg["stream"] and msg["path"] in _INCLUDE_USAGE_PATHS:
            running = msg["path"] == CHAT and bool(msg.get("stream_tokens"))
            rewritten, asked = _ask_for_usage(
                self.body,
                running and engine in CONTINUOUS_USAGE_ENGINES,
                running and engine in TIMINGS_ENGINES,
            )
            if rewritten is not None:
                self.body = rewritten
                self.strip = not asked

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


def _ask_for_usage(
    body: bytes, continuous: bool, timings: bool = False
) -> tuple[bytes | None, bool]:
    """The body with `include_usage` set (and `continuous_usage_stats` when `continuous`,
    `timings_per_token` when `timings`), and whether the client had asked for the usage
    chunk itself. None when the body asks for all that already (or is not a JSON object:
    the engine answers that one with its own error)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, True
    if not isinstance(payload, dict):
        return None, True
    options = payload.get("stream_options")
    options = options if isinstance(options, dict) else {}
    asked = options.get("include_usage") is True
    if (
        asked
        and (not continuous or options.get("continuous_usage_stats") is True)
        and (not timings or payload.get("timings_per_token") is True)
    ):
        return None, True
    options = {**options, "include_usage": True}
    if continuous:
        options["continuous_usage_stats"] = True
    if timings:
        payload["timings_per_token"] = True
    payload["stream_options"] = options
    return json.dumps(payload, separators=(",", ":")).encode(), asked
