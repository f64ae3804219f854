"""The request fields the router reads or that change how an answer is framed, typed.

The router routes on `model` and frames the answer by `stream`; an engine reads the
same fields by its own rules. Where the two disagree the client's request is at fault,
but it shows up as the agent's: `"stream": "yes"` is non-streaming to the router and
streaming to an engine that takes truthy values, so the agent's answer check calls the
stream malformed and the agent is charged a `backend_error`. Three such requests under
`consecutive_failures: {gte: 3}` excluded a healthy agent (issue 17). Each field here
is therefore checked before routing and refused with 400 `request_invalid`.

Only fields whose type changes routing, framing or the router's own reading of the
answer are listed; the rest are the engine's to judge, and its 4xx is relayed as
`invalid_parameter` without counting against the agent. A JSON `null` is taken as an
absent optional field, as the engines' own schemas do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.paths import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, RERANK, RESPONSES
from router.http import count_tokens

# Model names are short; a longer one is an error, not a multi-megabyte log line.
MAX_MODEL_NAME = 1024


@dataclass(frozen=True, slots=True)
class FieldType:
    """One field's rule: `path` is a dotted path into the body (`stream_options.x`)."""

    path: str
    want: str  # what the error message says it must be
    valid: Callable[[object], bool]
    required: bool = False
    # `path` split once: splitting it on every request was a third of `problem`.
    keys: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.path.split(".")))


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_model(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_MODEL_NAME


def _is_list(value: object) -> bool:
    return isinstance(value, list)


def _is_object(value: object) -> bool:
    return isinstance(value, dict)


def _is_text_or_list(value: object) -> bool:
    return isinstance(value, str | list)


MODEL = FieldType(
    "model", f"a non-empty string of at most {MAX_MODEL_NAME} characters", _is_model, required=True
)
STREAM = FieldType("stream", "a boolean", _is_bool)
MESSAGE_LIST = FieldType("messages", "a list", _is_list, required=True)
STREAM_OPTIONS = FieldType("stream_options", "an object", _is_object)
INCLUDE_USAGE = FieldType("stream_options.include_usage", "a boolean", _is_bool)
MAX_TOKENS = FieldType("max_tokens", "a non-negative integer", _is_count)
MAX_COMPLETION_TOKENS = FieldType("max_completion_tokens", "a non-negative integer", _is_count)
# A legacy completion's prompt: text, a list of texts, or token ids (the engine checks which).
PROMPT = FieldType("prompt", "a string or a list", _is_text_or_list, required=True)
# A response's input: text or a list of input items.
INPUT = FieldType("input", "a string or a list", _is_text_or_list, required=True)
MAX_OUTPUT_TOKENS = FieldType("max_output_tokens", "a non-negative integer", _is_count)

# Per endpoint, in the order a client reads the errors: the first problem is answered.
FIELDS: dict[str, tuple[FieldType, ...]] = {
    CHAT: (
        MODEL,
        STREAM,
        MESSAGE_LIST,
        STREAM_OPTIONS,
        INCLUDE_USAGE,
        MAX_TOKENS,
        MAX_COMPLETION_TOKENS,
    ),
    COMPLETIONS: (MODEL, STREAM, PROMPT, STREAM_OPTIONS, INCLUDE_USAGE, MAX_TOKENS),
    RESPONSES: (MODEL, STREAM, INPUT, MAX_OUTPUT_TOKENS),
    MESSAGES: (MODEL, STREAM, MESSAGE_LIST, MAX_TOKENS),
    EMBEDDINGS: (MODEL, STREAM),
    RERANK: (MODEL, STREAM),
    # count_tokens checks its messages itself (count_tokens.py), with the indexed path.
    count_tokens.COUNT_TOKENS_PATH: (MODEL,),
}

_MISSING = object()


def problem(path: str, payload: dict) -> str | None:
    """What is wrong with `payload`'s types for `path`, or None when nothing is."""
    for rule in FIELDS[path]:
        keys = rule.keys
        value = payload.get(keys[0], _MISSING) if len(keys) == 1 else _lookup(payload, keys)
        if value is _MISSING or value is None:
            if rule.required:
                return f"field '{rule.path}' is required ({rule.want})"
            continue
        if not rule.valid(value):
            return f"field '{rule.path}' must be {rule.want}, got {_kind(value)}"
    return None


def _lookup(payload: dict, keys: tuple[str, ...]) -> object:
    value: object = payload
    for key in keys:
        if not isinstance(value, dict):
            return _MISSING
        value = value.get(key, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def _kind(value: object) -> str:
    """The JSON name of `value`'s type, with the value when it is short."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int | float):
        text = repr(value)
        return f"number {text}" if len(text) <= 20 else "a number"
    if isinstance(value, str):
        return f"string {value[:40]!r}" if len(value) <= 40 else "a long string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
