"""Two routers leasing one tenant's limits from one Redis: every way a request ends
(answered, engine error, client gone mid-stream, client gone while waiting) gives its
slot back to the lease, and the leases go back to Redis once the routers are idle."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import redis
import trio

from router.tenants.config import hash_key
from router.tenants.shared import LEASE_IDLE, SWEEP_INTERVAL
from tests.fleet import Fleet, Router, wait_until
from tests.redis_server import RedisServer

KEY = "hnr-leased-tenant-key"
# Limits far from their bounds: every router leases them.
AUTH = f"""
tenants:
  leased:
    keys: ["{hash_key(KEY)}"]
    requests_per_minute: 600000
    burst: 100000
    max_concurrent: 1000
    tokens_per_day: 1000000000
"""
HEADERS = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def health(router: Router) -> dict:
    return httpx.get(router.url + "/health", timeout=5).json()


def held(store: redis.Redis) -> tuple[int, int]:
    """Redis's in-flight count of the tenant: (leased slots, exact entries)."""
    base = "hivenet:tenant:{leased}"
    return sum(int(v) for v in store.hvals(f"{base}:held")), int(store.zcard(f"{base}:inflight"))


async def whole(client: httpx.AsyncClient, router: Router) -> int:
    answer = await client.post(router.url + "/v1/chat/completions", json=BODY, headers=HEADERS)
    return answer.status_code


async def gone_mid_stream(client: httpx.AsyncClient, router: Router) -> None:
    body = {**BODY, "stream": True, "max_tokens": 50}
    url = router.url + "/v1/chat/completions"
    async with client.stream("POST", url, json=body, headers=HEADERS) as answer:
        assert answer.status_code == 200
        async for _ in answer.aiter_bytes():
            break  # the first bytes, then the client hangs up


async def gone_waiting(router: Router) -> None:
    async with httpx.AsyncClient(timeout=0.3) as client:
        try:
            await whole(client, router)
        except httpx.TimeoutException:
            return
    raise AssertionError("the answer came before the client gave up")


def test_every_end_of_a_request_gives_its_slot_back_to_the_lease(
    fleet: Fleet, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path, fleet.env).start()
    fleet.procs.append(server)
    auth = tmp_path / "auth.yaml"
    auth.write_text(AUTH)
    flags = ("--auth-file", str(auth), "--state-url", server.url)
    r1, r2 = fleet.router(*flags), fleet.router(*flags)
    agent = fleet.agent([r1, r2], "m1")
    for r in (r1, r2):
        wait_until(lambda r=r: health(r)["state_store"] == "redis", 10, "Redis")
    store = redis.Redis(port=server.port, socket_timeout=2)

    async def answered() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            codes: list[int] = []

            async def one(r: Router) -> None:
                codes.append(await whole(client, r))

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, (r1, r2)[i % 2])
            return codes

    assert trio.run(answered) == [200] * 40
    # The routers lease: slots held in Redis beyond what runs (none runs now).
    assert held(store)[0] > 0

    agent.sim_state(fail_count=6)

    async def failing() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            return [await whole(client, r) for r in (r1, r2, r1, r2, r1, r2)]

    assert all(code >= 500 for code in trio.run(failing))

    # Slow enough that each client leaves first: a stream after its first bytes, a
    # whole answer while it waits.
    agent.sim_state(ttft=0.5, token_latency=0.1)

    async def leaving() -> None:
        async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
            for r in (r1, r2, r1, r2):
                nursery.start_soon(gone_mid_stream, client, r)
                nursery.start_soon(gone_waiting, r)

    trio.run(leaving)
    agent.sim_state(ttft=0.0, token_latency=0.0)
    # Every request ended, however: once idle, each router gives its lease back and
    # holds no slot in Redis; a slot one of them kept would stay counted here.
    wait_until(lambda: held(store) == (0, 0), LEASE_IDLE + 20 * SWEEP_INTERVAL, "leases back")
    # And the tenant's whole concurrency is there for either router again.
    for r in (r1, r2):
        assert health(r)["status"] == "ok"
    time.sleep(0.1)
    assert held(store) == (0, 0)
    store.close()
