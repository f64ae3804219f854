"""A continued stream counts what the client was sent in tokens, not events.

vLLM packs several tokens into one stream event when its reader lags (issue 48: 71
events carried about 107 tokens). The sim does the same here (`tokens_per_event`): two
agents' engines stall after 12 tokens, sent as 4 events of 3, and are SIGKILLed; a third
continues each stream. The spliced usage must be the uninterrupted answer's, and
`max_tokens` must hold, whether or not the client asked for the usage chunk.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from functools import partial

import anthropic
import httpx
import openai
import trio

from tests.fleet import Fleet, Router, sim_process, wait_until
from tests.test_stream_continuation import read_chat_stream

WORDS = [f"w{i}" for i in range(30)]
PROMPT = " ".join(WORDS)
ANSWER = ["Echo:", *WORDS]  # the sim's answer: 31 tokens, one a word
PER_EVENT = 3
STALL = 12  # tokens out when the engine stalls: 4 events


def _answer(tokens: int) -> str:
    return " ".join(ANSWER[:tokens])


async def _sdk(router: Router, limit: int | None, out: dict) -> None:
    """The official SDK, asking for the usage chunk."""
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    extra = {} if limit is None else {"max_tokens": limit}
    try:
        stream = await client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            **extra,
        )
        _, text, finish, usage = await read_chat_stream(stream)
        out[limit] = (text, finish, usage)
    finally:
        await client.close()


async def _raw(router: Router, out: dict) -> None:
    """A client that did not ask for usage: no usage-only chunk may reach it."""
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": 20,
    }
    events = []
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", router.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    out["raw"] = events


async def _continued(fleet: Fleet, router: Router, *clients: Callable[[], Awaitable]) -> None:
    """`clients` run while two agents' engines hold their streams after STALL tokens,
    packed PER_EVENT to an event; then a third agent joins and the two are SIGKILLed."""
    first = [fleet.agent(router, "m1", wait=False) for _ in range(2)]
    for agent in first:
        router.wait_agent(agent.peer_id)
        agent.sim_state(tokens_per_event=PER_EVENT, stall_after_tokens=STALL)
    async with trio.open_nursery() as nursery:
        for client in clients:
            nursery.start_soon(client)
        held = lambda: sum(a.sim_state()["in_flight"] for a in first) == len(clients)  # noqa: E731
        await trio.to_thread.run_sync(lambda: wait_until(held, 15, "the held streams"))
        # The one that continues them joins now, packing tokens as well.
        last = await trio.to_thread.run_sync(lambda: fleet.agent(router, "m1"))
        last.sim_state(tokens_per_event=PER_EVENT)
        for agent in first:
            await trio.to_thread.run_sync(lambda a=agent: a.stop(signal.SIGKILL))


async def test_a_continued_stream_counts_the_tokens_sent_not_the_events(fleet: Fleet) -> None:
    router = fleet.router()
    out: dict = {}
    await _continued(
        fleet,
        router,
        partial(_sdk, router, None, out),
        partial(_sdk, router, 20, out),
        partial(_raw, router, out),
    )

    # The whole answer, and the uninterrupted usage: 30 prompt tokens, 31 generated.
    assert out[None] == (_answer(31), ["stop"], [(30, 31)]), out[None]
    # max_tokens 20 holds: 12 sent, 8 more, not 16 (20 less the 4 events).
    assert out[20] == (_answer(20), ["length"], [(30, 20)]), out[20]
    events = out["raw"]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks), "a usage-only chunk the client did not ask for"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == _answer(20), text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert router.metric("hivenet_router_stream_continuations_total", outcome="continued") >= 3
    assert f"sent_tokens={STALL} " in router.log()


async def _messages(router: Router, limit: int, out: dict) -> None:
    """Anthropic's SDK: its stream carries no running count."""
    client = anthropic.AsyncAnthropic(base_url=router.url, api_key="x", max_retries=0)
    try:
        async with client.messages.stream(
            model="m1",
            max_tokens=limit,
            messages=[{"role": "user", "content": PROMPT}],
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            message = await stream.get_final_message()
        out[limit] = (
            text,
            message.stop_reason,
            message.usage.input_tokens,
            message.usage.output_tokens,
        )
    finally:
        await client.close()


async def test_a_continued_messages_stream_counts_tokens_by_the_engines_tokenizer(
    fleet: Fleet,
) -> None:
    """Anthropic's events carry no running count: the router asks the continuing
    agent's engine to tokenize the text sent (`/tokenize`), not one per event."""
    router = fleet.router()
    out: dict = {}
    await _continued(
        fleet, router, partial(_messages, router, 100, out), partial(_messages, router, 20, out)
    )

    # The uninterrupted answer's usage: 30 prompt tokens, 31 generated.
    assert out[100] == (_answer(31), "end_turn", 30, 31), out[100]
    # max_tokens 20 holds: 12 sent (4 events), 8 more, not 16.
    assert out[20] == (_answer(20), "max_tokens", 30, 20), out[20]
    assert f"sent_tokens={STALL} " in router.log()


async def _continued_on_engines(fleet: Fleet, router: Router, engine: str, *sim: str) -> dict:
    """A `/v1/messages` stream of 20 tokens at most on agents of `engine`, whose engines
    are sims started with `sim` flags: the first stalls after STALL tokens and its agent
    is SIGKILLed; a second agent continues. The stream's outcome, by `max_tokens`."""
    out: dict = {}
    with ExitStack() as engines:
        urls = [engines.enter_context(sim_process("--model", "m1", *sim)) for _ in range(2)]
        first = fleet.agent(router, "m1", "--backend-url", urls[0], engine=engine)
        state = {"tokens_per_event": PER_EVENT}
        for url, extra in ((urls[0], {"stall_after_tokens": STALL}), (urls[1], {})):
            await trio.to_thread.run_sync(
                lambda u=url, e=extra: httpx.post(u + "/sim/state", json={**state, **e})
            )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_messages, router, 20, out)
            held = lambda: httpx.get(urls[0] + "/sim/state").json()["in_flight"] == 1  # noqa: E731
            await trio.to_thread.run_sync(lambda: wait_until(held, 15, "the held stream"))
            await trio.to_thread.run_sync(
                lambda: fleet.agent(router, "m1", "--backend-url", urls[1], engine=engine)
            )
            await trio.to_thread.run_sync(lambda: first.stop(signal.SIGKILL))
    return out


async def test_a_tokenizer_that_fails_leaves_the_event_count(fleet: Fleet) -> None:
    """No engine of the model has `/tokenize` (each answers its 404): the stream is
    still continued, counted one token per event as before, and the log says so."""
    router = fleet.router()
    out = await _continued_on_engines(fleet, router, "vllm", "--missing-route", "/tokenize")
    # 12 tokens sent in 4 events, counted as 4: the continuation may write 16 more.
    assert out[20] == (_answer(28), "max_tokens", 30, 20), out[20]
    assert "stream_tokens_uncounted" in router.log()
    assert "stream_continued" in router.log()


async def test_llama_cpps_tokenizer_counts_a_continued_messages_stream(fleet: Fleet) -> None:
    """llama-server's `/tokenize` takes `content` and answers the token ids alone: the
    router asks it in that form and counts the ids, so a fleet of llama.cpp agents
    holds `max_tokens` as vLLM's does."""
    router = fleet.router()
    out = await _continued_on_engines(fleet, router, "llamacpp", "--kind", "llamacpp")
    # 12 tokens sent in 4 events, counted as 12 by the engine: 8 more, not 16.
    assert out[20] == (_answer(20), "max_tokens", 30, 20), out[20]
    assert f"stream_tokens_counted tokens={STALL} events=4 " in router.log()
    assert f"sent_tokens={STALL} " in router.log()
    assert "stream_tokens_uncounted" not in router.log()
