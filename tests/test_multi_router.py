"""Two routers, agents dialling both: the fleet survives the loss of one router."""

from __future__ import annotations

import signal

import httpx

from tests.fleet import Fleet, wait_until


def ask(router_url: str, text: str) -> httpx.Response:
    return httpx.post(
        router_url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": text}]},
        timeout=30,
    )


def test_agent_keeps_a_session_with_each_router(fleet: Fleet) -> None:
    r1 = fleet.router()
    r2 = fleet.router()
    agent = fleet.agent([r1, r2], "m1")  # waits until both tables list it, healthy
    for router in (r1, r2):
        listed = router.agent(agent.peer_id)
        assert listed is not None and listed["metadata"]["model"] == "m1"
        r = ask(router.url, f"via {router.p2p_port}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == f"Echo: via {router.p2p_port}"
    # One session per router, each welcomed by its own router.
    log = agent.log()
    assert f"router_joined router={r1.peer_id}" in log
    assert f"router_joined router={r2.peer_id}" in log


def test_killing_one_router_leaves_the_fleet_serving_through_the_other(fleet: Fleet) -> None:
    r1 = fleet.router("--heartbeat-interval", "1s")
    r2 = fleet.router("--heartbeat-interval", "1s")
    agents = [
        fleet.agent([r1, r2], "m1", "--heartbeat-interval", "1s", wait=False) for _ in range(2)
    ]
    fleet.join(*agents)
    assert ask(r1.url, "before").status_code == 200

    r1.stop(signal.SIGKILL)
    # The survivor keeps both agents healthy and answers at once, and keeps doing so
    # while the agents retry the dead router in the background.
    for i in range(20):
        r = ask(r2.url, f"after {i}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == f"Echo: after {i}"
    wait_until(
        lambda: all(r2.agent(a.peer_id)["status"]["healthy"] for a in agents),
        5,
        "agents still healthy on the surviving router",
    )
    for a in agents:
        assert a.alive()
        a.wait_log(r"router_dial_failed router=\S+" + r1.peer_id.rstrip(), 15)
    wait_until(lambda: ask(r2.url, "later").status_code == 200, 5, "still serving")

    # The lost router comes back (same identity, same port): the agents rejoin it on
    # their own, and both routers serve again.
    r1.start()
    for a in agents:
        r1.wait_agent(a.peer_id, timeout=20)
    assert ask(r1.url, "back").status_code == 200
    assert ask(r2.url, "both").status_code == 200
