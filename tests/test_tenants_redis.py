"""Two routers on one Redis enforce one tenant quota; without Redis they keep serving."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from protocol.errors import ErrorCode
from router.metrics import RouterMetrics
from router.tenants.config import MAX_LIMIT, Tenant, hash_key
from router.tenants.counters import utc_day
from router.tenants.shared import TenantState
from tests.fleet import Fleet, Router, wait_until
from tests.redis_server import RedisServer

KEY = "hnr-shared-tenant-key"
AUTH = f"""
tenants:
  shared:
    keys: ["{hash_key(KEY)}"]
    requests_per_minute: 1
    burst: 3
    tokens_per_day: 1000000
"""


def ask(router: Router) -> str:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    answer = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}]
    )
    return answer.choices[0].message.content or ""


def refused_code(router: Router) -> str:
    with pytest.raises(openai.RateLimitError) as exc:
        ask(router)
    response = exc.value.response
    code = response.json()["error"]["code"]
    if code == "rate_limit_exceeded":
        assert response.headers["x-ratelimit-remaining-requests"] == "0"  # upstream's 429
    return code


def health(router: Router) -> dict:
    return httpx.get(router.url + "/health", timeout=5).json()


def test_two_routers_share_one_quota_and_survive_redis_loss(fleet: Fleet, tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path, fleet.env).start()
    fleet.procs.append(redis_server)
    auth = tmp_path / "auth.yaml"
    auth.write_text(AUTH)
    flags = ("--auth-file", str(auth), "--state-url", redis_server.url)
    r1, r2 = fleet.router(*flags), fleet.router(*flags)
    fleet.agent([r1, r2], "m1")
    for r in (r1, r2):
        wait_until(lambda r=r: health(r)["state_store"] == "redis", 10, "Redis in use")
        assert r.metric("hivenet_router_state_store_up") == 1

    # One bucket of 3 across both routers: 2 + 1, then neither admits.
    assert ask(r1) == "Echo: hi"
    assert ask(r2) == "Echo: hi"
    assert ask(r1) == "Echo: hi"
    assert refused_code(r2) == "rate_limit_exceeded"
    assert refused_code(r1) == "rate_limit_exceeded"
    # Tokens charged on either router land in one counter.
    used = [r.metric("hivenet_router_tenant_tokens_total", tenant="shared") for r in (r1, r2)]
    assert used[0] > 0 and used[1] > 0
    store = redis.Redis(port=redis_server.port, socket_timeout=2)
    key = f"hivenet:tenant:{{shared}}:tokens:{utc_day(time.time())}"
    wait_until(lambda: int(store.get(key) or 0) == sum(used), 5, "tokens counted in Redis")
    store.close()

    # Redis dies mid-run: both routers keep serving on their own counts, and say so.
    redis_server.kill()
    for r in (r1, r2):
        assert ask(r) == "Echo: hi"
        wait_until(lambda r=r: health(r)["state_store"] == "local_fallback", 10, "fallback")
        assert health(r)["status"] == "ok"
        assert r.metric("hivenet_router_state_store_up") == 0
        r.wait_log(r"state_store_unavailable url=redis://127\.0\.0\.1:\d+/0 counts=local")
    # Local buckets are full again (burst 3); the second request on each also passes.
    assert ask(r1) == "Echo: hi"
    assert ask(r2) == "Echo: hi"

    # Redis comes back (empty): the routers share their counts again by themselves.
    redis_server.start()
    for r in (r1, r2):
        wait_until(lambda r=r: health(r)["state_store"] == "redis", 10, "Redis back")
        r.wait_log(r"state_store_available url=\S+ counts=shared")
    assert [ask(r1), ask(r2), ask(r1)] == ["Echo: hi"] * 3
    assert refused_code(r2) == "rate_limit_exceeded"


async def test_the_shared_counts_refuse_with_what_is_left(tmp_path: Path) -> None:
    """Redis's verdicts say what the local ones say: 0 requests left on a rate refusal,
    the day's tokens left on a budget refusal."""
    redis_server = RedisServer(tmp_path, dict(os.environ)).start()
    try:
        state = TenantState(redis_server.url, RouterMetrics(), lease=60.0)
        state._up()
        tenant = Tenant("t", requests_per_minute=60, burst=1, tokens_per_day=100)
        admitted, shared = await state.admit(tenant, "a", need=50, charge=90)
        assert shared and admitted.code is None
        assert (admitted.requests_left, admitted.tokens_left) == (0, 100)
        short, _ = await state.admit(tenant, "b", need=20)
        assert (short.code, short.tokens_left) == (ErrorCode.QUOTA_EXCEEDED, 10)
        limited, _ = await state.admit(Tenant("u", requests_per_minute=60, burst=1), "c")
        assert limited.code is None
        limited, _ = await state.admit(Tenant("u", requests_per_minute=60, burst=1), "d")
        assert (limited.code, limited.requests_left) == (ErrorCode.RATE_LIMITED, 0)
        # What a whole answer's budget check reads (issue 47 item 6): the day's count in
        # Redis, this admission's charge included; the local count when not shared.
        assert await state.used("t", admitted.day, True) == 90
        assert await state.used("t", admitted.day, False) == 0
        assert state.client is not None
        state.client.close()
    finally:
        redis_server.stop()


async def test_the_largest_limits_keep_redis_in_use(tmp_path: Path) -> None:
    """Every limit at MAX_LIMIT, the bucket refilling slowest: the scripts run (a script
    error would switch every tenant to local counts) and report what is left exactly."""
    redis_server = RedisServer(tmp_path, dict(os.environ)).start()
    state = TenantState(redis_server.url, RouterMetrics(), lease=60.0)
    try:
        state._up()
        tenant = Tenant(
            "t",
            requests_per_minute=1,
            burst=MAX_LIMIT,
            tokens_per_day=MAX_LIMIT,
            max_concurrent=MAX_LIMIT,
        )
        verdict, shared = await state.admit(tenant, "a", need=MAX_LIMIT, charge=MAX_LIMIT - 1)
        assert shared and state.up and verdict.code is None
        assert (verdict.requests_left, verdict.tokens_left) == (MAX_LIMIT - 1, MAX_LIMIT)
        await state.release("t", "a", 1, True, verdict.day)
        full, _ = await state.admit(tenant, "b", need=1)
        assert state.up and (full.code, full.tokens_left) == (ErrorCode.QUOTA_EXCEEDED, 0)
    finally:
        state.close()
        redis_server.stop()
