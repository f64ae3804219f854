"""Anthropic's Messages event stream, turned into OpenAI chat chunks as it arrives.

For an OpenAI client whose fallback provider is Anthropic. Each Anthropic event
becomes at most one `chat.completion.chunk`, in the order OpenAI sends them and the
SDKs parse them: `message_start` the role chunk, a text delta a content chunk, a
`tool_use` block's start a tool call (id, name, empty arguments) and each of its
`input_json_delta`s an arguments fragment of that call, `message_delta` the finish
reason, `message_stop` the usage chunk (when `stream_options.include_usage` asked for
it) and `[DONE]`. An `error` event raises ProviderErrorEvent (router/providers/events.py).
"""

from __future__ import annotations

import time
from typing import Any

from router.providers.anthropic import FINISH_REASONS, openai_usage
from router.providers.events import UsageSeen, check_error_event, parse_data, sse


class AnthropicToOpenAI:
    def __init__(self, model: str, include_usage: bool) -> None:
        self._model = model
        self._include_usage = include_usage
        self._seen = UsageSeen()
        self._raw_usage: dict[str, Any] = {}
        self._base: dict[str, Any] = {}
        # Anthropic block index -> OpenAI tool call index, for tool_use blocks.
        self._calls: dict[int, int] = {}
        self._finished = False

    @property
    def usage(self) -> dict[str, int] | None:
        return self._seen.usage

    def event(self, name: str | None, data: str) -> bytes:
        value = parse_data(data)
        check_error_event(value)
        kind = value.get("type")
        if kind == "message_start":
            message = value.get("message")
            message = message if isinstance(message, dict) else {}
            model = message.get("model")
            self._base = {
                "id": message.get("id") if isinstance(message.get("id"), str) else "chatcmpl",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model if isinstance(model, str) else self._model,
            }
            self._usage(message.get("usage"))
            return self._chunk({"role": "assistant", "content": ""})
        if kind == "content_block_start":
            block = value.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                index = value.get("index")
                key = index if isinstance(index, int) else -1
                call = self._calls.setdefault(key, len(self._calls))
                function = {"name": block.get("name"), "arguments": ""}
                tool = {"index": call, "id": block.get("id"), "type": "function"}
                tool["function"] = function
                return self._chunk({"tool_calls": [tool]})
            return b""
        if kind == "content_block_delta":
            delta = value.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                return self._chunk({"content": delta["text"]})
            if delta.get("type") == "input_json_delta":
                index = value.get("index")
                call = self._calls.get(index) if isinstance(index, int) else None
                fragment = delta.get("partial_json")
                if call is None or not isinstance(fragment, str):
                    return b""
                tool = {"index": call, "function": {"arguments": fragment}}
                return self._chunk({"tool_calls": [tool]})
            return b""  # thinking and signature deltas: never asked for
        if kind == "message_delta":
            self._usage(value.get("usage"))
            delta = value.get("delta")
            reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            return self._chunk({}, FINISH_REASONS.get(str(reason), "stop"))
        if kind == "message_stop":
            self._finished = True
            out = b""
            if self._include_usage:
                usage = openai_usage(self._raw_usage)
                out = sse({**self._base, "choices": [], "usage": usage})
            return out + sse("[DONE]")
        return b""  # ping, and event types added later

    def end(self) -> bytes:
        if not self._finished:
            raise ValueError("the anthropic stream ended before message_stop")
        return b""

    def _usage(self, raw: object) -> None:
        if isinstance(raw, dict):
            self._raw_usage.update({k: v for k, v in raw.items() if v is not None})
            self._seen.add(self._raw_usage)

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk: dict[str, Any] = {**self._base, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return sse(chunk)
