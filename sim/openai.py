"""OpenAI's API as vLLM serves it: chat completions, legacy completions, responses,
embeddings.

Stream chunks are built from pre-encoded pieces: benchmarks use the sim as the baseline
engine, so the request path does no per-chunk JSON encoding beyond the token's text.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from sim.asgi import SSE_DONE, SSE_HEADERS, Exchange, dumps, sse_event
from sim.generation import (
    Job,
    RequestError,
    Run,
    conversation,
    max_tokens,
    prefilled,
    template,
    words,
)
from sim.tools import ToolCall, scripted_call

if TYPE_CHECKING:
    from sim.app import SimEngine

# Legacy completions default to 16 tokens in OpenAI's API and in vLLM.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Bounds the work one request can ask for; real embedding models stay far below.
MAX_EMBEDDING_DIM = 65536


def error_body(error: RequestError) -> bytes:
    """vLLM's error shape for the OpenAI endpoints."""
    return dumps(
        {
            "object": "error",
            "message": error.message,
            "type": error.kind,
            "param": None,
            "code": error.status,
        }
    )


def _include_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _continuous_usage(payload: dict[str, Any]) -> bool:
    """vLLM's `continuous_usage_stats`: every chunk carries the usage so far (only with
    `include_usage`, as vLLM reads it)."""
    options = payload.get("stream_options")
    return _include_usage(payload) and options.get("continuous_usage_stats") is True


# Chat ---------------------------------------------------------------------------------


def continued(payload: dict[str, Any]) -> int:
    """The answer words a `continue_final_message` request already holds, checked as
    vLLM checks it; without the flag a final assistant message starts a new turn."""
    if payload.get("continue_final_message") is not True:
        return 0
    if payload.get("add_generation_prompt", True) is not False:
        raise RequestError(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    messages = payload.get("messages")
    if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)):
        raise RequestError(400, "`messages` must be a non-empty list")
    if messages[-1].get("role") != "assistant":
        raise RequestError(400, "continue_final_message needs a final assistant message")
    return prefilled(messages)


def prepare_chat(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    prompt, last_user = conversation(payload.get("messages"))
    limit = max_tokens(payload, "max_completion_tokens", "max_tokens")
    call = scripted_call(payload)
    if call is not None:
        job = engine.tool_job(prompt, call, limit, started)
        if payload.get("stream") is True:
            return partial(_chat_tool_stream, engine, job, call, _include_usage(payload))
        return partial(_chat_tool_full, engine, job, call)
    job = engine.job(prompt, last_user, limit, payload, started, continued(payload))
    if payload.get("stream") is True:
        usage = _include_usage(payload), _continuous_usage(payload)
        return partial(_chat_stream, engine, job, *usage)
    return partial(_chat_full, engine, job)


def _chat_completion(engine: SimEngine, job: Job, number: int, message: dict) -> bytes:
    """A whole `chat.completion` with its one choice."""
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": job.finish}
    return dumps(
        {
            "id": f"chatcmpl-sim{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": engine.model,
            "choices": [choice],
            "usage": job.usage(),
        }
    )


async def _chat_full(engine: SimEngine, job: Job, exchange: Exchange) -> None:
    await engine.generate(job, None)
    message = {"role": "assistant", "content": "".join(job.pieces)}
    await exchange.reply(200, _chat_completion(engine, job, engine.next_id(), message))


async def _chat_stream(
    engine: SimEngine, job: Job, include_usage: bool, continuous: bool, exchange: Exchange
) -> None:
    request_id, created = f"chatcmpl-sim{engine.next_id()}", int(time.time())
    head = (
        b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,'
        b'"choices":[{"index":0,"delta":{'
    ) % (request_id.encode(), created, engine.model_json)

    def tail(finish: bytes) -> bytes:
        choice = b'},"logprobs":null,"finish_reason":' + finish + b"}]"
        if not continuous:
            return choice + b"}\n\n"
        prompt, completion = job.prompt_tokens, job.emitted
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return choice + b',"usage":' + dumps(usage) + b"}\n\n"

    open_tail = tail(b"null")
    role = head + b'"role":"assistant","content":""' + open_tail

    async def emit(index: int, piece: str) -> None:
        data = head + b'"content":' + dumps(piece) + (tail(b"null") if continuous else open_tail)
        await exchange.chunk(role + data if index == 0 else data)

    await exchange.start(200, SSE_HEADERS)
    await engine.generate(job, emit)
    end = head + tail(b'"%s"' % job.finish.encode())
    kind = "chat.completion.chunk"
    await _finish_stream(engine, exchange, end, request_id, created, kind, job, include_usage)


async def _chat_tool_full(engine: SimEngine, job: Job, call: ToolCall, exchange: Exchange) -> None:
    await engine.generate(job, None)
    number = engine.next_id()
    tool_call = {
        "id": f"call_sim{number}",
        "type": "function",
        "function": {"name": call.name, "arguments": "".join(job.pieces)},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    await exchange.reply(200, _chat_completion(engine, job, number, message))


async def _chat_tool_stream(
    engine: SimEngine, job: Job, call: ToolCall, include_usage: bool, exchange: Exchange
) -> None:
    """A tool call as vLLM streams one: the role, then the call's id and name with empty
    arguments, then the arguments in fragments, then `finish_reason: tool_calls`."""
    number = engine.next_id()
    request_id, created = f"chatcmpl-sim{number}", int(time.time())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created}
    base["model"] = engine.model

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: " + dumps({**base, "choices": [choice]}) + b"\n\n"

    opened = {"index": 0, "id": f"call_sim{number}", "type": "function"}
    opened["function"] = {"name": call.name, "arguments": ""}
    head = chunk({"role": "assistant", "content": ""}) + chunk({"tool_calls": [opened]})

    async def emit(index: int, piece: str) -> None:
        data = chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        await exchange.chunk(head + data if index == 0 else data)

    await exchange.start(200, SSE_HEADERS)
    await engine.generate(job, emit)
    end = chunk({}, job.finish)
    kind = "chat.completion.chunk"
    await _finish_stream(engine, exchange, end, request_id, created, kind, job, include_usage)


async def _finish_stream(
    engine: SimEngine,
    exchange: Exchange,
    end: bytes,
    request_id: str,
    created: int,
    kind: str,
    job: Job,
    include_usage: bool,
) -> None:
    """The last chunk, the usage chunk when asked for (`stream_options`), `[DONE]`."""
    if include_usage:
        usage = {
            "id": request_id,
            "object": kind,
            "created": created,  # every chunk of a stream has the same, as vLLM's
            "model": engine.model,
            "choices": [],
            "usage": job.usage(),
        }
        end += b"data: " + dumps(usage) + b"\n\n"
    await exchange.finish(end + SSE_DONE)


# Legacy completions -------------------------------------------------------------------


def prepare_completion(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError(400, "`prompt` must be a string (one prompt per request)")
    prompt_words = words(prompt)
    limit = max_tokens(payload, "max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS
    # A raw prompt gets no chat template: its words are tagged with no role.
    job = engine.job(template("", prompt_words), prompt_words, limit, payload, started)
    if payload.get("stream") is True:
        return partial(_completion_stream, engine, job, _include_usage(payload))
    return partial(_completion_full, engine, job)


async def _completion_full(engine: SimEngine, job: Job, exchange: Exchange) -> None:
    await engine.generate(job, None)
    body = {
        "id": f"cmpl-sim{engine.next_id()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.model,
        "choices": [
            {
                "index": 0,
                "text": "".join(job.pieces),
                "logprobs": None,
                "finish_reason": job.finish,
            }
        ],
        "usage": job.usage(),
    }
    await exchange.reply(200, dumps(body))


async def _completion_stream(
    engine: SimEngine, job: Job, include_usage: bool, exchange: Exchange
) -> None:
    request_id, created = f"cmpl-sim{engine.next_id()}", int(time.time())
    head = (
        b'data: {"id":"%s","object":"text_completion","created":%d,"model":%s,'
        b'"choices":[{"index":0,"text":'
    ) % (request_id.encode(), created, engine.model_json)

    async def emit(index: int, piece: str) -> None:
        await exchange.chunk(head + dumps(piece) + b',"logprobs":null,"finish_reason":null}]}\n\n')

    await exchange.start(200, SSE_HEADERS)
    await engine.generate(job, emit)
    end = head + b'"","logprobs":null,"finish_reason":"%s"}]}\n\n' % job.finish.encode()
    kind = "text_completion"
    await _finish_stream(engine, exchange, end, request_id, created, kind, job, include_usage)


# Embeddings ---------------------------------------------------------------------------


def embedding(key: bytes, dim: int) -> list[float]:
    """A unit vector that is a function of the input alone (tests recompute it)."""
    raw = struct.unpack(f"<{dim}H", hashlib.shake_256(key).digest(2 * dim))
    vector = [v / 32767.5 - 1.0 for v in raw]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def prepare_embeddings(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    items = payload.get("input")
    if isinstance(items, str) or (
        isinstance(items, list) and items and all(isinstance(t, int) for t in items)
    ):
        items = [items]
    if not isinstance(items, list) or not items:
        raise RequestError(400, "`input` must be a string, a list of strings or token ids")
    inputs: list[tuple[bytes, int]] = []
    for item in items:
        if isinstance(item, str):
            inputs.append((item.encode(), len(words(item))))
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            inputs.append((dumps(item), len(item)))
        else:
            raise RequestError(400, "`input` items must be strings or lists of token ids")
    for _, tokens in inputs:
        if tokens > engine.max_context:
            raise RequestError(
                400,
                f"This model's maximum context length is {engine.max_context} tokens. "
                f"However, you requested {tokens} tokens in the input for embedding "
                "generation. Please reduce the length of the input.",
            )
    dim = payload.get("dimensions") or engine.embedding_dim
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 < dim <= MAX_EMBEDDING_DIM:
        raise RequestError(400, f"`dimensions` must be an integer in [1, {MAX_EMBEDDING_DIM}]")
    encoding = payload.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise RequestError(400, "`encoding_format` must be 'float' or 'base64'")
    return partial(_embeddings, engine, inputs, dim, encoding == "base64")


async def _embeddings(
    engine: SimEngine,
    inputs: list[tuple[bytes, int]],
    dim: int,
    as_base64: bool,
    exchange: Exchange,
) -> None:
    prompt_tokens = sum(tokens for _, tokens in inputs)
    await engine.prefill(prompt_tokens)
    data = []
    for index, (key, _) in enumerate(inputs):
        vector = embedding(key, dim)
        encoded: list[float] | str = (
            base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode() if as_base64 else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    body = {
        "id": f"embd-sim{engine.next_id()}",
        "object": "list",
        "created": int(time.time()),
        "model": engine.model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    await exchange.reply(200, dumps(body))


# Responses ----------------------------------------------------------------------------


def prepare_response(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    """OpenAI's Responses API, stateless, as vLLM serves it: `input` is a string or a
    list of message items; `instructions` is the system prompt."""
    items = payload.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError(400, "`input` must be a string or a non-empty list of items")
    # Items without a role (a tool call's output) carry no text the sim generates from.
    messages = [item for item in items if isinstance(item, dict) and "role" in item]
    instructions = payload.get("instructions")
    system = words(instructions) if isinstance(instructions, str) else None
    prompt, last_user = conversation(messages, system)
    limit = max_tokens(payload, "max_output_tokens")
    job = engine.job(prompt, last_user, limit, payload, started)
    response_id = f"resp_sim{engine.next_id()}"
    if payload.get("stream") is True:
        return partial(_response_stream, engine, job, response_id)
    return partial(_response_full, engine, job, response_id)


def _response_usage(job: Job) -> dict[str, Any]:
    prompt, completion = job.prompt_tokens, len(job.pieces)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": job.cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _response_object(
    engine: SimEngine, job: Job, response_id: str, status: str, text: str | None
) -> dict[str, Any]:
    output = []
    if text is not None:
        output.append(
            {
                "type": "message",
                "id": f"msg_{response_id}",
                "status": "completed",
                "role": "assistant",
                "content": [_output_text(text)],
            }
        )
    done = status != "in_progress"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if done and job.finish == "length" else status,
        "model": engine.model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": _response_usage(job) if done else None,
    }


async def _response_full(engine: SimEngine, job: Job, response_id: str, exchange: Exchange) -> None:
    await engine.generate(job, None)
    body = _response_object(engine, job, response_id, "completed", "".join(job.pieces))
    await exchange.reply(200, dumps(body))


async def _response_stream(
    engine: SimEngine, job: Job, response_id: str, exchange: Exchange
) -> None:
    item_id = f"msg_{response_id}"
    sequence = 0

    def event(kind: str, fields: dict[str, Any]) -> bytes:
        nonlocal sequence
        sequence += 1
        return sse_event(kind, {"type": kind, "sequence_number": sequence - 1, **fields})

    created = _response_object(engine, job, response_id, "in_progress", None)
    # The message item and its text part are announced before their first delta, and
    # closed after the last, as OpenAI streams them: the openai SDK's stream helper
    # (`client.responses.stream`) refuses a delta for an item it was not told of.
    part = {"item_id": item_id, "output_index": 0, "content_index": 0}

    def item(status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [_output_text(text)]
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    async def emit(index: int, piece: str) -> None:
        await exchange.chunk(event("response.output_text.delta", {**part, "delta": piece}))

    await exchange.start(200, SSE_HEADERS)
    await exchange.chunk(
        event("response.created", {"response": created})
        + event(
            "response.output_item.added", {"output_index": 0, "item": item("in_progress", None)}
        )
        + event("response.content_part.added", {**part, "part": _output_text("")})
    )
    await engine.generate(job, emit)
    text = "".join(job.pieces)
    done = _response_object(engine, job, response_id, "completed", text)
    await exchange.finish(
        event("response.output_text.done", {**part, "text": text})
        + event("response.content_part.done", {**part, "part": _output_text(text)})
        + event("response.output_item.done", {"output_index": 0, "item": item("completed", text)})
        + event("response.completed", {"response": done})
    )


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
