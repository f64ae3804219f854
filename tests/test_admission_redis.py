"""Two routers on one Redis admit against one occupancy budget and one key bucket
(issue 20); without Redis each counts alone and keeps serving."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import trio

from tests.fleet import Fleet, Router, wait_until
from tests.redis_server import RedisServer

KEY, RATED = (f"sk-hivenet-{n * 64}" for n in ("d", "e"))


def _entry(key: str, name: str, rate: int) -> str:
    return f"""
    - key_hash: "{hashlib.sha256(key.encode()).hexdigest()}"
      metadata: {{name: {name}, owner: acme}}
      mode: serverless
      quota: {{input_tokens_per_minute: {rate}}}"""


# RATED's bucket holds one 160-token prompt exactly: the next needs 160 tokens of
# refill, a minute's, wherever it arrives.
AUTH = (
    "api:\n  mode: api-key\n  keys:"
    + _entry(KEY, "shared", 300)
    + _entry(RATED, "rated", 160)
    + "\nadmin:\n  mode: api-key\n"
)
POLICY = "max_inflight: 1\nrouting_policy:\n  strategy: least-loaded\n"
CHAT = "/v1/chat/completions"
INFLIGHT = "hivenet_router_admission_inflight_requests"


def chat(content: str) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": content}]}


def post(router: Router, content: str = "hi", key: str = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(router.url + CHAT, json=chat(content), headers=headers, timeout=15)


def health(router: Router) -> dict:
    return httpx.get(router.url + "/health", timeout=5).json()


async def in_thread(fn: object, *args: object) -> object:
    return await trio.to_thread.run_sync(fn, *args)  # type: ignore[arg-type]


async def test_two_routers_share_one_occupancy_budget_and_key_bucket(
    fleet: Fleet, tmp_path: Path
) -> None:
    redis_server = RedisServer(tmp_path, fleet.env).start()
    fleet.procs.append(redis_server)
    (tmp_path / "auth.yaml").write_text(AUTH)
    (tmp_path / "policy.yaml").write_text(POLICY)
    flags = (
        "--auth-config-file",
        str(tmp_path / "auth.yaml"),
        "--policy-file",
        str(tmp_path / "policy.yaml"),
        "--state-url",
        redis_server.url,
    )
    env = {"HIVENET_ROUTER_ADMIT_PARK_TIMEOUT": "100ms"}
    r1, r2 = fleet.router(*flags, env=env), fleet.router(*flags, env=env)
    agent = fleet.agent([r1, r2], "m1")
    for r in (r1, r2):
        wait_until(lambda r=r: health(r)["state_store"] == "redis", 10, "Redis in use")

    # One request in flight on r1 fills the pool (max_inflight 1) for r2 too. It is
    # held until the test lets its client go (the engine would take 30 s).
    agent.sim_state(ttft=30.0)
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
        nursery.start_soon(lambda: client.post(r1.url + CHAT, json=chat("hi"), headers=headers))
        await in_thread(
            wait_until, lambda: r1.metric(INFLIGHT, model="m1") == 1, 10, "r1 holds the pool"
        )
        refused = await in_thread(post, r2)
        assert isinstance(refused, httpx.Response)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert r2.metric("hivenet_router_admission_rejections_total", reason="b2") == 1
        nursery.cancel_scope.cancel()  # the client leaves: its entry is released in Redis
    agent.sim_state(ttft=0.0)
    wait_until(lambda: post(r2).status_code == 200, 10, "r2 admits once r1's request left")

    # One bucket for a key across both routers: a 160-token prompt on r1 leaves too
    # little for another on r2.
    words = "word " * 100
    assert post(r1, words, RATED).status_code == 200
    over = post(r2, words, RATED)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert r2.metric("hivenet_router_admission_rejections_total", reason="b4_itpm") == 1

    # Redis dies: each router counts alone and serves on, and gives back what it held
    # (the gauge follows the request's end, which may lag its answer).
    redis_server.kill()
    for r in (r1, r2):
        wait_until(lambda r=r: health(r)["state_store"] == "local_fallback", 10, "fallback")
        assert post(r).status_code == 200
        wait_until(lambda r=r: r.metric(INFLIGHT, model="m1") == 0, 10, "nothing held")
