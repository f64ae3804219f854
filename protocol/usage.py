"""Token usage as engines report it, in one shape: prompt and completion tokens.

OpenAI-style answers (vLLM, SGLang, llama.cpp, Ollama's OpenAI API) carry
`usage.{prompt_tokens, completion_tokens}`; Anthropic's `usage.{input_tokens,
output_tokens}` (plus cache reads and writes, which are input too), and the Responses
API the same two names. Streams carry it in
their events: OpenAI's last chunk (with `stream_options.include_usage`), Anthropic's
`message_start` and `message_delta`, the Responses API's `response.completed`
(agent/usage.py reads those). The agent reads it
from engines and the router from external providers; the router charges it.
"""

from __future__ import annotations

import json

PROMPT = "prompt_tokens"
COMPLETION = "completion_tokens"
# The most tokens one request may report over the link, either way. The longest context
# windows hold some ten million; a count past this is no engine's, and the router adds
# counts into 64-bit integers (its history file, Redis) that a few such reports would
# overflow.
MAX_TOKENS = 2**32
_ANTHROPIC_INPUT = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def normalize(usage: object) -> dict[str, int] | None:
    """`{prompt_tokens, completion_tokens}` from either vendor's `usage` object."""
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage or "output_tokens" in usage:
        # Anthropic's and the Responses API's names (the latter's cached tokens are a
        # detail of input_tokens, not beside it, so they are not added twice).
        prompt = sum(_count(usage.get(k)) or 0 for k in _ANTHROPIC_INPUT)
        return {PROMPT: prompt, COMPLETION: _count(usage.get("output_tokens")) or 0}
    if PROMPT in usage or COMPLETION in usage or "total_tokens" in usage:
        prompt = _count(usage.get(PROMPT))
        completion = _count(usage.get(COMPLETION)) or 0
        if prompt is None:
            # Rerank answers report only a total.
            prompt = _count(usage.get("total_tokens"))
        return None if prompt is None else {PROMPT: prompt, COMPLETION: completion}
    return None


def usage_of_answer(answer: object) -> dict[str, int] | None:
    """The usage of a whole (non-streaming) answer, already parsed."""
    return normalize(answer.get("usage")) if isinstance(answer, dict) else None


def usage_of_body(body: bytes) -> dict[str, int] | None:
    """The usage of a whole (non-streaming) JSON answer."""
    if b'"usage"' not in body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return usage_of_answer(data)


def valid_usage(value: object) -> dict[str, int] | None:
    """A `usage` field from the link, trusted only in its exact shape and range."""
    if not isinstance(value, dict):
        return None
    prompt, completion = _count(value.get(PROMPT)), _count(value.get(COMPLETION))
    if prompt is None or completion is None or max(prompt, completion) > MAX_TOKENS:
        return None
    return {PROMPT: prompt, COMPLETION: completion}
