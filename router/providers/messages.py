"""Anthropic Messages <-> OpenAI Chat Completions, for an Anthropic client whose
fallback provider is OpenAI: the request, the whole answer, and the event stream.

As in router/providers/anthropic.py, the other direction, every field is translated or
refused with `invalid_parameter` before anything is sent; none is dropped silently.
Translated: system, messages (text, tool_use, tool_result blocks), max_tokens,
stop_sequences, temperature, top_p, tools, tool_choice (with
disable_parallel_tool_use), metadata.user_id (-> user). Decided by the router: model
and stream. Refused: top_k, thinking, images and documents, and anything else.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.errors import ErrorCode, RouterError
from router.providers.events import UsageSeen, check_error_event, parse_data, sse

_TRANSLATED = frozenset(
    {
        "system",
        "messages",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "metadata",
    }
)
_ROUTER_OWNED = frozenset({"model", "stream"})

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def unsupported(field: str) -> RouterError:
    return RouterError(
        ErrorCode.INVALID_PARAMETER,
        f"{field} is not supported by the openai provider fallback of /v1/messages",
        source="router",
    )


def invalid(message: str) -> RouterError:
    return RouterError(ErrorCode.INVALID_PARAMETER, message, source="router")


def chat_request(payload: dict[str, Any], model: str) -> dict[str, Any]:
    """The OpenAI chat body for an Anthropic Messages body; raises RouterError."""
    fields = {k: v for k, v in payload.items() if v is not None}
    for name in fields:
        if name not in _TRANSLATED and name not in _ROUTER_OWNED:
            raise unsupported(name)
    messages: list[dict[str, Any]] = []
    system = fields.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "system")})
    turns = fields.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RouterError(
            ErrorCode.REQUEST_INVALID, "messages must be a non-empty list", source="router"
        )
    for index, turn in enumerate(turns):
        messages += _turn(turn, f"messages[{index}]")
    max_tokens = fields.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise invalid("max_tokens must be a positive integer")
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    if "stop_sequences" in fields:
        stops = fields["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop_sequences must be a list of strings")
        if stops:
            body["stop"] = stops
    for name in ("temperature", "top_p"):
        if name in fields:
            value = fields[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise invalid(f"{name} must be a number")
            body[name] = value
    tools = fields.get("tools", [])
    if not isinstance(tools, list):
        raise invalid("tools must be a list")
    if tools:
        body["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if "tool_choice" in fields:
        _tool_choice(fields["tool_choice"], body)
    if "metadata" in fields:
        metadata = fields["metadata"]
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise unsupported("metadata other than user_id")
        if isinstance(metadata.get("user_id"), str):
            body["user"] = metadata["user_id"]
    return body


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise unsupported(f"{where}[{index}] (only text blocks)")
            if not isinstance(block.get("text"), str):
                raise invalid(f"{where}[{index}].text must be a string")
            texts.append(block["text"])
        return "\n".join(texts)
    raise invalid(f"{where} must be a string or a list of text blocks")


def _turn(turn: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(turn, dict):
        raise invalid(f"{where} must be an object")
    role = turn.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role must be 'user' or 'assistant'")
    content = turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(f"{at} needs a string id and name")
            function = {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{at}.tool_use_id must be a string")
            inner = block.get("content", "")
            text = _text(inner, f"{at}.content") if inner else ""
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise unsupported(f"{at} of type {kind!r}")
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    elif texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise invalid(f"{where}.name must be a string")
    if tool.get("type") not in (None, "custom"):
        raise unsupported(f"{where}.type {tool.get('type')!r}")
    function: dict[str, Any] = {
        "name": tool["name"],
        "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
    }
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: object, body: dict[str, Any]) -> None:
    if not isinstance(choice, dict):
        raise invalid("tool_choice must be an object")
    kind = choice.get("type")
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "none":
        body["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise unsupported(f"tool_choice {kind!r}")
    if choice.get("disable_parallel_tool_use") is True and "tools" in body:
        body["parallel_tool_calls"] = False


def anthropic_usage(usage: object) -> dict[str, int]:
    """Anthropic's usage for an OpenAI one: cached prompt tokens counted apart."""
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    cached = cached if isinstance(cached, int) else 0
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    return {
        "input_tokens": max(0, (prompt if isinstance(prompt, int) else 0) - cached),
        "cache_read_input_tokens": cached,
        "output_tokens": completion if isinstance(completion, int) else 0,
    }


def message_from_completion(answer: object, model: str) -> dict[str, Any]:
    """The Anthropic message for an OpenAI chat completion; ValueError when malformed."""
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("no choices in the answer")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise ValueError("a choice has no message")
    blocks: list[dict[str, Any]] = []
    if isinstance(message.get("content"), str) and message["content"]:
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call has no function name")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise ValueError("a tool call's arguments are not JSON") from None
        blocks.append(
            {"type": "tool_use", "id": call.get("id"), "name": function["name"], "input": arguments}
        )
    reason = choices[0].get("finish_reason")
    return {
        "id": answer.get("id") if isinstance(answer.get("id"), str) else "msg_openai",
        "type": "message",
        "role": "assistant",
        "model": answer.get("model") if isinstance(answer.get("model"), str) else model,
        "content": blocks,
        "stop_reason": STOP_REASONS.get(str(reason), "end_turn"),
        "stop_sequence": None,
        "usage": anthropic_usage(answer.get("usage")),
    }


class OpenAIToAnthropic:
    """OpenAI chat chunks, as they arrive, turned into Anthropic's Messages events.

    The router asks OpenAI for the usage chunk (`include_usage`); it comes after the
    finish reason, so `message_delta` (stop reason and usage) waits for it, or for
    `[DONE]`. Text and each tool call are content blocks, opened at their first delta
    and closed when the next block opens or the message ends.
    """

    def __init__(self, model: str) -> None:
        self._model = model
        self._seen = UsageSeen()
        self._started = False
        self._block = -1  # index of the open block; -1 when none is open
        self._open: str | None = None  # "text" or the OpenAI index of the open tool call
        self._calls: dict[int, int] = {}  # OpenAI tool call index -> block index
        self._stop: str | None = None
        self._raw_usage: object = None
        self._finished = False

    @property
    def usage(self) -> dict[str, int] | None:
        return self._seen.usage

    def event(self, name: str | None, data: str) -> bytes:
        if self._finished:
            return b""
        if data == "[DONE]":
            return self._finish()
        chunk = parse_data(data)
        check_error_event(chunk)
        out = b"" if self._started else self._start(chunk)
        if chunk.get("usage") is not None:
            self._raw_usage = chunk["usage"]
            self._seen.add(chunk["usage"])
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return out
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                out += self._delta(delta)
            if isinstance(choice.get("finish_reason"), str):
                self._stop = STOP_REASONS.get(choice["finish_reason"], "end_turn")
        if self._stop is not None and self._raw_usage is not None:
            out += self._finish()
        return out

    def end(self) -> bytes:
        if not self._finished:
            raise ValueError("the openai stream ended before [DONE]")
        return b""

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self._started = True
        model = chunk.get("model") if isinstance(chunk.get("model"), str) else self._model
        message = {
            "id": chunk.get("id") if isinstance(chunk.get("id"), str) else "msg_openai",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return sse({"type": "message_start", "message": message}, "message_start")

    def _delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._open != "text":
                out += self._open_block({"type": "text", "text": ""})
                self._open = "text"
            body = {
                "type": "content_block_delta",
                "index": self._block,
                "delta": {"type": "text_delta", "text": text},
            }
            out += sse(body, "content_block_delta")
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict) or not isinstance(call.get("index"), int):
                continue
            function = call.get("function") if isinstance(call.get("function"), dict) else {}
            if call["index"] not in self._calls:
                block = {
                    "type": "tool_use",
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "input": {},
                }
                out += self._open_block(block)
                self._calls[call["index"]] = self._block
                self._open = str(call["index"])
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                body = {
                    "type": "content_block_delta",
                    "index": self._calls[call["index"]],
                    "delta": {"type": "input_json_delta", "partial_json": arguments},
                }
                out += sse(body, "content_block_delta")
        return out

    def _open_block(self, block: dict[str, Any]) -> bytes:
        out = self._close_block()
        self._block += 1
        body = {"type": "content_block_start", "index": self._block, "content_block": block}
        return out + sse(body, "content_block_start")

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return sse({"type": "content_block_stop", "index": self._block}, "content_block_stop")

    def _finish(self) -> bytes:
        if not self._started:
            raise ValueError("the openai stream ended before any chunk")
        self._finished = True
        delta = {"stop_reason": self._stop or "end_turn", "stop_sequence": None}
        body = {"type": "message_delta", "delta": delta, "usage": anthropic_usage(self._raw_usage)}
        return (
            self._close_block()
            + sse(body, "message_delta")
            + sse({"type": "message_stop"}, "message_stop")
        )
