"""A finished `chat.completion` replayed as an OpenAI Chat Completions event stream.

Providers are called without streaming, so a client that asked for a stream gets the
whole answer at once, but in the chunk sequence OpenAI sends and SDKs parse: a role
chunk, the content, the tool calls, a chunk with the finish reason, the usage chunk
when `stream_options.include_usage` asked for it, and `[DONE]`.
"""

from __future__ import annotations

import json
from typing import Any


def completion_to_sse(completion: dict[str, Any], include_usage: bool) -> bytes:
    base: dict[str, Any] = {
        "id": completion.get("id"),
        "object": "chat.completion.chunk",
        "created": completion.get("created"),
        "model": completion.get("model"),
    }
    if completion.get("system_fingerprint") is not None:
        base["system_fingerprint"] = completion["system_fingerprint"]
    events: list[bytes] = []

    def emit(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        chunk = {**base, "choices": choices}
        # With include_usage OpenAI sends `usage: null` on every chunk but the last.
        if include_usage:
            chunk["usage"] = usage
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

    for position, choice in enumerate(completion["choices"]):
        index = choice.get("index", position)
        message = choice["message"]

        def delta(
            fields: dict[str, Any],
            finish_reason: str | None = None,
            logprobs: object = None,
            index: int = index,
        ) -> None:
            emit(
                [
                    {
                        "index": index,
                        "delta": fields,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                    }
                ]
            )

        delta({"role": "assistant", "content": ""})
        if message.get("content"):
            # One chunk carries the whole text, so it carries the whole logprobs too.
            delta({"content": message["content"]}, logprobs=choice.get("logprobs"))
        if message.get("refusal"):
            delta({"refusal": message["refusal"]})
        for call_index, call in enumerate(message.get("tool_calls") or []):
            delta({"tool_calls": [{"index": call_index, **call}]})
        delta({}, finish_reason=choice.get("finish_reason") or "stop")

    if include_usage and completion.get("usage") is not None:
        emit([], usage=completion["usage"])
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)
