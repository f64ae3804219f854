"""A day's token budget across midnight UTC, in one router's counts and in Redis."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.metrics import RouterMetrics
from router.tenants.config import hash_key
from router.tenants.counters import DAY, utc_day
from router.tenants.gate import GateSettings, TenantGate
from router.tenants.keys import ClientKeys
from tests.redis_server import RedisServer

AUTH = f"""
tenants:
  t:
    keys: ["{hash_key("k")}"]
    tokens_per_day: 1000
"""


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("store", ["local", "redis"])
async def test_a_charge_is_trued_up_on_the_day_it_was_taken(tmp_path: Path, store: str) -> None:
    """Requests admitted just before midnight and ending after it: a refund of the
    estimate must not raise the new day's budget, nor usage above it lower that budget."""
    server = RedisServer(tmp_path, dict(os.environ)).start() if store == "redis" else None
    auth = tmp_path / "auth.yaml"
    auth.write_text(AUTH)
    settings = GateSettings(auth_file=str(auth), state_url=server.url if server else None)
    gate = TenantGate(settings, ClientKeys(""), RouterMetrics())
    clock = Clock(1000 * DAY - 1.0)
    gate.state.local.wall = clock
    if server is not None:
        gate.state._up()
    try:
        failed = gate.open("r1", "t")
        assert failed is not None and await failed.admit("m", 10, need=900, charge=900) is None
        served = gate.open("r2", "t")
        assert served is not None and await served.admit("m", 10, need=100, charge=50) is None
        served.served_by("routing_policy", "agent")
        served.usage = {"prompt_tokens": 50, "completion_tokens": 40}

        clock.now += 2.0  # a new UTC day
        await failed.close()  # it never reached an engine: 900 back, to yesterday
        await served.close()  # 40 more, to yesterday

        today = [gate.open(f"n{i}", "t") for i in range(2)]
        assert today[0] is not None and today[1] is not None
        over = await today[0].admit("m", 10, need=1001)
        assert over is not None and over.code == "token_limit_exceeded"
        assert today[0].remaining == (None, 1000)
        assert await today[1].admit("m", 10, need=1000) is None
    finally:
        gate.close()
        if server is not None:
            server.stop()


@pytest.mark.parametrize("store", ["local", "redis"])
async def test_a_refund_of_a_charge_the_counts_lost_lends_nothing(
    tmp_path: Path, store: str
) -> None:
    """A refund for an admission whose charge the counts no longer hold (Redis restarted
    empty, or went away and the local counts take the release) leaves the day at 0."""
    server = RedisServer(tmp_path, dict(os.environ)).start() if store == "redis" else None
    auth = tmp_path / "auth.yaml"
    auth.write_text(AUTH)
    settings = GateSettings(auth_file=str(auth), state_url=server.url if server else None)
    gate = TenantGate(settings, ClientKeys(""), RouterMetrics())
    if server is not None:
        gate.state._up()
    try:
        today = utc_day(gate.state.local.wall())
        await gate.state.release("t", "lost", -500, server is not None, today)
        ticket = gate.open("r1", "t")
        assert ticket is not None
        over = await ticket.admit("m", 10, need=1001)
        assert over is not None and over.code == "token_limit_exceeded"
        assert ticket.remaining == (None, 1000)
    finally:
        gate.close()
        if server is not None:
            server.stop()


async def test_a_tenant_without_a_day_budget_writes_no_day_count(tmp_path: Path) -> None:
    """A concurrency limit and no `tokens_per_day`: its release gives the slot back and
    charges no day (in Redis it made a key of no day, `…:tokens:`)."""
    server = RedisServer(tmp_path, dict(os.environ)).start()
    auth = tmp_path / "auth.yaml"
    auth.write_text(f'tenants:\n  t:\n    keys: ["{hash_key("k")}"]\n    max_concurrent: 1\n')
    gate = TenantGate(
        GateSettings(auth_file=str(auth), state_url=server.url), ClientKeys(""), RouterMetrics()
    )
    gate.state._up()
    try:
        ticket = gate.open("r1", "t")
        assert ticket is not None and await ticket.admit("m", 10, need=50, charge=50) is None
        ticket.served_by("routing_policy", "agent")
        ticket.usage = {"prompt_tokens": 70, "completion_tokens": 40}
        await ticket.close()
        assert gate.state.client is not None
        assert [k for k in gate.state.client.scan_iter(match="*tokens*")] == []
        again = gate.open("r2", "t")
        assert again is not None and await again.admit("m", 10) is None  # the slot is back
    finally:
        gate.close()
        server.stop()
