"""Slow engines and slow clients against real router and agent processes.

An engine that stops sending part way, and a client that stops reading part way, must
both be ended by the router's request deadline: the client is told (an error event or
a 504), the agent's slot is freed, the engine call is cancelled, and other traffic
flows meanwhile. The router runs with `--stream-slot-release end`, so a stream holds
its slot until it ends and a leak would show in `active_requests`.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import psutil
import trio

from tests.fleet import Agent, Fleet, Router, wait_until

DEADLINE = 2.0


def chat(content: str, stream: bool, **extra: Any) -> dict:
    return {
        "model": "m1",
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        **extra,
    }


def sse_events(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    events = []
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    return events


async def released(router: Router, agent: Agent, within: float = 8.0) -> None:
    """The agent's slot is back and its engine has nothing in flight."""

    def check() -> bool:
        row = router.agent(agent.peer_id)
        return row is not None and row["status"]["active_requests"] == 0

    await trio.to_thread.run_sync(lambda: wait_until(check, within, "slot released"))
    await trio.to_thread.run_sync(
        lambda: wait_until(lambda: agent.sim_state()["in_flight"] == 0, within, "engine idle")
    )


async def test_an_engine_that_stalls_mid_answer_is_ended_by_the_deadline(fleet: Fleet) -> None:
    router = fleet.router("--request-timeout", f"{DEADLINE:g}s", "--stream-slot-release", "end")
    agent = fleet.agent(router, "m1", "--sim-token-latency", "20ms")
    agent.sim_state(stall_after_tokens=3)
    words = "one two three four five six"
    async with httpx.AsyncClient(base_url=router.url, timeout=DEADLINE + 15) as client:
        # A stream: three tokens arrive, then nothing until the deadline ends it.
        started = trio.current_time()
        async with client.stream("POST", "/v1/chat/completions", json=chat(words, True)) as r:
            assert r.status_code == 200
            body = b"".join([chunk async for chunk in r.aiter_bytes()])
        elapsed = trio.current_time() - started
        assert DEADLINE - 0.2 <= elapsed < DEADLINE + 6, elapsed
        events = sse_events(body)
        pieces = [
            json.loads(e)["choices"][0]["delta"].get("content", "")
            for e in events[:-1]
            if e != "[DONE]"
        ]
        assert "".join(pieces) == "Echo: one two", events
        assert "[DONE]" not in events
        error = json.loads(events[-1])["error"]
        assert error["code"] == "request_timeout", events[-1]
        await released(router, agent)

        # The same without streaming: a 504 in OpenAI's error format.
        started = trio.current_time()
        r = await client.post("/v1/chat/completions", json=chat(words, False))
        elapsed = trio.current_time() - started
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "request_timeout"
        assert DEADLINE - 0.2 <= elapsed < DEADLINE + 6, elapsed
        await released(router, agent)
        assert agent.sim_state()["cancelled_total"] >= 2

        # The engine recovers; the agent was never blamed out of the pool.
        agent.sim_state(stall_after_tokens=None)
        r = await client.post("/v1/chat/completions", json=chat(words, False))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == f"Echo: {words}"
    assert router.log().count("request_timeout") >= 2


async def test_a_client_that_stops_reading_wedges_nothing_and_is_ended_by_the_deadline(
    fleet: Fleet,
) -> None:
    router = fleet.router("--request-timeout", f"{DEADLINE:g}s", "--stream-slot-release", "end")
    # 2 ms a token: the stuck stream below would take about 6 s to generate.
    agent = fleet.agent(router, "m1", "--capacity", "8", "--sim-token-latency", "2ms")
    rss_before = psutil.Process(router.popen.pid).memory_info().rss

    # About 12 MB of answer (3,000 tokens of 4 KB), far more than the socket buffers of
    # a client that reads nothing: the router's writes to it block.
    long_words = " ".join(f"{i}{'x' * 4000}" for i in range(10))
    body = json.dumps(chat(long_words, True, max_tokens=3000, ignore_eos=True)).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"host: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    stuck = trio.socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        await stuck.connect(("127.0.0.1", router.http_port))
        view = memoryview(request)
        while view:
            view = view[await stuck.send(view) :]
        sent_at = trio.current_time()

        def holding() -> bool:
            row = router.agent(agent.peer_id)
            return row is not None and row["status"]["active_requests"] == 1

        await trio.to_thread.run_sync(lambda: wait_until(holding, 5, "stuck stream holds a slot"))

        # Other traffic, streamed and not, is served while the stuck client sits there.
        results: dict[int, tuple[int, str, float]] = {}

        async def one(client: httpx.AsyncClient, i: int) -> None:
            began = trio.current_time()
            payload = chat(f"other {i}", i % 2 == 0)
            if i % 2:
                r = await client.post("/v1/chat/completions", json=payload)
                text = r.json()["choices"][0]["message"]["content"] if r.is_success else r.text
            else:
                async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
                    raw = b"".join([c async for c in r.aiter_bytes()])
                events = sse_events(raw)
                text = "".join(
                    json.loads(e)["choices"][0]["delta"].get("content", "")
                    for e in events
                    if e != "[DONE]" and json.loads(e).get("choices")
                )
            results[i] = (r.status_code, text, trio.current_time() - began)

        async with (
            httpx.AsyncClient(base_url=router.url, timeout=DEADLINE + 15) as client,
            trio.open_nursery() as nursery,
        ):
            for i in range(20):
                nursery.start_soon(one, client, i)
        # Each answered in full, so each within its own deadline.
        assert len(results) == 20
        for i, (status, text, took) in results.items():
            assert status == 200 and text == f"Echo: other {i}", (i, status, text, took)

        # The deadline ends it: the slot comes back and the engine call is cancelled,
        # though the client still reads nothing.
        await released(router, agent, within=DEADLINE + 10)
        assert trio.current_time() - sent_at >= DEADLINE - 0.2
        state = agent.sim_state()
        assert state["cancelled_total"] >= 1, state
    finally:
        stuck.close()
    # Buffering what the stuck client did not read cost memory only while it lasted.
    rss_after = psutil.Process(router.popen.pid).memory_info().rss
    assert rss_after - rss_before < 200 * 1024 * 1024, (rss_before, rss_after)
    answer = await trio.to_thread.run_sync(
        lambda: httpx.post(router.url + "/v1/chat/completions", json=chat("after", False))
    )
    assert answer.json()["choices"][0]["message"]["content"] == "Echo: after"
