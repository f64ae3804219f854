"""The failures the simulator answers with when told to (`fail_count` in `/sim/state`).

Plain failures are an error status with a chosen body; with `malformed` set they are a
200 with one of the broken bodies an engine, or a proxy in front of it, has been seen to
give. The agent and router must turn each into a clear error for the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from sim.asgi import HTML_TYPE, JSON_TYPE, SSE_DONE, SSE_TYPE, TEXT_TYPE, Exchange, dumps, sse_event
from sim.generation import RequestError
from sim.openai import error_body

if TYPE_CHECKING:
    # sim.state checks `malformed` against MALFORMED; the state type is only a hint here.
    from sim.state import SimState

_CUT_EVENT = b'data: {"id":"chatcmpl-cut","object":"chat.completion.chunk","choi'
# shape -> (content type, body). "sse_bad_later" starts with one good event (chosen per
# protocol when sent) so that the break comes after bytes went to the client.
MALFORMED: dict[str, tuple[bytes, bytes]] = {
    "garbage": (JSON_TYPE, b"\x00\x17garbage{not json"),
    "empty": (JSON_TYPE, b""),
    "html": (HTML_TYPE, b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"),
    "not_object": (JSON_TYPE, b'["not", "an", "object"]'),
    "sse_cut": (SSE_TYPE, _CUT_EVENT),
    "sse_bad_data": (SSE_TYPE, b"data: upstream hiccup, not json\n\n" + SSE_DONE),
    "sse_bad_later": (SSE_TYPE, b"data: upstream hiccup, not json\n\n"),
}


async def reply_failure(
    exchange: Exchange, state: SimState, model_json: bytes, anthropic: bool
) -> None:
    """The failure `state` asks for, in place of an answer."""
    if state.malformed is not None:
        await _reply_malformed(
            exchange, state.malformed, state.token_latency, model_json, anthropic
        )
        return
    status, body = state.fail_status, state.fail_body
    if isinstance(body, str):
        await exchange.reply(status, body.encode(), TEXT_TYPE)
    elif body is None:
        error = RequestError(status, "simulated failure", "InternalServerError")
        await exchange.reply(status, error_body(error))
    else:
        await exchange.reply(status, dumps(body))


async def _reply_malformed(
    exchange: Exchange, shape: str, token_latency: float, model_json: bytes, anthropic: bool
) -> None:
    content_type, body = MALFORMED[shape]
    if shape == "sse_bad_later":
        first = (
            sse_event("ping", {"type": "ping"})
            if anthropic
            else b'data: {"id":"chatcmpl-bad","object":"chat.completion.chunk","created":0,'
            b'"model":%s,"choices":[{"index":0,"delta":{"role":"assistant","content":'
            b'"Echo:"},"logprobs":null,"finish_reason":null}]}\n\n' % model_json
        )
        # Two writes a token apart: the good event leaves before the broken one.
        await exchange.start(200, [(b"content-type", content_type)])
        await exchange.chunk(first)
        await trio.sleep(token_latency)
        await exchange.finish(body)
        return
    await exchange.reply(200, body, content_type)
