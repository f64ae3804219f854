"""Priority order of the capacity queue with a real router and a real agent.

The router runs in this test's trio loop (libp2p, the agent link, the dispatcher), the
agent as its own process with the simulated engine. Requests enter at the
dispatcher with a priority, as the HTTP layer hands them over once a tenant's priority
is known, and are served one at a time by an agent of capacity 1 whose slot the test
holds until every request has queued.
"""

from __future__ import annotations

import json
import re
import threading
import types
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

from router.app import RouterDaemon
from router.capacity import try_acquire
from router.link import AgentResponse
from router.session import RouteRequest, Served, Slot
from router.settings import RouterSettings
from router.tenants.config import hash_key
from tests.fleet import SECRET, Agent, Fleet, free_port, wait_until


async def wait_for(check: Callable[[], bool], what: str) -> None:
    """Poll `check`: the agent process and the engine change what it reads, not a task here."""
    for _ in range(1200):  # 60 s
        if check():
            return
        await trio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def chat_request(priority: int) -> RouteRequest:
    body = {"model": "m1", "messages": [{"role": "user", "content": f"priority {priority}"}]}
    return RouteRequest(
        request_id=str(uuid.uuid4()),
        model="m1",
        capability="llm",
        tenant=f"tenant-{priority}",
        method="POST",
        path="/v1/chat/completions",
        headers={"content-type": "application/json"},
        body=json.dumps(body).encode(),
        stream=False,
        payload=body,
        received_at=trio.current_time(),
        priority=priority,
    )


async def test_waiters_are_served_by_priority_then_arrival(fleet: Fleet, tmp_path: Path) -> None:
    settings = RouterSettings(
        http_addr=("127.0.0.1", free_port()),
        metrics_addr=("127.0.0.1", free_port()),
        p2p_port=free_port(),
        identity_path=str(tmp_path / "router.key"),
        jwt_secret=SECRET.encode(),
        allow_insecure_admin=True,
        queue_depth=10,
    )
    daemon = RouterDaemon(settings)
    served: list[tuple[int, str]] = []

    async def serve(req: RouteRequest) -> None:
        outcome = await daemon.dispatcher.dispatch(req)
        assert isinstance(outcome, Served)
        response = outcome.response
        assert isinstance(response, AgentResponse)
        try:
            answer = json.loads(await response.read_all())
        finally:
            response.close()
        served.append((req.priority, answer["choices"][0]["message"]["content"]))

    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        router = types.SimpleNamespace(
            multiaddr=f"/ip4/127.0.0.1/tcp/{settings.p2p_port}/p2p/{daemon.peer_id}"
        )
        flags = ["--capacity", "1", "--sim-ttft", "20ms"]
        agent = Agent(fleet, [router], "m1", flags, fleet.env)  # type: ignore[list-item]
        fleet.procs.append(agent)
        agent.start()
        await wait_for(
            lambda: any(p.routable for p in daemon.table.for_model("m1")), "agent joined"
        )

        # The test holds the agent's only slot, as a long request would, until all queued.
        (peer,) = daemon.table.for_model("m1")
        assert try_acquire(peer)
        held = Slot(peer, lambda p: daemon.queue.notify(p.metadata.model))
        priorities = [0, 2, 0, 1, 2]
        for n, priority in enumerate(priorities, start=1):
            nursery.start_soon(serve, chat_request(priority))
            await wait_for(lambda n=n: daemon.queue.length("m1") == n, f"{n} queued")
        held.release()
        await wait_for(lambda: len(served) == len(priorities), "all served")
        nursery.cancel_scope.cancel()

    assert [priority for priority, _ in served] == [2, 2, 1, 0, 0]
    # Every answer is the engine's own, for that request.
    assert all(text == f"Echo: priority {priority}" for priority, text in served)
    assert daemon.queue.lengths() == {}
    assert all(p.active == 0 for p in daemon.table.for_model("m1"))


def test_auth_file_priorities_order_queued_http_requests(fleet: Fleet, tmp_path: Path) -> None:
    """Through the HTTP API with an auth file: a tenant's `priority` decides who of the
    queued requests gets the agent's one slot first (synchronous test: real threads)."""
    keys = {name: f"hnr-test-{name}-key" for name in ("low", "mid", "high")}
    auth = "tenants:\n" + "".join(
        f'  {name}:\n    keys: ["{hash_key(key)}"]\n    priority: {rank}\n'
        for rank, (name, key) in enumerate(keys.items())
    )
    (tmp_path / "auth.yaml").write_text(auth)
    router = fleet.router("--auth-file", str(tmp_path / "auth.yaml"))
    agent = fleet.agent(router, "m1", "--capacity", "1")
    finished: list[str] = []
    lock = threading.Lock()

    def call(tenant: str, timeout: float) -> None:
        body = {"model": "m1", "messages": [{"role": "user", "content": tenant}]}
        headers = {"authorization": f"Bearer {keys[tenant]}"}
        try:
            r = httpx.post(
                router.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout
            )
        except httpx.TimeoutException:
            return  # the request that held the slot: its client gave up
        assert r.status_code == 200, r.text
        with lock:
            finished.append(tenant)

    def queued() -> int:
        return router.admin("/admin/health")["queues"].get("m1", 0)

    # A stalled answer holds the only slot until its client leaves (after 8 s).
    agent.sim_state(stall_after_tokens=0)
    threads = [threading.Thread(target=call, args=("low", 8.0))]
    threads[0].start()
    wait_until(lambda: router.agent(agent.peer_id)["status"]["active_requests"] == 1)
    for n, tenant in enumerate(("low", "mid", "high", "mid"), start=1):
        threads.append(threading.Thread(target=call, args=(tenant, 60.0)))
        threads[-1].start()
        wait_until(lambda n=n: queued() == n, what=f"{n} queued")
    agent.sim_state(stall_after_tokens=None)
    for t in threads:
        t.join(90)

    # The order the router answered in, from its access log (written after the answer):
    # the clients' threads hear of answers a few ms apart, and under load one may
    # append before another that was answered first.
    def served() -> list[str]:
        return re.findall(r"path=/v1/chat/completions status=200 tenant=(\w+)", router.log())

    wait_until(lambda: len(served()) == 4, what="four answers logged")
    assert served() == ["high", "mid", "mid", "low"]
    assert sorted(finished) == sorted(served())
    assert router.agent(agent.peer_id)["status"]["active_requests"] == 0
    assert queued() == 0
