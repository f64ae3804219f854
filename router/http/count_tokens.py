"""Anthropic's `POST /v1/messages/count_tokens`, answered by an engine's tokenizer.

The request is routed like any other (policy steps, gates, slots, queue) to an agent
of the model whose engine tokenizes over HTTP: vLLM's `/tokenize` takes the chat and
applies the model's chat template, so its count is what the prompt costs; SGLang's
takes text only, so its count leaves out the template's few tokens; llama.cpp's takes
text as `content` and answers the token ids without a count, and its agent first has
the engine's `/apply-template` make the conversation its prompt, template included.
Agents of vLLM (and the simulated engine, which speaks vLLM's API) are preferred when
the model has any, then SGLang's, then llama.cpp's; the engine's `{"count": N, ...}`
(or its `tokens`, counted) becomes Anthropic's `{"input_tokens": N}`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from protocol.errors import ErrorCode, RouterError
from protocol.frames import MAX_FRAME_BYTES
from protocol.logs import quote
from router.link import AgentResponse, StreamBroken
from router.peers import Peer
from router.session import RouteRequest

log = logging.getLogger("http")

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
TOKENIZE_PATH = "/tokenize"
# Engines whose `/tokenize` accepts `{"model", "messages"}` (vLLM's chat form).
CHAT_TOKENIZERS = frozenset({"vllm", "sim"})
# Engines whose `/tokenize` accepts `{"model", "prompt"}` only (SGLang).
TEXT_TOKENIZERS = frozenset({"sglang"})
# Engines whose `/tokenize` takes `{"content"}` and answers `{"tokens": [...]}` only
# (llama.cpp's llama-server).
CONTENT_TOKENIZERS = frozenset({"llamacpp"})
TOKENIZERS = CHAT_TOKENIZERS | TEXT_TOKENIZERS | CONTENT_TOKENIZERS
# llama.cpp's count carries the conversation beside its text (its agent has the engine
# template it): a body up to half a link frame (16 MiB), headers and all well within
# it. Past it, a conversation of a million tokens or more, the text alone is counted.
MAX_TEMPLATED_BYTES = MAX_FRAME_BYTES // 2


def to_tokenize(req: RouteRequest, payload: dict, pool: Sequence[Peer]) -> None:
    """Turn `req` into the engine's `/tokenize` call for the agents in `pool`, in place.

    Raises RouterError: `tokenizer_unavailable` when the model has agents but none
    can tokenize, `request_invalid` for a body Anthropic's API would refuse too.
    """
    engines = {peer.metadata.engine for peer in pool}
    messages = _messages(payload)
    tools = _tools(payload.get("tools"))
    if engines & CHAT_TOKENIZERS or not pool:
        # No agent at all: routing answers model_not_found, as for any endpoint.
        chat: dict = {"model": req.model, "messages": messages}
        if tools:
            chat["tools"] = tools
        body = _encoded(chat)
        req.engines = CHAT_TOKENIZERS
    elif engines & TEXT_TOKENIZERS:
        body = _encoded({"model": req.model, "prompt": _joined(messages, tools)})
        req.engines = TEXT_TOKENIZERS
    elif engines & CONTENT_TOKENIZERS:
        body = _content(messages, tools)
        req.engines = CONTENT_TOKENIZERS
    else:
        known = ", ".join(sorted(TOKENIZERS))
        raise RouterError(
            ErrorCode.TOKENIZER_UNAVAILABLE,
            f"token counting needs an agent whose engine has a tokenizer endpoint ({known});"
            f" model {req.model!r} is served by: {', '.join(sorted(engines))}",
        )
    req.path = TOKENIZE_PATH
    req.body = body
    req.stream = False


def _content(messages: list[dict], tools: list[dict]) -> bytes:
    """llama.cpp's body: the text as `content`, with the beginning-of-text token counted
    as the engine adds it to a prompt; and the conversation beside it, which the agent
    has the engine template first (agent/chat_template.py; the engine ignores it, and
    so an agent without that step counts the text), where both fit the link's frame."""
    text = _joined(messages, tools)
    body: dict = {"content": text, "add_special": True, "messages": messages}
    if tools:
        body["tools"] = tools
    encoded = _encoded(body)
    if len(encoded) <= MAX_TEMPLATED_BYTES:
        return encoded
    return _encoded({"content": text, "add_special": True})


def _encoded(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


async def answer(req: RouteRequest, response: AgentResponse) -> dict | RouterError:
    """The client's answer, `{"input_tokens": N}` from the engine's count, or the error
    to answer with."""
    try:
        return input_tokens(await response.read_all())
    except StreamBroken as exc:
        err = RouterError(ErrorCode.BACKEND_ERROR, f"answer interrupted: {exc}")
    except RouterError as exc:
        err = exc
    finally:
        response.close()
    log.warning(
        "req=%s count_tokens_failed reason=%s tenant=%s",
        req.request_id,
        quote(err.message),
        quote(req.tenant),
    )
    return err


def input_tokens(body: bytes) -> dict:
    """Anthropic's answer from the engine's `/tokenize` answer: its `count`, or as many
    as its `tokens` where it gives no count (llama.cpp)."""
    try:
        answer = json.loads(body)
        count = answer.get("count")
        if count is None and isinstance(answer.get("tokens"), list):
            count = len(answer["tokens"])
    except (ValueError, UnicodeDecodeError, AttributeError):
        count = None
    if isinstance(count, bool) or not isinstance(count, int):
        raise RouterError(
            ErrorCode.BACKEND_ERROR,
            "the engine's /tokenize answer has no integer 'count' nor a 'tokens' list",
            "backend",
        )
    return {"input_tokens": count}


def _joined(messages: list[dict], tools: list[dict]) -> str:
    """The conversation as the text a text-only tokenizer counts."""
    return "\n".join([m["content"] for m in messages] + [json.dumps(t) for t in tools])


def _messages(payload: dict) -> list[dict]:
    """Anthropic's system and messages as chat messages with text content."""
    raw = payload.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages: must be a non-empty list")
    out: list[dict] = []
    system = payload.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _invalid(f"messages[{i}]: must be an object")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _invalid(f"messages[{i}].role: must be 'user' or 'assistant'")
        out.append({"role": role, "content": _text(message.get("content"), f"messages[{i}]")})
    return out


def _text(content: object, where: str) -> str:
    """The countable text of a content string or block list; other blocks are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where}.content: must be a string or a list of content blocks")
    parts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            parts.append(block["thinking"])
        elif kind == "tool_use":
            parts.append(json.dumps({"name": block.get("name"), "input": block.get("input")}))
        elif kind == "tool_result":
            inner = block.get("content", "")
            parts.append(_text(inner, f"{where}.content[{j}]"))
        else:
            raise _invalid(
                f"{where}.content[{j}]: the router counts text, thinking, tool_use and"
                f" tool_result blocks only, got {kind!r}"
            )
    return "\n".join(parts)


def _tools(raw: object) -> list[dict]:
    """Anthropic tool definitions in the OpenAI form chat templates read."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _invalid("tools: must be a list")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _invalid(f"tools[{i}]: must be an object with a name")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _invalid(message: str) -> RouterError:
    return RouterError(ErrorCode.REQUEST_INVALID, message)
