"""The walking skeleton end to end: real router and agent processes, the openai SDK."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import trio

from tests.fleet import Fleet, free_port, wait_until


def client_for(router_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)


def assert_no_slots_held(router) -> None:
    wait_until(
        lambda: all(a["status"]["active_requests"] == 0 for a in router.agents()),
        10,
        "every slot released",
    )


def test_chat_non_streaming_and_streaming_through_two_agents(fleet: Fleet) -> None:
    router = fleet.router()
    a1 = fleet.agent(router, "m1", "--sim-token-latency", "50ms", wait=False)
    a2 = fleet.agent(router, "m1", "--sim-token-latency", "50ms", wait=False)
    fleet.join(a1, a2)
    client = client_for(router.url)

    answer = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "alpha beta gamma"}]
    )
    assert answer.choices[0].message.content == "Echo: alpha beta gamma"
    assert answer.model == "m1"

    words = " ".join(f"w{i}" for i in range(12))
    arrivals: list[float] = []
    parts: list[str] = []
    started = time.monotonic()
    for chunk in client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": words}], stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == f"Echo: {words}"
    # 13 tokens 50 ms apart: the first must arrive long before the last is generated.
    assert len(arrivals) == 13
    assert arrivals[-1] - arrivals[0] > 0.4

    served = {a["peer_id"]: a["universal"]["success_rate"] for a in router.agents()}
    assert set(served) == {a1.peer_id, a2.peer_id}
    assert_no_slots_held(router)


async def test_200_concurrent_requests_on_one_stream_keep_their_answers(fleet: Fleet) -> None:
    router = fleet.router()
    fleet.agent(router, "m1", "--capacity", "256", "--sim-token-latency", "5ms")
    results: dict[int, str] = {}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": f"request {i}"}]},
        )
        assert r.status_code == 200, r.text
        results[i] = r.json()["choices"][0]["message"]["content"]

    limits = httpx.Limits(max_connections=200)
    async with (
        httpx.AsyncClient(base_url=router.url, timeout=60, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        for i in range(200):
            nursery.start_soon(one, client, i)
    assert results == {i: f"Echo: request {i}" for i in range(200)}
    assert_no_slots_held(router)


def test_killed_agent_is_marked_unhealthy_and_traffic_moves(fleet: Fleet) -> None:
    router = fleet.router("--heartbeat-interval", "1s", "--unhealthy-after", "3s")
    a1 = fleet.agent(router, "m1", "--heartbeat-interval", "1s", wait=False)
    a2 = fleet.agent(router, "m1", "--heartbeat-interval", "1s", wait=False)
    fleet.join(a1, a2)
    a1.stop(signal.SIGKILL)
    router.wait_agent(a1.peer_id, healthy=False, timeout=10)
    client = client_for(router.url)
    for _ in range(5):
        answer = client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "still there"}]
        )
        assert answer.choices[0].message.content == "Echo: still there"
    assert router.agent(a2.peer_id)["universal"]["success_rate"] == 1.0
    assert router.agent(a1.peer_id)["universal"]["success_rate"] is None
    assert_no_slots_held(router)


def test_agents_rejoin_a_restarted_router_on_their_own(fleet: Fleet) -> None:
    router = fleet.router()
    a1 = fleet.agent(router, "m1", wait=False)
    a2 = fleet.agent(router, "m1", wait=False)
    fleet.join(a1, a2)
    router.stop(signal.SIGKILL)
    router.start()
    router.wait_agent(a1.peer_id, timeout=15)
    router.wait_agent(a2.peer_id, timeout=15)
    answer = client_for(router.url).chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "after restart"}]
    )
    assert answer.choices[0].message.content == "Echo: after restart"


async def test_frozen_agent_is_detected_and_its_requests_fail_over(fleet: Fleet) -> None:
    # Detection takes --unhealthy-after: heartbeats are the only liveness traffic.
    router = fleet.router("--heartbeat-interval", "1s", "--unhealthy-after", "3s")
    fast = ("--sim-token-latency", "200ms", "--heartbeat-interval", "1s")
    frozen = fleet.agent(router, "m1", *fast)
    fleet.agent(router, "m1", *fast, wait=False)
    wait_until(lambda: len(router.agents()) == 2, 15, "two agents")
    outcomes: list[tuple[int, str]] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": f"slow {i}"}]},
        )
        outcomes.append((r.status_code, r.text))

    async with (
        httpx.AsyncClient(base_url=router.url, timeout=60) as client,
        trio.open_nursery() as nursery,
    ):
        for i in range(6):
            nursery.start_soon(one, client, i)
        await trio.sleep(0.3)
        frozen.send_signal(signal.SIGSTOP)
        stopped_at = trio.current_time()
        await trio.to_thread.run_sync(
            lambda: router.wait_agent(frozen.peer_id, healthy=False, timeout=8)
        )
        detected_after = trio.current_time() - stopped_at
    assert detected_after < 6, detected_after
    assert len(outcomes) == 6
    for status, text in outcomes:
        # Requests in flight on the frozen agent end clearly: answered elsewhere, or an error.
        assert status == 200 or '"code"' in text, (status, text)
    assert any(status == 200 for status, _ in outcomes)
    frozen.send_signal(signal.SIGCONT)
    router.wait_agent(frozen.peer_id, timeout=15)
    assert "link heartbeat timeout" in router.log()
    assert_no_slots_held(router)


def test_agents_can_join_over_websocket(fleet: Fleet) -> None:
    router = fleet.router("--p2p-ws-port", str(free_port()))
    assert "/ws/p2p/" in router.multiaddr
    fleet.agent(router, "m1")
    answer = client_for(router.url).chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "over websocket"}]
    )
    assert answer.choices[0].message.content == "Echo: over websocket"
