"""Any router shows the whole fleet with `?scope=fleet` (issue 21, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import redis

from router.fleet.view import ENTRY_TTL, KEY
from tests.fleet import Fleet, Router, wait_until
from tests.redis_server import RedisServer


def ask(router: Router, model: str) -> None:
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def fleet_agents(router: Router) -> dict[str, dict]:
    table = router.admin("/admin/routing-table?scope=fleet")
    assert table["scope"] == "fleet"
    return {a["peer_id"]: a for a in table["agents"]}


def test_every_router_shows_every_agent_with_its_routers_and_merged_statistics(
    fleet: Fleet, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path, fleet.env).start()
    fleet.procs.append(server)
    r1, r2 = (fleet.router("--state-url", server.url) for _ in range(2))
    only_r1 = fleet.agent(r1, "m1", wait=False)
    only_r2 = fleet.agent(r2, "m2", wait=False)
    both = fleet.agent([r1, r2], "m3", wait=False)
    fleet.join(only_r1, only_r2, both)
    for _ in range(3):
        ask(r1, "m3")
    for _ in range(2):
        ask(r2, "m3")

    # Without the scope each router shows its own agents, as before.
    assert {a["peer_id"] for a in r1.agents()} == {only_r1.peer_id, both.peer_id}

    def settled(router: Router) -> dict[str, dict] | None:
        agents = fleet_agents(router)
        merged = agents.get(both.peer_id)
        ok = len(agents) == 3 and merged is not None and merged["universal"]["requests"] == 5
        return agents if ok else None

    for router in (r1, r2):
        agents = wait_until(lambda r=router: settled(r), 20, "every router's entry in Redis")
        assert agents[only_r1.peer_id]["routers"] == [r1.peer_id]
        assert agents[only_r2.peer_id]["routers"] == [r2.peer_id]
        merged = agents[both.peer_id]
        assert merged["routers"] == sorted([r1.peer_id, r2.peer_id])
        assert merged["universal"]["success_rate"] == 1.0
        assert merged["universal"]["consecutive_failures"] == 0

        models = httpx.get(router.url + "/v1/models?scope=fleet", timeout=5).json()
        cards = {c["id"]: c for c in models["data"]}
        assert sorted(cards) == ["m1", "m2", "m3"]
        assert cards["m2"]["routers"] == [r2.peer_id]
        assert cards["m3"]["agents"]["total"] == 1

    # Every entry expires by itself, for a router that crashes.
    client = redis.Redis.from_url(server.url)
    for router in (r1, r2):
        assert 0 < client.ttl(KEY + router.peer_id) <= ENTRY_TTL
    # A router that stops deletes its entry: it leaves the view at once, well before the
    # entry's expiry (a refresh every 5 s leaves it 10 s or more); its agents' other
    # sessions keep them listed.
    r2.stop()
    assert client.get(KEY + r2.peer_id) is None
    assert only_r2.peer_id not in fleet_agents(r1)
    assert fleet_agents(r1)[both.peer_id]["routers"] == [r1.peer_id]
    # Entries of another shape (a corrupt value, a foreign writer) are left out.
    odd = {"peer_id": "odd", "model": "m9", "capacity": "lots", "engine": 5, "region": []}
    for name, value in {
        "no-router": {"agents": []},
        "agents-not-a-list": {"router": "x", "agents": "none"},
        "odd-agent": {"router": "y", "agents": [odd, {"peer_id": "no-model"}, "text"]},
        "not-json": "{",
    }.items():
        client.set(KEY + name, value if isinstance(value, str) else json.dumps(value), ex=60)
    agents = fleet_agents(r1)
    assert set(agents) == {only_r1.peer_id, both.peer_id, "odd"}
    assert agents["odd"]["capacity"] is None and agents["odd"]["engine"] is None
    models = httpx.get(r1.url + "/v1/models?scope=fleet", timeout=5)
    assert models.status_code == 200
    assert {c["id"] for c in models.json()["data"]} == {"m1", "m3", "m9"}
    client.close()


def test_without_a_state_url_the_fleet_is_this_router(fleet: Fleet) -> None:
    router = fleet.router()
    agent = fleet.agent(router, "m1")
    agents = fleet_agents(router)
    assert list(agents) == [agent.peer_id]
    assert agents[agent.peer_id]["routers"] == [router.peer_id]


def test_counts_of_another_shape_in_a_routers_entry_count_as_nothing() -> None:
    """Another router's entry is data from elsewhere: JSON's infinities and NaN, numbers
    past a float's range, negatives and booleans in its counts must not fail the view
    (each was a 500) nor show up as counts."""
    from router.fleet.view import _merge, _public

    hostile = json.loads(
        '[{"peer_id": "p", "model": "m", "active": Infinity, "successes": NaN,'
        ' "failures": -5, "consecutive_failures": 1' + "0" * 400 + ', "srtt_ms": 1e308},'
        ' {"peer_id": "p", "model": "m", "active": 1e308, "successes": true,'
        ' "failures": 2, "srtt_ms": -Infinity}]'
    )
    merged: dict[str, dict] = {}
    for n, agent in enumerate(hostile):
        _merge(merged, f"r{n}", agent)
    view = _public(merged["p"])
    assert view["active_requests"] == 2**53
    assert view["universal"]["requests"] == 2
    assert view["universal"]["success_rate"] == 0.0
    assert view["universal"]["consecutive_failures"] == 0
    assert view["universal"]["srtt"] == 2**53
    json.dumps(view, allow_nan=False)  # what the admin answer sends
