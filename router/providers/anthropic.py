"""OpenAI Chat Completions <-> Anthropic Messages, for the provider fallback.

The client spoke OpenAI; Anthropic is asked in its own format and its answer is turned
back into a `chat.completion`. Every top-level field is either translated, accepted
because it cannot change the answer, accepted at its no-op value only, or refused with
`invalid_parameter` before anything is sent: a field the adapter cannot carry is never
dropped silently, because the client would get an answer to a different question.

Translated: messages, max_tokens / max_completion_tokens (default 4096), stop,
temperature (0-1; Anthropic's range is narrower than OpenAI's), top_p, tools,
tool_choice, parallel_tool_calls, user (-> metadata.user_id).
Decided by the router: model (the policy's provider model), stream and stream_options
(the provider is always called without streaming; the router re-streams the answer).
Ignored: store, metadata, service_tier (OpenAI platform bookkeeping) and a message's
`name` (Anthropic has no speaker names; the role still says who spoke).
No-op values only: n=1, logprobs=false, presence_penalty=0, frequency_penalty=0,
logit_bias={}, response_format={"type":"text"}, modalities=["text"].
A field set to null counts as absent, as it does for OpenAI.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from protocol.errors import ErrorCode, RouterError

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096

_TRANSLATED = frozenset(
    {
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "user",
    }
)
_ROUTER_OWNED = frozenset({"model", "stream", "stream_options"})
_IGNORED = frozenset({"store", "metadata", "service_tier"})
_NO_OP: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1 and not isinstance(v, bool),
    "logprobs": lambda v: v is False,
    "presence_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "frequency_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "logit_bias": lambda v: v == {},
    "response_format": lambda v: v == {"type": "text"},
    "modalities": lambda v: v == ["text"],
}

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def unsupported(field: str) -> RouterError:
    return RouterError(
        ErrorCode.INVALID_PARAMETER,
        f"{field} is not supported by the anthropic provider fallback",
        source="router",
    )


def invalid(message: str) -> RouterError:
    return RouterError(ErrorCode.INVALID_PARAMETER, message, source="router")


def messages_request(payload: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages request for an OpenAI chat body; raises RouterError when refused."""
    fields = {k: v for k, v in payload.items() if v is not None}
    for name, value in fields.items():
        if name in _TRANSLATED or name in _ROUTER_OWNED or name in _IGNORED:
            continue
        accepts = _NO_OP.get(name)
        if accepts is None or not accepts(value):
            raise unsupported(name)

    system, turns = _conversation(fields.get("messages"))
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": _max_tokens(fields),
        "messages": turns,
    }
    if system:
        body["system"] = system
    if "stop" in fields:
        stops = _stop_sequences(fields["stop"])
        if stops:
            body["stop_sequences"] = stops
    if "temperature" in fields:
        temperature = _number(fields["temperature"], "temperature")
        if temperature > 1:
            raise unsupported("temperature above 1")
        if temperature < 0:
            raise invalid("temperature must not be negative")
        body["temperature"] = temperature
    if "top_p" in fields:
        body["top_p"] = _number(fields["top_p"], "top_p")
    tools = _tools(fields.get("tools", []))
    if tools:
        body["tools"] = tools
    choice = _tool_choice(fields.get("tool_choice"), bool(tools))
    parallel = fields.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean")
    if not parallel and tools:
        choice = choice or {"type": "auto"}
        # Anthropic's `none` choice takes no parallelism flag; no calls, nothing to limit.
        if choice["type"] != "none":
            choice["disable_parallel_tool_use"] = True
    if choice is not None:
        body["tool_choice"] = choice
    if "user" in fields:
        if not isinstance(fields["user"], str):
            raise invalid("user must be a string")
        body["metadata"] = {"user_id": fields["user"]}
    return body


def completion_from_message(answer: object, model: str) -> dict[str, Any]:
    """The OpenAI `chat.completion` for an Anthropic message; ValueError when malformed."""
    if not isinstance(answer, dict) or not isinstance(answer.get("content"), list):
        raise ValueError("no content list in the answer")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in answer["content"]:
        if not isinstance(block, dict):
            raise ValueError("a content block is not an object")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise ValueError("a text block has no text")
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ValueError("a tool_use block has no id or name")
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {
                        "name": block["name"],
                        "arguments": json.dumps(block.get("input", {})),
                    },
                }
            )
        # Other blocks (thinking, server tools) only appear for features never requested.
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    stop_reason = answer.get("stop_reason")
    return {
        "id": answer.get("id") or "chatcmpl-anthropic",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": answer.get("model") if isinstance(answer.get("model"), str) else model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": FINISH_REASONS.get(str(stop_reason), "stop"),
            }
        ],
        "usage": openai_usage(answer.get("usage")),
    }


def openai_usage(usage: object) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}

    def count(key: str) -> int:
        value = usage.get(key)
        return value if isinstance(value, int) else 0

    # Anthropic counts cached prompt tokens apart; OpenAI's prompt_tokens includes them.
    cached = count("cache_read_input_tokens")
    prompt = count("input_tokens") + count("cache_creation_input_tokens") + cached
    completion = count("output_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _max_tokens(fields: dict[str, Any]) -> int:
    # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one.
    name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    value = fields.get(name, DEFAULT_MAX_TOKENS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{name} must be a positive integer")
    return value


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{name} must be a number")
    return value


def _stop_sequences(stop: object) -> list[str]:
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise invalid("stop must be a string or a list of strings")


def _conversation(messages: object) -> tuple[str, list[dict[str, Any]]]:
    """System text and the user/assistant turns, consecutive same-role turns merged."""
    if not isinstance(messages, list) or not messages:
        raise RouterError(
            ErrorCode.REQUEST_INVALID, "messages must be a non-empty list", source="router"
        )
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object")
        role = message.get("role")
        allowed = {"role", "content", "name"}
        if role in ("system", "developer"):
            _check_keys(message, allowed, where)
            system.append(_plain_text(message.get("content"), where))
            continue
        if role == "user":
            _check_keys(message, allowed, where)
            blocks = _text_blocks(message.get("content"), where)
        elif role == "assistant":
            _check_keys(message, allowed | {"tool_calls"}, where)
            blocks = _text_blocks(message.get("content"), where)
            blocks += _tool_uses(message.get("tool_calls"), where)
        elif role == "tool":
            _check_keys(message, allowed | {"tool_call_id"}, where)
            role = "user"
            blocks = [_tool_result(message, where)]
        else:
            raise unsupported(f"{where}.role {role!r}")
        # Anthropic rejects empty turns; an empty message carries nothing to lose.
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(s for s in system if s), turns


def _check_keys(message: dict[str, Any], allowed: set[str], where: str) -> None:
    for key, value in message.items():
        if key not in allowed and value is not None:
            raise unsupported(f"{where}.{key}")


def _parts(content: object, where: str) -> list[str]:
    """The texts of a string or a list of content parts; other parts are refused."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts")
    texts: list[str] = []
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"{where}.content[{index}] must be an object")
        kind = part.get("type")
        if kind != "text":
            name = {"image_url": "image", "input_audio": "audio"}.get(str(kind), kind)
            raise unsupported(f"{name} content ({where}.content[{index}])")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.content[{index}].text must be a string")
        texts.append(part["text"])
    return texts


def _plain_text(content: object, where: str) -> str:
    return "\n".join(_parts(content, where))


def _text_blocks(content: object, where: str) -> list[dict[str, Any]]:
    # Anthropic refuses empty text blocks.
    return [{"type": "text", "text": text} for text in _parts(content, where) if text]


def _tool_uses(calls: object, where: str) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls must be a list")
    blocks: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        if not isinstance(call, dict):
            raise invalid(f"{at} must be an object")
        if call.get("type", "function") != "function":
            raise unsupported(f"{at}.type {call.get('type')!r}")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{at}.function.name must be a string")
        if not isinstance(call.get("id"), str):
            raise invalid(f"{at}.id must be a string")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise invalid(f"{at}.function.arguments must be a JSON object string") from None
        if not isinstance(arguments, dict):
            raise invalid(f"{at}.function.arguments must be a JSON object string")
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}
        )
    return blocks


def _tool_result(message: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise invalid(f"{where}.tool_call_id must be a string")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    text = _plain_text(message.get("content"), where)
    if text:
        block["content"] = text
    return block


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("tools must be a list")
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(f"{at} must be an object")
        if tool.get("type") != "function":
            raise unsupported(f"{at}.type {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{at}.function.name must be a string")
        # Strict schema adherence is a promise Anthropic's tools do not make.
        if function.get("strict"):
            raise unsupported(f"{at}.function.strict")
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        converted: dict[str, Any] = {"name": function["name"], "input_schema": schema}
        if function.get("description"):
            converted["description"] = function["description"]
        out.append(converted)
    return out


def _tool_choice(choice: object, has_tools: bool) -> dict[str, Any] | None:
    if choice is None:
        return None
    if choice in ("auto", "none") and not has_tools:
        # Without tools both mean "answer in text", which is what happens anyway.
        return None
    if choice == "auto":
        return {"type": "auto"}
    if choice == "none":
        return {"type": "none"}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid("tool_choice.function.name must be a string")
        return {"type": "tool", "name": function["name"]}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise unsupported(f"tool_choice {kind!r}")
