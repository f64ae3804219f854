"""Two routers on one Redis admit against one occupancy budget and one key bucket
(issue 20); without Redis each counts alone and keeps serving."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from pathlib import Path

import httpx

from tests.fleet import Fleet, Router, wait_until
from tests.redis_server import RedisServer

KEY = "sk-hivenet-" + "d" * 64
AUTH = f"""
api:
  mode: api-key
  keys:
    - key_hash: "{hashlib.sha256(KEY.encode()).hexdigest()}"
      metadata: {{name: shared, owner: acme}}
      mode: serverless
      quota: {{input_tokens_per_minute: 300}}
admin:
  mode: api-key
"""
POLICY = "max_inflight: 1\nrouting_policy:\n  strategy: least-loaded\n"
CHAT = "/v1/chat/completions"


def post(router: Router, content: str = "hi", timeout: float = 15) -> httpx.Response:
    payload = {"model": "m1", "messages": [{"role": "user", "content": content}]}
    headers = {"authorization": f"Bearer {KEY}"}
    return httpx.post(router.url + CHAT, json=payload, headers=headers, timeout=timeout)


def health(router: Router) -> dict:
    return httpx.get(router.url + "/health", timeout=5).json()


def test_two_routers_share_one_occupancy_budget_and_key_bucket(
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

    # One request in flight on r1 fills the pool (max_inflight 1) for r2 too.
    agent.sim_state(ttft=30.0)

    def held() -> None:
        with contextlib.suppress(httpx.HTTPError):
            post(r1, timeout=2)

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    inflight = "hivenet_router_admission_inflight_requests"
    wait_until(lambda: r1.metric(inflight, model="m1") == 1, 10, "r1 holds the pool")
    refused = post(r2)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert r2.metric("hivenet_router_admission_rejections_total", reason="b2") == 1
    thread.join(10)  # the client left: its entry is released in Redis
    agent.sim_state(ttft=0.0)
    wait_until(lambda: post(r2).status_code == 200, 10, "r2 admits once r1's request left")

    # One bucket of 300 input tokens a minute for the key across both routers: a
    # 160-token prompt on r1 leaves too little for another on r2.
    words = "word " * 100
    assert post(r1, words).status_code == 200
    over = post(r2, words)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert r2.metric("hivenet_router_admission_rejections_total", reason="b4_itpm") == 1

    # Redis dies: each router counts alone and serves on.
    redis_server.kill()
    for r in (r1, r2):
        wait_until(lambda r=r: health(r)["state_store"] == "local_fallback", 10, "fallback")
        assert post(r).status_code == 200
    assert r1.metric(inflight, model="m1") == 0
    assert r2.metric(inflight, model="m1") == 0
