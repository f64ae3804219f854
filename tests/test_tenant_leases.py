"""Leases of a tenant's limits (issue 51): routers admit from slices they took in Redis,
never past a limit across routers, give back what they do not use, and keep small
limits to one exact call per request."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
import trio
import trio.lowlevel

from protocol.errors import ErrorCode
from router.metrics import RouterMetrics
from router.tenants.config import Tenant
from router.tenants.counters import utc_day
from router.tenants.shared import LEASE_IDLE, SWEEP_INTERVAL, TenantState
from tests.redis_server import RedisServer


@pytest.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(tmp_path, dict(os.environ)).start()
    try:
        yield server
    finally:
        server.stop()


def routers(server: RedisServer, n: int) -> list[TenantState]:
    states = [TenantState(server.url, RouterMetrics(), lease=60.0) for _ in range(n)]
    for state in states:
        state._up()
    return states


def close(states: list[TenantState]) -> None:
    for state in states:
        state.close()


def in_flight(server: RedisServer, tenant: str) -> int:
    """What Redis counts in flight: entries of exact admissions and leased slots."""
    store = redis.Redis(port=server.port, socket_timeout=2)
    base = f"hivenet:tenant:{{{tenant}}}"
    try:
        held = sum(int(v) for v in store.hvals(f"{base}:held"))
        return int(store.zcard(f"{base}:inflight")) + held
    finally:
        store.close()


async def fill(states: list[TenantState], tenant: Tenant, need: int = 0) -> list[int]:
    """Admit on each router in turn, none released, until every router refuses; how
    many each admitted."""
    counts = [0] * len(states)
    refused = [False] * len(states)
    i = 0
    while not all(refused):
        k = i % len(states)
        i += 1
        if refused[k]:
            continue
        verdict, shared = await states[k].admit(tenant, f"r{k}-{i}", need=need, charge=need)
        assert shared and states[k].up
        if verdict.code is None:
            counts[k] += 1
        else:
            refused[k] = True
    return counts


async def test_concurrency_leased_by_three_routers_is_never_passed(
    redis_server: RedisServer,
) -> None:
    states = routers(redis_server, 3)
    tenant = Tenant("t", max_concurrent=200)
    try:
        counts = await fill(states, tenant)
        # Every router took a lease (this is the leased path, not the exact one)...
        assert all(s.leases["t"].used for s in states)
        # ...and together they admitted the limit, exactly: a lease's unused slots are
        # spent by its router before it refuses, and no slot is counted twice.
        assert sum(counts) == 200
        assert in_flight(redis_server, "t") == 200
        refused, _ = await states[0].admit(tenant, "over")
        assert refused.code is ErrorCode.TOO_MANY_CONCURRENT
    finally:
        close(states)


async def test_rpm_and_day_tokens_leased_by_two_routers_stay_exact(
    redis_server: RedisServer,
) -> None:
    states = routers(redis_server, 2)
    # One request a second refills: nothing to speak of while the test runs.
    rate = Tenant("r", requests_per_minute=60, burst=300)
    day = Tenant("d", tokens_per_day=20_000)
    try:
        counts = await fill(states, rate)
        assert all(c > 0 for c in counts)
        assert 300 <= sum(counts) <= 301
        counts = await fill(states, day, need=10)
        assert sum(counts) == 2_000
        store = redis.Redis(port=redis_server.port, socket_timeout=2)
        assert int(store.get(f"hivenet:tenant:{{d}}:tokens:{utc_day(time.time())}")) == 20_000
        store.close()
    finally:
        close(states)


async def test_a_whole_answer_check_reads_the_lease(redis_server: RedisServer) -> None:
    """Under a lease the day's count is known without a call: the count at the grant
    less what the slice has not spent, this admission's charge included."""
    (state,) = routers(redis_server, 1)
    tenant = Tenant("d", tokens_per_day=100_000)
    try:
        first, _ = await state.admit(tenant, "a", need=100, charge=100)
        lease = state.leases["d"]
        assert lease.allowance > 0
        second, _ = await state.admit(tenant, "b", need=100, charge=100)
        assert second.code is None
        assert await state.used("d", first.day, True) == 200
        await state.release("d", "b", 50, True, second.day)  # 50 more than its estimate
        assert await state.used("d", first.day, True) == 250
    finally:
        close([state])


async def test_an_idle_router_gives_its_lease_back(redis_server: RedisServer) -> None:
    """No under-admission: a router that stops taking requests returns its slice within
    LEASE_IDLE (+ one sweep), and the other router then admits the whole limit."""
    a, b = routers(redis_server, 2)
    tenant = Tenant("t", max_concurrent=100, requests_per_minute=60, burst=500)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.watch)
            verdict, shared = await a.admit(tenant, "x")
            assert verdict.code is None and a.leases["t"].free > 0
            await a.release("t", "x", 0, shared, verdict.day)
            assert in_flight(redis_server, "t") > 0  # its free slots, held
            await trio.sleep(LEASE_IDLE + 3 * SWEEP_INTERVAL)
            assert in_flight(redis_server, "t") == 0
            assert "t" not in a.leases
            nursery.cancel_scope.cancel()
        counts = await fill([b], tenant)
        assert counts == [100]
        # The bucket got a's unspent tokens back: 500 less the 101 admitted (+ refill).
        store = redis.Redis(port=redis_server.port, socket_timeout=2)
        level = float(store.hget("hivenet:tenant:{t}:rpm", "tokens"))
        store.close()
        assert 399 <= level <= 401
    finally:
        close([a, b])


async def test_shutdown_gives_back_all_but_the_slots_in_use(redis_server: RedisServer) -> None:
    a, b = routers(redis_server, 2)
    tenant = Tenant("t", max_concurrent=100)
    try:
        held = [await a.admit(tenant, f"x{i}") for i in range(3)]
        assert a.leases["t"].free > 0
        await a.give_back()
        assert in_flight(redis_server, "t") == 3  # three requests still run
        for i, (verdict, shared) in enumerate(held):
            assert verdict.code is None
            await a.release("t", f"x{i}", 0, shared, verdict.day)
        await a.give_back()
        assert in_flight(redis_server, "t") == 0 and "t" not in a.leases
        assert await fill([b], tenant) == [100]
    finally:
        close([a, b])


async def test_small_limits_take_no_lease(redis_server: RedisServer) -> None:
    """Under 64 requests of headroom a limit is never leased: one exact call per
    request, the counts as before leases."""
    a, b = routers(redis_server, 2)
    try:
        for tenant in (
            Tenant("c", max_concurrent=2),
            Tenant("r", requests_per_minute=5, burst=5),
            Tenant("m", max_concurrent=63, requests_per_minute=60, burst=1000),
        ):
            counts = await fill([a, b], tenant)
            limit = tenant.max_concurrent or tenant.burst
            assert sum(counts) == limit, tenant
            assert not a.leases and not b.leases
            store = redis.Redis(port=redis_server.port, socket_timeout=2)
            assert not store.exists(f"hivenet:tenant:{{{tenant.name}}}:held")
            store.close()
    finally:
        close([a, b])


async def test_redis_lost_under_a_lease_counts_locally(redis_server: RedisServer) -> None:
    """A call that fails forfeits the slice: the router counts alone, as without
    leases, and a request admitted under the lease still releases cleanly."""
    (a,) = routers(redis_server, 1)
    tenant = Tenant("t", max_concurrent=100)
    try:
        verdict, shared = await a.admit(tenant, "x")
        assert shared and a.leases["t"].free > 0
        redis_server.kill()
        # Its lease still has room: admitted from it until it must call (TTL).
        a.leases["t"].taken = -1e9
        local, shared_local = await a.admit(tenant, "y")
        assert local.code is None and not shared_local and not a.up
        assert a.leases["t"].free == 0
        await a.release("t", "x", 0, shared, verdict.day)
        await a.release("t", "y", 0, shared_local, local.day)
        assert not a.leases["t"].used
    finally:
        close([a])


async def outage(state: TenantState, server: RedisServer) -> None:
    """Redis dies; the router's next call fails and it counts alone."""
    server.kill()
    for lease in state.leases.values():
        lease.taken = -1e9  # stale: the next admission must call
    verdict, shared = await state.admit(Tenant("probe", max_concurrent=1), "probe")
    assert not state.up and not shared and verdict.code is None
    await state.release("probe", "probe", 0, shared, verdict.day)


async def admitted_alone(
    state: TenantState, tenant: Tenant, need: int = 0, name: str = "local"
) -> list[str]:
    """Admit locally until refused: the tickets admitted."""
    tickets: list[str] = []
    while True:
        ticket = f"{name}-{len(tickets)}"
        verdict, shared = await state.admit(tenant, ticket, need=need, charge=need)
        assert not shared
        if verdict.code is not None:
            return tickets
        tickets.append(ticket)


@pytest.mark.parametrize("limit", [100, 5], ids=["leased", "exact"])
async def test_redis_lost_counts_what_is_in_flight(redis_server: RedisServer, limit: int) -> None:
    """Counting alone after Redis goes, the requests Redis admitted (from a lease, or by
    an exact call) and still running count against `max_concurrent`: the router never
    has more than the limit in flight, and each release makes room for one more."""
    (a,) = routers(redis_server, 1)
    tenant = Tenant("t", max_concurrent=limit)
    try:
        running = []
        for i in range(3):
            verdict, shared = await a.admit(tenant, f"x{i}")
            assert verdict.code is None and shared
            running.append((f"x{i}", verdict.day))
        assert ("t" in a.leases and bool(a.leases["t"].used)) == (limit == 100)
        await outage(a, redis_server)
        alone = await admitted_alone(a, tenant)
        assert len(alone) == limit - 3
        await a.release("t", running[0][0], 0, True, running[0][1])
        assert len(await admitted_alone(a, tenant, name="more")) == 1
        for ticket, day in running[1:]:
            await a.release("t", ticket, 0, True, day)
        assert len(a.local.counts["t"].inflight) == limit - 2
    finally:
        close([a])


async def test_redis_lost_starts_the_days_tokens_from_the_count_seen(
    redis_server: RedisServer,
) -> None:
    """The day's tokens counted alone start from the day's count the router last saw
    in Redis (3,000 of 10,000 spent: 7 more requests of 1,000, not 10)."""
    (a,) = routers(redis_server, 1)
    tenant = Tenant("t", tokens_per_day=10_000)
    try:
        for i in range(3):
            verdict, shared = await a.admit(tenant, f"x{i}", need=1000, charge=1000)
            assert verdict.code is None and shared
            await a.release("t", f"x{i}", 0, shared, verdict.day)
        await outage(a, redis_server)
        assert len(await admitted_alone(a, tenant, need=1000)) == 7
    finally:
        close([a])


async def test_redis_back_releases_on_its_own_counts(redis_server: RedisServer) -> None:
    """Redis back: the requests it admitted are its again (no longer in the local
    counts), and those admitted alone meanwhile stay in the local counts."""
    (a,) = routers(redis_server, 1)
    tenant = Tenant("t", max_concurrent=100)
    try:
        verdict, shared = await a.admit(tenant, "x")
        await outage(a, redis_server)
        local, _ = await a.admit(tenant, "y")
        assert a.local.counts["t"].inflight == {"x", "y"}
        redis_server.start()
        a._up()
        assert a.local.counts["t"].inflight == {"y"}
        await a.release("t", "x", 0, shared, verdict.day)
        await a.release("t", "y", 0, False, local.day)
        assert not a.local.counts["t"].inflight and not a.leases["t"].used
    finally:
        close([a])


async def test_top_ups_under_concurrent_load_never_pass_the_limit(
    redis_server: RedisServer,
) -> None:
    """Two routers, 32 requests at a time on each, their leases topped up in the
    background while they admit: never more than the limit, and all of it once both
    routers refuse."""
    states = routers(redis_server, 2)
    tenant = Tenant("t", max_concurrent=3000, requests_per_minute=60, burst=100_000)
    admitted = [0, 0]
    calls = [0]
    for state in states:
        assert state.store is not None
        # The whole suite on two cores held Redis past the 250 ms a router gives a call
        # once (CI), and the routers then counted alone, as documented: another test's
        # matter (test_redis_lost_under_a_lease_counts_locally), not this one's.
        state.store.timeout = 10.0
        evalsha = state.store.evalsha

        async def counted(*args: object, evalsha: Any = evalsha) -> Any:
            calls[0] += 1
            return await evalsha(*args)

        state.store.evalsha = counted  # type: ignore[method-assign]
    try:
        async with trio.open_nursery() as nursery:
            for state in states:
                nursery.start_soon(state.watch)

            async def client(k: int, c: int) -> None:
                n = 0
                while True:
                    n += 1
                    verdict, _ = await states[k].admit(tenant, f"{k}-{c}-{n}")
                    if verdict.code is not None:
                        return
                    admitted[k] += 1
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as clients:
                for k in (0, 1):
                    for c in range(32):
                        clients.start_soon(client, k, c)
            assert sum(admitted) <= 3000
            # Leased, and topped up as they grew: far fewer calls than admissions.
            assert calls[0] < sum(admitted) / 10
            # A top-up that came after the last refusal is spent by one more pass.
            await trio.sleep(0.05)
            rest = await fill(states, tenant)
            nursery.cancel_scope.cancel()
        assert sum(admitted) + sum(rest) == 3000
        assert in_flight(redis_server, "t") == 3000
    finally:
        close(states)
