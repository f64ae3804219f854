"""Anthropic's Messages API (`/v1/messages`), plain and streamed, with its error shape."""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any

from sim.asgi import SSE_HEADERS, Exchange, dumps, sse_event
from sim.generation import (
    Job,
    RequestError,
    Run,
    content_text,
    conversation,
    max_tokens,
    prefilled,
    words,
)
from sim.tools import ToolCall, scripted_call

if TYPE_CHECKING:
    from sim.app import SimEngine


def error_body(error: RequestError) -> bytes:
    kind = "not_found_error" if error.status == 404 else "invalid_request_error"
    return dumps({"type": "error", "error": {"type": kind, "message": error.message}})


def prepare_messages(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    limit = max_tokens(payload, "max_tokens")
    if limit is None:
        # Required by Anthropic's API, unlike OpenAI's.
        raise RequestError(400, "max_tokens: Field required")
    system = words(content_text(payload.get("system")))
    prompt, last_user = conversation(payload.get("messages"), system)
    call = scripted_call(payload)
    if call is not None:
        job = engine.tool_job(prompt, call, limit, started)
        if payload.get("stream") is True:
            return partial(_tool_use_stream, engine, job, call)
        return partial(_tool_use_full, engine, job, call)
    # A final assistant message is a prefill: the answer goes on from it.
    job = engine.job(prompt, last_user, limit, payload, started, prefilled(payload["messages"]))
    if payload.get("stream") is True:
        return partial(_messages_stream, engine, job)
    return partial(_messages_full, engine, job)


def _stop_reason(job: Job) -> str:
    return _STOP_REASONS.get(job.finish, "end_turn")


_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _message(engine: SimEngine, job: Job, number: int, content: list, done: bool) -> dict:
    """A Messages API message: the whole answer when `done`, else the head of a stream
    (no stop reason yet, no output tokens)."""
    return {
        "id": f"msg_sim{number}",
        "type": "message",
        "role": "assistant",
        "model": engine.model,
        "content": content,
        "stop_reason": _stop_reason(job) if done else None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": job.prompt_tokens,
            "output_tokens": len(job.pieces) if done else 0,
        },
    }


def _stream_head(message: dict, block: dict) -> bytes:
    """`message_start`, then the start of the one content block."""
    return sse_event("message_start", {"type": "message_start", "message": message}) + sse_event(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": block},
    )


def _stream_tail(job: Job) -> bytes:
    """The block's end, the stop reason with the output tokens, `message_stop`."""
    return (
        sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        + sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(job), "stop_sequence": None},
                "usage": {"output_tokens": len(job.pieces)},
            },
        )
        + sse_event("message_stop", {"type": "message_stop"})
    )


async def _messages_full(engine: SimEngine, job: Job, exchange: Exchange) -> None:
    await engine.generate(job, None)
    content = [{"type": "text", "text": "".join(job.pieces)}]
    await exchange.reply(200, dumps(_message(engine, job, engine.next_id(), content, True)))


async def _messages_stream(engine: SimEngine, job: Job, exchange: Exchange) -> None:
    message = _message(engine, job, engine.next_id(), [], False)
    delta_head = (
        b"event: content_block_delta\ndata: "
        b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
    )

    async def emit(index: int, piece: str) -> None:
        await exchange.chunk(delta_head + dumps(piece) + b"}}\n\n")

    await exchange.start(200, SSE_HEADERS)
    await exchange.chunk(_stream_head(message, {"type": "text", "text": ""}))
    await engine.generate(job, emit)
    await exchange.finish(_stream_tail(job))


async def _tool_use_full(engine: SimEngine, job: Job, call: ToolCall, exchange: Exchange) -> None:
    await engine.generate(job, None)
    number = engine.next_id()
    # Cut at max_tokens, the arguments are not JSON: the block's input is then empty,
    # the stop reason (`max_tokens`) says why.
    try:
        arguments = json.loads("".join(job.pieces))
    except ValueError:
        arguments = {}
    block = {"type": "tool_use", "id": f"toolu_sim{number}", "name": call.name, "input": arguments}
    await exchange.reply(200, dumps(_message(engine, job, number, [block], True)))


async def _tool_use_stream(engine: SimEngine, job: Job, call: ToolCall, exchange: Exchange) -> None:
    """A `tool_use` block as Anthropic streams one: the block with an empty input, then
    the input's JSON in `input_json_delta` fragments."""
    number = engine.next_id()
    message = _message(engine, job, number, [], False)
    block = {"type": "tool_use", "id": f"toolu_sim{number}", "name": call.name, "input": {}}

    async def emit(index: int, piece: str) -> None:
        delta = {"type": "input_json_delta", "partial_json": piece}
        event = {"type": "content_block_delta", "index": 0, "delta": delta}
        await exchange.chunk(sse_event("content_block_delta", event))

    await exchange.start(200, SSE_HEADERS)
    await exchange.chunk(_stream_head(message, block))
    await engine.generate(job, emit)
    await exchange.finish(_stream_tail(job))
