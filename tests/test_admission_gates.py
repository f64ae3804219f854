"""Admission control in process (issue 20): the estimate, B1, B2 parking, B4 buckets."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from protocol.errors import ErrorCode
from router.admission.control import B1, B2, B4_ITPM, B4_OCCUPANCY, B4_OTPM, Admission, Admitted
from router.admission.estimate import (
    DEFAULT_IMAGE_TOKENS,
    DEFAULT_TOKENS_PER_CHAR,
    MAX_IMAGE_TOKENS,
    MAX_TOKENS_PER_CHAR,
    MESSAGE_OVERHEAD,
    MIN_IMAGE_TOKENS,
    Estimator,
)
from router.admission.limits import AdmissionLimits, AdmitSettings
from router.admission.shared import SharedAdmission
from router.metrics import UNREGISTERED_MODEL, RouterMetrics
from router.tenants.config import ApiKey, KeyLimits
from router.tenants.shared import TenantState
from tests.redis_server import RedisServer

TEXT = "x" * 320  # 100 tokens at the default 3.2 characters per token


def chat(text: str = TEXT, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def test_the_estimate_counts_every_part_of_the_prompt_in_both_protocols() -> None:
    est = Estimator()
    plain = est.estimate("m", chat())
    assert plain.tokens == 100 + MESSAGE_OVERHEAD and plain.messages == 1
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "b" * 300}}}]
    assert est.estimate("m", chat(tools=tools)).tokens > plain.tokens + 90
    anthropic = {
        "model": "m",
        "system": [{"type": "text", "text": TEXT}],
        "max_tokens": 50,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": TEXT}, {"type": "image"}]},
            {"role": "assistant", "content": []},
        ],
    }
    both = est.estimate("m", anthropic)
    # The image counts too, at the default per-image estimate.
    assert both.tokens == 200 + 3 * MESSAGE_OVERHEAD + DEFAULT_IMAGE_TOKENS
    assert both.images == 1 and both.image_tokens == DEFAULT_IMAGE_TOKENS
    assert both.declared_output == 50 and both.footprint == both.tokens + 50
    openai_image = chat([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}])
    assert est.estimate("m", openai_image).images == 1
    # max_completion_tokens first; a negative limit is undeclared, not a discount.
    assert est.estimate("m", chat(max_completion_tokens=7, max_tokens=9)).declared_output == 7
    assert est.estimate("m", chat(max_tokens=-5)).declared_output == 0
    assert est.estimate("m", {"model": "e", "input": ["a" * 32, [1, 2, 3]]}).tokens == 13
    assert (
        est.estimate("m", {"model": "r", "query": "q" * 32, "documents": ["d" * 32]}).tokens == 20
    )


def test_the_ratio_learns_from_exact_usage_and_is_clamped() -> None:
    est = Estimator()
    first = est.estimate("m", chat())
    # The engine counted twice as many tokens: the ratio moves a fifth of the way.
    est.learn("m", first, 200 + MESSAGE_OVERHEAD)
    assert est.ratio("m") > DEFAULT_TOKENS_PER_CHAR
    assert est.ratio("other") == DEFAULT_TOKENS_PER_CHAR
    for _ in range(100):
        est.learn("m", first, 10**9)  # a hostile or broken report
    assert 0.99 < est.ratio("m") <= MAX_TOKENS_PER_CHAR
    image = est.estimate("n", chat([{"type": "text", "text": TEXT}, {"type": "image_url"}]))
    est.learn("n", image, 5000)
    assert est.ratio("n") == DEFAULT_TOKENS_PER_CHAR


def test_the_per_image_estimate_learns_from_exact_usage_and_is_clamped() -> None:
    est = Estimator()
    two = chat([{"type": "text", "text": TEXT}, {"type": "image_url"}, {"type": "image_url"}])
    first = est.estimate("m", two)
    assert first.tokens == 100 + MESSAGE_OVERHEAD + 2 * DEFAULT_IMAGE_TOKENS
    # The engine counted 1,000 tokens per image once the text's 104 are taken off.
    for _ in range(50):
        est.learn("m", est.estimate("m", two), 104 + 2000)
    assert abs(est.per_image("m") - 1000) < 1
    assert est.estimate("m", two).tokens == 104 + 2000
    assert est.ratio("m") == DEFAULT_TOKENS_PER_CHAR  # the text ratio is untouched
    assert est.per_image("other") == DEFAULT_IMAGE_TOKENS
    for _ in range(100):
        est.learn("m", first, 10**9)
    assert MAX_IMAGE_TOKENS - 1 < est.per_image("m") <= MAX_IMAGE_TOKENS
    for _ in range(100):
        est.learn("m", first, 0)
    assert MIN_IMAGE_TOKENS <= est.per_image("m") < MIN_IMAGE_TOKENS + 1


def test_b1_caps_of_the_policy_and_of_the_key() -> None:
    admission = Admission(AdmitSettings(), RouterMetrics())
    estimate = admission.estimate("m", chat())
    limits = AdmissionLimits(max_input_tokens=50)
    refused = admission.caps("m", limits, KeyLimits(), estimate)
    assert refused is not None and refused.code == ErrorCode.INPUT_TOO_LONG and refused.gate == B1
    assert refused.http_status == 400 and "over the model limit of 50" in refused.message
    assert admission.caps("m", AdmissionLimits(), KeyLimits(max_input_tokens=50), estimate)
    assert admission.caps("m", AdmissionLimits(max_input_tokens=500), KeyLimits(), estimate) is None
    two = admission.estimate("m", chat([{"type": "image_url"}, {"type": "image_url"}]))
    assert admission.caps("m", AdmissionLimits(images_max=1), KeyLimits(), two) is not None


async def test_b2_parks_until_occupancy_leaves_then_refuses_with_retry_after() -> None:
    metrics = RouterMetrics()
    admission = Admission(AdmitSettings(fraction=1.0, park_timeout=0.25), metrics, lambda m: 2)
    limits = AdmissionLimits(admit_budget_tokens=150)  # 300 over two replicas
    est = admission.estimate("m", chat(max_tokens=46))  # 104 + 46 = 150
    first = await admission.reserve("m", limits, None, est)
    second = await admission.reserve("m", limits, None, est)
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    assert admission.statistics()["m"]["occupancy_tokens"] == 300
    got: list[object] = []

    async def third() -> None:
        got.append(await admission.reserve("m", limits, None, est))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.statistics()["m"]["parked"] == 1
        await admission.finish(first)  # room: the parked request goes in
    assert isinstance(got[0], Admitted)
    refused = await admission.reserve("m", limits, None, est)
    assert not isinstance(refused, Admitted) and refused.gate == B2
    assert refused.code == ErrorCode.TOO_MANY_CONCURRENT and refused.retry_headers()
    await admission.finish(second)
    await admission.finish(got[0])  # type: ignore[arg-type]
    await admission.finish(got[0])  # type: ignore[arg-type]  # twice is once
    assert admission.statistics()["m"] == {
        "occupancy_tokens": 0,
        "budget_tokens": 300,
        "inflight": 0,
        "max_inflight": 0,
        "parked": 0,
    }
    sample = metrics.registry.get_sample_value
    assert sample("hivenet_router_admission_occupancy_tokens", {"model": "m"}) == 0
    assert sample("hivenet_router_admission_rejections_total", {"reason": "b2", "model": "m"}) == 1


@contextlib.contextmanager
def shared_store(tmp_path: Path, store: str) -> Iterator[SharedAdmission | None]:
    """Admission's shared counts in a real Redis for `store == "redis"`, else None."""
    if store != "redis":
        yield None
        return
    server = RedisServer(tmp_path, dict(os.environ)).start()
    try:
        state = TenantState(server.url, RouterMetrics(), lease=60.0)
        state._up()
        try:
            yield SharedAdmission(state, 60.0)
        finally:
            state.close()
    finally:
        server.stop()


@pytest.mark.parametrize("store", ["local", "redis"])
async def test_models_no_agent_registered_share_one_label_and_pool(
    tmp_path: Path, store: str
) -> None:
    """Clients pick model names; only registered ones become series, pools and, with
    Redis, keys there."""
    metrics = RouterMetrics()

    def label(model: str) -> str:
        return model if model == "m" else UNREGISTERED_MODEL

    with shared_store(tmp_path, store) as shared:
        admission = Admission(AdmitSettings(park_timeout=0), metrics, shared=shared, label=label)
        limits = AdmissionLimits(max_inflight=1)

        async def reserve(model: str) -> object:
            return await admission.reserve(model, limits, None, admission.estimate(model, chat()))

        x1, m = await reserve("x1"), await reserve("m")
        assert isinstance(x1, Admitted) and isinstance(m, Admitted)
        # x1 holds the one place of the pool every unregistered model shares.
        for model in ("x2", "x3"):
            assert not isinstance(await reserve(model), Admitted)
        assert sorted(admission.statistics()) == [UNREGISTERED_MODEL, "m"]
        sample = metrics.registry.get_sample_value
        rejections = "hivenet_router_admission_rejections_total"
        assert sample(rejections, {"reason": "b2", "model": UNREGISTERED_MODEL}) == 2
        assert sample(rejections, {"reason": "b2", "model": "x2"}) is None
        if shared is not None:
            assert shared.state.client is not None
            names = {k.decode() for k in shared.state.client.scan_iter(match="hivenet:admission:*")}
            assert names and all("{m}" in n or UNREGISTERED_MODEL in n for n in names), names
        await admission.finish(x1)
        await admission.finish(m)


@pytest.mark.parametrize("store", ["local", "redis"])
async def test_a_request_is_released_under_the_label_it_was_admitted_under(
    tmp_path: Path, store: str
) -> None:
    """A model's first agent registering while its request runs changes the model's
    label: the request's place and its key's output still go back to the pool and the
    bucket that admitted it (the shared ones with Redis)."""
    registered: set[str] = set()

    def label(model: str) -> str:
        return model if model in registered else UNREGISTERED_MODEL

    with shared_store(tmp_path, store) as shared:
        admission = Admission(
            AdmitSettings(park_timeout=0), RouterMetrics(), shared=shared, label=label
        )
        limits = AdmissionLimits(mode="serverless", max_inflight=1)
        key = ApiKey("key-a", "h", "t", limits=KeyLimits(output_tokens_per_minute=10))

        async def reserve(model: str, text: str = TEXT) -> object:
            return await admission.reserve(
                model, limits, key, admission.estimate(model, chat(text))
            )

        held = await reserve("x1")
        assert isinstance(held, Admitted)
        registered.add("x1")
        held.usage = {"prompt_tokens": 100, "completion_tokens": 500}
        await admission.finish(held)
        # The unregistered pool's one place is free again, and the key's bucket there
        # drained.
        again = await reserve("x2", "hi")
        assert not isinstance(again, Admitted) and again.gate == B4_OTPM, again
        keyless = await admission.reserve("x2", limits, None, admission.estimate("x2", chat()))
        assert isinstance(keyless, Admitted), keyless
        await admission.finish(keyless)


async def test_b2_max_inflight_and_an_undeclared_output_grows() -> None:
    admission = Admission(AdmitSettings(park_timeout=0), RouterMetrics())
    limits = AdmissionLimits(max_inflight=1)
    est = admission.estimate("m", chat())
    first = await admission.reserve("m", limits, None, est)
    assert isinstance(first, Admitted) and first.grows
    await admission.grow(first, 30)
    assert admission.statistics()["m"]["occupancy_tokens"] == est.tokens + 30
    assert not isinstance(await admission.reserve("m", limits, None, est), Admitted)
    await admission.finish(first)
    assert admission.statistics()["m"]["occupancy_tokens"] == 0


async def test_b4_serverless_keys_each_have_their_own_buckets() -> None:
    admission = Admission(AdmitSettings(park_timeout=0), RouterMetrics())
    limits = AdmissionLimits(mode="serverless", admit_budget_tokens=1000)
    own = KeyLimits(input_tokens_per_minute=250, output_tokens_per_minute=10)
    a, b = ApiKey("key-a", "h1", "t", limits=own), ApiKey("key-b", "h2", "t", limits=own)
    est = admission.estimate("m", chat())  # 104 tokens
    one = await admission.reserve("m", limits, a, est)
    two = await admission.reserve("m", limits, a, est)
    assert isinstance(one, Admitted) and isinstance(two, Admitted)
    refused = await admission.reserve("m", limits, a, est)
    assert not isinstance(refused, Admitted) and refused.gate == B4_ITPM
    assert refused.code == ErrorCode.RATE_LIMITED
    # Another key, even of the same tenant, has its own bucket.
    other = await admission.reserve("m", limits, b, est)
    assert isinstance(other, Admitted)
    other.usage = {"prompt_tokens": 104, "completion_tokens": 500}
    await admission.finish(other)
    refused = await admission.reserve("m", limits, b, admission.estimate("m", chat("hi")))
    assert not isinstance(refused, Admitted) and refused.gate == B4_OTPM
    for held in (one, two):
        await admission.finish(held)


async def test_b4_occupancy_share_refuses_at_once() -> None:
    admission = Admission(AdmitSettings(park_timeout=5), RouterMetrics())
    limits = AdmissionLimits(mode="serverless", admit_budget_tokens=1000)
    key = ApiKey("key-a", "h", "t", limits=KeyLimits(max_occupancy_share=0.2))
    est = admission.estimate("m", chat(max_tokens=46))  # 150
    first = await admission.reserve("m", limits, key, est)
    assert isinstance(first, Admitted)
    with trio.fail_after(1):  # immediate, not parked
        refused = await admission.reserve("m", limits, key, est)
    assert not isinstance(refused, Admitted) and refused.gate == B4_OCCUPANCY
    await admission.finish(first)
    again = await admission.reserve("m", limits, key, est)
    assert isinstance(again, Admitted)
    await admission.finish(again)
    # Reserved mode: the share is not this key's limit.
    reserved = AdmissionLimits(admit_budget_tokens=1000)
    keys = [await admission.reserve("m", reserved, key, est) for _ in range(3)]
    assert all(isinstance(k, Admitted) for k in keys)


async def test_a_providers_answer_charges_the_output_bucket_and_teaches_nothing() -> None:
    admission = Admission(AdmitSettings(park_timeout=0), RouterMetrics())
    limits = AdmissionLimits(mode="serverless", max_inflight=4)
    key = ApiKey("key-a", "h1", "t", limits=KeyLimits(output_tokens_per_minute=600))
    held = await admission.reserve("m", limits, key, admission.estimate("m", chat()))
    assert isinstance(held, Admitted)
    await admission.left_local(held)
    assert admission.statistics()["m"]["inflight"] == 0
    # The provider's tokenizer says 30 prompt tokens for the 104 estimated.
    held.usage = {"prompt_tokens": 30, "completion_tokens": 500}
    await admission.finish(held)
    assert admission.estimator.ratios == {}
    assert admission.buckets[("key-a", "m")].output.level == 100  # type: ignore[union-attr]


async def test_b2_stays_a_limit_without_healthy_replicas() -> None:
    admission = Admission(AdmitSettings(fraction=1.0, park_timeout=0), RouterMetrics(), lambda m: 0)
    limits = AdmissionLimits(admit_budget_tokens=200)  # floored at one replica: 200
    # Over the whole budget: refused at once, even by the empty pool.
    huge = await admission.reserve("m", limits, None, admission.estimate("m", chat(max_tokens=97)))
    assert not isinstance(huge, Admitted) and huge.gate == B2
    assert "whole budget of 200" in huge.message
    est = admission.estimate("m", chat(max_tokens=50))  # 104 + 50
    first = await admission.reserve("m", limits, None, est)
    assert isinstance(first, Admitted)
    second = await admission.reserve("m", limits, None, est)
    assert not isinstance(second, Admitted) and second.gate == B2
    await admission.finish(first)
    assert admission.statistics()["m"]["inflight"] == 0
