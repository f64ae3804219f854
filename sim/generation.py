"""What a generation request asks for and the deterministic answer it gets.

A "token" is a whitespace-separated word: tests and benchmarks can predict every count
(usage, context limits, `max_tokens` cuts, cached tokens) from the prompt text alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sim.asgi import Exchange


class RequestError(Exception):
    """A request the engine refuses; each API renders it in its own error shape."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


@dataclass(slots=True)
class Job:
    """A generation: the prompt as the engine sees it, and the answer, one piece per token."""

    prompt: list[str]  # after the chat template (`template`)
    pieces: list[str]
    finish: str  # "stop", "length" or "tool_calls" (OpenAI's names)
    started: float
    cached_tokens: int = 0  # found in the prefix cache at prefill
    emitted: int = 0  # tokens a stream has sent so far, the event being sent included

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage record (chat and completions alike), with the cached share.

        `prompt_tokens_details.cached_tokens` is where OpenAI reports cache hits, and vLLM
        too (with `--enable-prompt-tokens-details`).
        """
        prompt, completion = self.prompt_tokens, len(self.pieces)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# What a prepared request does once admitted: it writes the whole response.
Run = Callable[[Exchange], Awaitable[None]]
# Called with each generated piece (its index first) while a stream is being answered.
Emit = Callable[[int, str], Awaitable[None]]


def words(text: str) -> list[str]:
    return text.split()


def content_text(content: Any) -> str:
    """Text of an OpenAI or Anthropic message content: a string or a list of parts,
    a `tool_result` block's content among them (what the model reads of a tool run)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part.get("type") == "tool_result":
                texts.append(_result_text(part.get("content")))
        return " ".join(texts)
    return ""


def _result_text(content: Any) -> str:
    """A `tool_result` block's content: a string or a list of text blocks (one level,
    so a hostile nesting cannot recurse)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def template(role: str, turn: list[str]) -> list[str]:
    """A turn's tokens as the engine sees them after its chat template.

    Each word is tagged with its role, and the turn's first word with the turn's start, so
    the same words said by another role or split over other turns are another prompt to
    the prefix cache, as they are after a real template; the count stays the words'.
    """
    return [f"{role}\x01{word}" if i == 0 else f"{role}\x00{word}" for i, word in enumerate(turn)]


def answer(
    prompt: list[str], limit: int | None, ignore_eos: bool, skip: int = 0
) -> tuple[list[str], str]:
    """Deterministic answer pieces for the prompt words, and the finish reason.

    Each piece is a function of its position alone, so an answer continued from its
    first `skip` pieces (a prefilled assistant turn) goes on with exactly the pieces
    the whole answer has there: a stream spliced from two engines can be checked.
    """
    echo = ["Echo:", *prompt]
    if ignore_eos and limit is not None:
        # vLLM's ignore_eos generates until max_tokens: benchmarks use it for fixed lengths.
        echo = list(itertools.islice(itertools.cycle(echo), skip, skip + limit))
        finish = "length"
        return _spaced(echo, skip), finish
    echo = echo[skip:]
    if limit is not None and len(echo) > limit:
        echo = echo[:limit]
        finish = "length"
    else:
        finish = "stop"
    return _spaced(echo, skip), finish


def _spaced(echo: list[str], skip: int) -> list[str]:
    """Words as pieces: each after the answer's first one starts with its space."""
    if not echo:
        return []
    if skip:
        return [" " + w for w in echo]
    return [echo[0], *(" " + w for w in echo[1:])]


def prefilled(messages: Any) -> int:
    """How many answer words a final assistant message already holds (0: none).

    vLLM and SGLang continue that message with `continue_final_message`, Anthropic's
    Messages API and llama.cpp always (a prefill); the engine then generates only the
    rest, and its usage counts only those new tokens.
    """
    if isinstance(messages, list) and messages:
        last = messages[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            return len(words(content_text(last.get("content"))))
    return 0


def conversation(messages: Any, system: list[str] | None = None) -> tuple[list[str], list[str]]:
    """The templated prompt and the last user turn's words of an OpenAI or Anthropic
    message list; `system` is Anthropic's top-level system prompt."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "`messages` must be a non-empty list")
    prompt = template("system", system) if system else []
    last_user: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise RequestError(400, "each message must be an object")
        turn = words(content_text(message.get("content")))
        role = message.get("role")
        prompt += template(str(role), turn)
        if role in ("user", "tool"):
            # A tool's result (OpenAI's `tool` message) is what the next answer is about.
            last_user = turn
    return prompt, last_user


def max_tokens(payload: dict[str, Any], *keys: str) -> int | None:
    """The first of `keys` present in the request, checked; None when none is."""
    for key in keys:
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(400, f"`{key}` must be a positive integer")
        return value
    return None


def check_context(limit: int, prompt_tokens: int, wanted: int | None) -> None:
    # vLLM's wording: clients and the router recognise a context overflow by it.
    if prompt_tokens > limit:
        raise RequestError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {prompt_tokens} tokens in the messages, Please reduce the "
            "length of the messages.",
        )
    if wanted is not None and prompt_tokens + wanted > limit:
        raise RequestError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {prompt_tokens + wanted} tokens ({prompt_tokens} in the "
            f"messages, {wanted} in the completion). Please reduce the length of the "
            "messages or completion.",
        )
