"""Token usage of one forwarded request, for the router's tenant quotas.

Only when the router asks (`report_usage` on the request frame): the engine's own
count is read from its answer and sent back on `response_end`. The agent does this
rather than the router, whose CPU per request is the fleet's bottleneck. An OpenAI
stream carries usage only when asked (`stream_options.include_usage`), so the agent
asks the engine for it and removes that extra chunk when the client did not ask.

The answer is parsed once, by the check of agent/answers.py: a whole answer's object
is handed to `of_answer`, a stream's events to `of_event` as the SSEChecker's observer,
or, as nearly always, read for their counts alone by `of_data` without being built.
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
import re
from typing import Annotated

import msgspec
from msgspec import UNSET, UnsetType

from agent.answers import is_utf8
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

    def of_data(self, data: bytes) -> tuple[object, bool] | None:
        """Read one stream event's data (UTF-8, the SSEChecker's `read`) as `of_event`
        reads its parsed object, without building it: the event's `type`, and True
        when the client must not see it. None where `of_event` must have the object:
        data msgspec refuses (the check's full parse then says why, or reads what
        msgspec does not), a count that is not a plain integer, a usage inside a
        `message` or `response`. An OpenAI chunk with its running count: 4.7 µs as
        the object, 0.9 µs so (tests/test_usage_tap.py holds the two to one verdict)."""
        try:
            event = _read_event(data)
        except (msgspec.MsgspecError, RecursionError):  # deep nesting raises the latter
            return None
        counts = event.usage
        if counts is None:
            if event.message is not UNSET or event.response is not UNSET:
                return None
            return event.type, False
        if (
            counts.input_tokens is UNSET
            and counts.output_tokens is UNSET
            and (prompt := counts.prompt_tokens) is not UNSET
            and prompt >= 0  # type: ignore[operator]
        ):
            # OpenAI's names, as vLLM and SGLang send them in every chunk.
            completion = _count(counts.completion_tokens) or 0
        else:
            usage = _counted(counts)
            if usage is None:
                return event.type, False
            prompt, completion = usage
        old = self.usage
        if old is None:
            self.usage = {PROMPT: prompt, COMPLETION: completion}
        elif prompt > old[PROMPT] or completion > old[COMPLETION]:
            self.usage = {
                PROMPT: max(prompt, old[PROMPT]),
                COMPLETION: max(completion, old[COMPLETION]),
            }
        return event.type, self.strip and _empty_list(event.choices)

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


_SPACE = re.compile(rb"[ \t\r\n]*")
# What a body without `stream_options` gets, at the start of its object.
_OPTIONS = b'"stream_options":{"include_usage":true}'
_CONTINUOUS_OPTIONS = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
# llama.cpp's running counts (a body naming `timings_per_token` itself keeps its own: the
# last of two keys is the one JSON parsers keep).
_TIMINGS = b'"timings_per_token":true,'


class _Body(msgspec.Struct):
    """Whether a request body names `stream_options`; nothing else of it is built."""

    stream_options: msgspec.Raw | UnsetType = UNSET


_read_body = msgspec.json.Decoder(_Body).decode


def _ask_for_usage(
    body: bytes, continuous: bool, timings: bool = False
) -> tuple[bytes | None, bool]:
    """The body with `include_usage` set (and `continuous_usage_stats` when `continuous`,
    `timings_per_token` when `timings`), and whether the client had asked for the usage
    chunk itself. None when the body asks for all that already (or is not a JSON object:
    the engine answers that one with its own error).

    A body without `stream_options`, as nearly all are, gets them written in at the
    start of its object, the rest of its bytes as the client sent them: 1.3 µs where
    parsing and writing it again took 7 µs for a short chat and grows with the prompt.
    msgspec reads it only to learn that (it checks the syntax of what it skips, not its
    UTF-8, hence `is_utf8`); any other body is parsed and written again."""
    if is_utf8(body):
        try:
            options = _read_body(body).stream_options
        except (msgspec.MsgspecError, RecursionError):
            options = None
        if options is UNSET:
            at = body.index(b"{") + 1  # msgspec read an object: its first character
            first = _SPACE.match(body, at).end()  # type: ignore[union-attr]
            empty = body[first : first + 1] == b"}"
            fields = _CONTINUOUS_OPTIONS if continuous else _OPTIONS
            if timings:
                fields = _TIMINGS + fields
            return body[:at] + fields + (b"" if empty else b",") + body[at:], False
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


# orjson, whose parse `of_event` reads, makes a float of an integer past 64 bits; one
# past 63 (msgspec's bound) is left to it.
_Int = Annotated[int, msgspec.Meta(le=2**63 - 1)]


class _Counts(msgspec.Struct):
    """The counts `normalize` reads, each a plain integer or absent; any other value
    makes msgspec refuse the event, which `of_event` then reads."""

    prompt_tokens: _Int | UnsetType = UNSET
    completion_tokens: _Int | UnsetType = UNSET
    total_tokens: _Int | UnsetType = UNSET
    input_tokens: _Int | UnsetType = UNSET
    output_tokens: _Int | UnsetType = UNSET
    cache_creation_input_tokens: _Int | UnsetType = UNSET
    cache_read_input_tokens: _Int | UnsetType = UNSET


class _Event(msgspec.Struct):
    """What `of_event` and the check read of an event's data object."""

    type: object = None
    usage: _Counts | None = None
    choices: msgspec.Raw | UnsetType = UNSET
    message: msgspec.Raw | UnsetType = UNSET
    response: msgspec.Raw | UnsetType = UNSET


_read_event = msgspec.json.Decoder(_Event).decode


def _count(value: int | UnsetType) -> int | None:
    return None if value is UNSET or value < 0 else value  # type: ignore[operator]


def _counted(counts: _Counts) -> tuple[int, int] | None:
    """`normalize` of the usage object that `counts` was read from, as a pair."""
    if counts.input_tokens is not UNSET or counts.output_tokens is not UNSET:
        prompt = 0
        for value in (
            counts.input_tokens,
            counts.cache_creation_input_tokens,
            counts.cache_read_input_tokens,
        ):
            prompt += _count(value) or 0
        return prompt, _count(counts.output_tokens) or 0
    if (
        counts.prompt_tokens is UNSET
        and counts.completion_tokens is UNSET
        and counts.total_tokens is UNSET
    ):
        return None
    prompt = _count(counts.prompt_tokens)
    if prompt is None:
        prompt = _count(counts.total_tokens)  # rerank answers report only a total
    return None if prompt is None else (prompt, _count(counts.completion_tokens) or 0)


_EMPTY = msgspec.Raw(b"[]")
_JSON_SPACE = b" \t\r\n"


def _empty_list(raw: msgspec.Raw | UnsetType) -> bool:
    """Whether a JSON value (valid, as msgspec read it) is the empty list: a comparison
    for `[]` and for a list that holds anything, the rest only for `[ ]`."""
    if raw is UNSET:
        return False
    if raw == _EMPTY:
        return True
    view = memoryview(raw)  # type: ignore[arg-type]
    if view[0] != 0x5B or view[1] not in _JSON_SPACE:
        return False
    return not bytes(view[1:-1]).strip(_JSON_SPACE)
