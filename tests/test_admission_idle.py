"""Idle-state cleanup (issue 20, upstream's): every five minutes the sweeper forgets full
key buckets, tenant counts of a past UTC day and pools idle for fifteen minutes, and
keeps whatever still limits someone. Driven by trio's mock clock."""

from __future__ import annotations

from typing import Any

import trio

from router.admission.control import Admission, Admitted
from router.admission.idle import IDLE_POOL, SWEEP_INTERVAL, sweep_idle
from router.admission.limits import AdmissionLimits, AdmitSettings
from router.metrics import RouterMetrics
from router.tenants.config import ApiKey, KeyLimits, Tenant
from router.tenants.counters import DAY, LocalCounters


def chat(text: str = "x" * 320) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


async def test_the_sweep_forgets_only_what_a_new_record_would_hold(autojump_clock: Any) -> None:
    metrics = RouterMetrics()
    admission = Admission(AdmitSettings(park_timeout=0), metrics)
    wall = [10 * DAY + 3600.0]
    counters = LocalCounters(monotonic=trio.current_time, wall=lambda: wall[0])
    serverless = AdmissionLimits(mode="serverless", max_inflight=4)
    key = ApiKey("key-a", "h1", "t", limits=KeyLimits(input_tokens_per_minute=1000))
    done = await admission.reserve("m", serverless, key, admission.estimate("m", chat()))
    assert isinstance(done, Admitted)
    await admission.finish(done)
    # A request that outlives every sweep keeps its pool.
    held = await admission.reserve("long", serverless, None, admission.estimate("long", chat()))
    assert isinstance(held, Admitted)
    daily = Tenant(name="daily", tokens_per_day=1000)
    rated = Tenant(name="rated", requests_per_minute=10, burst=10)
    busy = Tenant(name="busy", max_concurrent=2)
    for tenant in (daily, rated, busy):
        assert counters.admit(tenant, "t1", 0, 50).code is None
    counters.release("daily", "t1", 0, "")
    counters.release("rated", "t1", 0, "")
    gauge = "hivenet_router_admission_inflight_requests"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sweep_idle, admission, counters)
        await trio.sleep(SWEEP_INTERVAL - 1)
        assert ("key-a", "m") in admission.buckets and "rated" in counters.counts
        await trio.sleep(2)  # the first sweep
        # The key's input bucket refilled within the minute; the rate bucket too.
        assert ("key-a", "m") not in admission.buckets
        assert set(counters.counts) == {"daily", "busy"}  # today's tokens, one in flight
        assert set(admission.pools) == {"m", "long"}
        # The pool is forgotten once a sweep finds it quiet for IDLE_POOL, no sooner.
        await trio.sleep(IDLE_POOL - SWEEP_INTERVAL)
        assert set(admission.pools) == {"m", "long"}
        await trio.sleep(SWEEP_INTERVAL)
        assert set(admission.pools) == {"long"}
        assert metrics.registry.get_sample_value(gauge, {"model": "m"}) is None
        assert metrics.registry.get_sample_value(gauge, {"model": "long"}) == 1
        # Midnight UTC: yesterday's count is what a new record holds.
        wall[0] += DAY
        await trio.sleep(SWEEP_INTERVAL)
        assert set(counters.counts) == {"busy"}
        nursery.cancel_scope.cancel()
    await admission.finish(held)


async def test_an_answer_outliving_its_swept_buckets_still_charges_its_output(
    autojump_clock: Any,
) -> None:
    admission = Admission(AdmitSettings(park_timeout=0), RouterMetrics())
    limits = AdmissionLimits(mode="serverless")
    key = ApiKey("key-a", "h1", "t", limits=KeyLimits(output_tokens_per_minute=600))
    held = await admission.reserve("m", limits, key, admission.estimate("m", chat()))
    assert isinstance(held, Admitted)
    await trio.sleep(SWEEP_INTERVAL)
    assert admission.sweep(trio.current_time()) == (1, 0)
    held.usage = {"prompt_tokens": 104, "completion_tokens": 500}
    await admission.finish(held)
    assert admission.buckets[("key-a", "m")].output.level == 100  # type: ignore[union-attr]
