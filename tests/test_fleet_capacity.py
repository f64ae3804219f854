"""An agent's `--capacity` holds across every router it serves (issue 21, item 1)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from agent.capacity import SharedCapacity
from router.capacity import report_elsewhere
from router.peers import AgentMetadata, Peer
from tests.fleet import Fleet, Router

CLIENTS = 50
CAPACITY = 4


def ask(router: Router, i: int) -> str:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    try:
        reply = client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": f"client {i}"}],
            timeout=60,
        )
    finally:
        client.close()
    return reply.choices[0].message.content or ""


def test_three_routers_never_give_one_agent_more_than_its_capacity(fleet: Fleet) -> None:
    routers = [fleet.router() for _ in range(3)]
    agent = fleet.agent(
        routers,
        "m1",
        "--capacity",
        str(CAPACITY),
        # Each request holds its slot about 0.1 s, so 50 of them overlap on every router.
        "--sim-ttft",
        "50ms",
        "--sim-token-latency",
        "10ms",
    )
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(lambda i: ask(routers[i % 3], i), range(CLIENTS)))

    assert answers == [f"Echo: client {i}" for i in range(CLIENTS)]
    state = agent.sim_state()
    assert state["requests_total"] == CLIENTS
    assert state["max_in_flight"] <= CAPACITY
    # Every router got its share: the limit held across routers, not by one serving all.
    for router in routers:
        served = router.metric("hivenet_router_routing_requests_routed_total", model="m1")
        assert served >= 1, router.metrics()


def _peer(capacity: int) -> Peer:
    async def send(msg: dict) -> None:
        raise AssertionError("not sent")

    meta = AgentMetadata(model="m1", capability="llm", engine="sim", capacity=capacity)
    return Peer("p", meta, send, connected_at=0.0, last_seen=0.0)


def test_hostile_elsewhere_counts_are_bounded_by_the_capacity() -> None:
    peer = _peer(4)
    peer.active = 1  # one request of this router's own
    for hostile, counted in ((10**30, 4), (-7, 0), (True, 0), ("3", 0), (2.5, 0), (None, 0)):
        report_elsewhere(peer, hostile)
        assert (peer.elsewhere, peer.active) == (counted, 1 + counted)
    # A refusal makes the agent full in this count once the refused slot is released.
    assert not report_elsewhere(peer, 0, full=True)
    peer.active -= 1
    assert peer.active == 4
    assert report_elsewhere(peer, 1)  # the next report frees room: waiters look again
    assert peer.active == 1


def test_the_agent_counts_every_router_and_tells_the_full_ones_of_room() -> None:
    told: list[str] = []
    shared = SharedCapacity(2)
    a = shared.join(lambda: told.append("a"))
    b = shared.join(lambda: told.append("b"))
    assert shared.try_take(a) and shared.try_take(a)
    assert not shared.try_take(b)
    assert shared.elsewhere(b) == 2 and shared.elsewhere(a) == 0
    shared.give_back(a)
    assert told == ["b"]  # a learns from its own response_end
    assert shared.try_take(b)
    shared.leave(a)  # a router session ends: its requests no longer count
    assert shared.in_flight == 1 and shared.try_take(b)
