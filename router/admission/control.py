"""Admission control in the order upstream runs it: B1 request caps, B2 pool occupancy,
B4 serverless key limits; the daily token budget is the tenant gate's (it reads the
same estimate).

`caps` is a pure check; `reserve` takes occupancy (parking while the pool is full) and
the key's input tokens; `finish` learns from the exact usage, charges the key's output
bucket and releases. Refusals carry the gate that refused (`b1`, `b2`, `b4_occupancy`,
`b4_itpm`, `b4_otpm`: upstream's `reason` label) for the metric and the audit line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from protocol.errors import ErrorCode, RouterError
from protocol.usage import COMPLETION, PROMPT
from router.admission.buckets import KeyModelBuckets, TokenBucket
from router.admission.estimate import Estimator, InputEstimate
from router.admission.limits import AdmissionLimits, AdmitSettings
from router.admission.occupancy import Pool, Reservation
from router.metrics import RouterMetrics
from router.tenants.config import NO_LIMITS, ApiKey, KeyLimits

B1 = "b1"
B2 = "b2"
B4_OCCUPANCY = "b4_occupancy"
B4_ITPM = "b4_itpm"
B4_OTPM = "b4_otpm"
# Upstream's Retry-After for B2 and B4: a second, then the client's own backoff.
RETRY_AFTER = 1.0


@dataclass(frozen=True)
class AdmissionRefused(RouterError):
    gate: str = ""


class Admitted:
    """An admitted request's hold on its pool and key: `finish` ends it exactly once."""

    __slots__ = ("estimate", "key_id", "local", "model", "output_limit", "reservation", "usage")

    def __init__(
        self,
        model: str,
        estimate: InputEstimate,
        reservation: Reservation | None,
        key_id: str | None,
        output_limit: int,
    ) -> None:
        self.model = model
        self.estimate = estimate
        self.reservation = reservation
        self.key_id = key_id
        self.output_limit = output_limit  # the key's output_tokens_per_minute; 0: none
        self.usage: dict[str, int] | None = None
        # False once routing left the local pool (provider fallback).
        self.local = True

    def grow(self, n: int) -> None:
        if self.reservation is not None:
            self.reservation.grow(n)

    @property
    def grows(self) -> bool:
        return self.reservation is not None and self.reservation.grows


class Admission:
    def __init__(
        self,
        settings: AdmitSettings,
        metrics: RouterMetrics,
        replicas: Callable[[str], int] = lambda model: 1,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.replicas = replicas
        self.estimator = Estimator()
        self.pools: dict[str, Pool] = {}
        self.buckets: dict[tuple[str, str], KeyModelBuckets] = {}

    def estimate(self, model: str, payload: dict) -> InputEstimate:
        return self.estimator.estimate(model, payload)

    def caps(
        self, model: str, limits: AdmissionLimits, key: KeyLimits, estimate: InputEstimate
    ) -> AdmissionRefused | None:
        """B1: the input and image caps of the model's policy and of the key."""
        for cap, what in ((limits.max_input_tokens, "model"), (key.max_input_tokens, "key")):
            if cap and estimate.tokens > cap:
                return self._refuse(
                    model,
                    B1,
                    ErrorCode.INPUT_TOO_LONG,
                    f"input is {estimate.tokens} tokens, over the {what} limit of {cap}"
                    " (reduce the messages, tools or system prompt; max_tokens does not count)",
                    None,
                )
        for cap, what in ((limits.images_max, "model"), (key.images_max, "key")):
            if cap and estimate.images > cap:
                return self._refuse(
                    model,
                    B1,
                    ErrorCode.INPUT_TOO_LONG,
                    f"input has {estimate.images} images, over the {what} limit of {cap}",
                    None,
                )
        return None

    def _pool(self, model: str, limits: AdmissionLimits) -> Pool:
        pool = self.pools.get(model)
        if pool is None:
            pool = self.pools[model] = Pool(model, on_change=self._gauges)
        replicas = max(1, self.replicas(model))
        pool.budget = math.floor(self.settings.fraction * limits.admit_budget_tokens * replicas)
        pool.backstop = limits.max_inflight * replicas
        return pool

    async def reserve(
        self,
        model: str,
        limits: AdmissionLimits,
        key: ApiKey | None,
        estimate: InputEstimate,
    ) -> Admitted | AdmissionRefused:
        """B4's checks (immediate), then B2 (parking), then B4's input charge."""
        own = key.limits_for(model) if key is not None else NO_LIMITS
        serverless = key is not None and own.serverless(limits.mode)
        footprint = estimate.footprint
        buckets = None
        if serverless:
            assert key is not None
            buckets = self._buckets(key.id, model, own)
            refused = self._key_limits(model, limits, key.id, own, buckets, footprint, estimate)
            if refused is not None:
                return refused
        reservation = None
        if limits.pooled or (serverless and own.max_occupancy_share):
            pool = self._pool(model, limits)
            if not pool.fits(footprint):
                deadline = trio.current_time() + self.settings.park_timeout
                with trio.move_on_at(deadline):
                    while not pool.fits(footprint):
                        await pool.lot.park()
                if not pool.fits(footprint):
                    return self._refuse(
                        model,
                        B2,
                        ErrorCode.TOO_MANY_CONCURRENT,
                        f"model {model!r} is at capacity ({pool.occupancy} of {pool.budget}"
                        f" tokens, {pool.inflight} of {pool.backstop or 'unlimited'} requests"
                        " in flight), please retry",
                        RETRY_AFTER,
                    )
            reservation = Reservation(
                pool,
                key.id if serverless and key is not None else None,
                estimate.tokens,
                estimate.declared_output,
                grows=not estimate.declared_output,
            )
        if buckets is not None and buckets.input is not None:
            buckets.input.level -= estimate.tokens
        return Admitted(
            model,
            estimate,
            reservation,
            key.id if key is not None else None,
            own.output_tokens_per_minute if serverless else 0,
        )

    def _buckets(self, key_id: str, model: str, own: KeyLimits) -> KeyModelBuckets:
        buckets = self.buckets.get((key_id, model))
        if buckets is None:
            buckets = self.buckets[(key_id, model)] = KeyModelBuckets()
        now = trio.current_time()
        for name, per_minute in (
            ("input", own.input_tokens_per_minute),
            ("output", own.output_tokens_per_minute),
        ):
            bucket: TokenBucket | None = getattr(buckets, name)
            if not per_minute:
                setattr(buckets, name, None)
            elif bucket is None:
                setattr(buckets, name, TokenBucket(per_minute, float(per_minute), now))
            else:
                bucket.refill(now, per_minute)
        return buckets

    def _key_limits(
        self,
        model: str,
        limits: AdmissionLimits,
        key_id: str,
        own: KeyLimits,
        buckets: KeyModelBuckets,
        footprint: int,
        estimate: InputEstimate,
    ) -> AdmissionRefused | None:
        if own.max_occupancy_share:
            # Fairness, not box safety: without HIVENET_ROUTER_ADMIT_FRACTION, as upstream.
            replicas = max(1, self.replicas(model))
            share = math.floor(own.max_occupancy_share * limits.admit_budget_tokens * replicas)
            pool = self.pools.get(model)
            held = pool.by_key.get(key_id, 0) if pool is not None else 0
            if held and held + footprint > share:
                return self._refuse(
                    model,
                    B4_OCCUPANCY,
                    ErrorCode.RATE_LIMITED,
                    f"key {key_id} holds {held} tokens in flight on {model!r}; its share"
                    f" ({own.max_occupancy_share:g}) is {share}",
                    RETRY_AFTER,
                )
        bucket = buckets.input
        if bucket is not None and bucket.level < estimate.tokens:
            return self._refuse(
                model,
                B4_ITPM,
                ErrorCode.RATE_LIMITED,
                f"key {key_id} is over its {own.input_tokens_per_minute} input tokens per"
                f" minute on {model!r}",
                max(RETRY_AFTER, bucket.seconds_until(estimate.tokens)),
            )
        bucket = buckets.output
        if bucket is not None and bucket.level < 1.0:
            return self._refuse(
                model,
                B4_OTPM,
                ErrorCode.RATE_LIMITED,
                f"key {key_id} is over its {own.output_tokens_per_minute} output tokens per"
                f" minute on {model!r}",
                max(RETRY_AFTER, bucket.seconds_until(1.0)),
            )
        return None

    def left_local(self, admitted: Admitted) -> None:
        """Routing went to the external provider: no local KV cache is held any more."""
        admitted.local = False
        self._release(admitted)

    def finish(self, admitted: Admitted) -> None:
        """The request ended, however: learn, charge the key's output, release."""
        usage = admitted.usage
        if usage is not None and admitted.local:
            self.estimator.learn(admitted.model, admitted.estimate, usage[PROMPT])
            if admitted.output_limit and admitted.key_id is not None:
                buckets = self.buckets.get((admitted.key_id, admitted.model))
                if buckets is not None and buckets.output is not None:
                    bucket = buckets.output
                    bucket.refill(trio.current_time(), admitted.output_limit)
                    # One answer drains at most the bucket (a minute of output).
                    bucket.level = max(0.0, bucket.level - usage[COMPLETION])
        self._release(admitted)

    def _release(self, admitted: Admitted) -> None:
        reservation = admitted.reservation
        if reservation is not None:
            reservation.release()

    def _gauges(self, pool: Pool) -> None:
        m = self.metrics
        m.admission_occupancy.labels(pool.model).set(pool.occupancy)
        m.admission_budget.labels(pool.model).set(pool.budget)
        m.admission_inflight.labels(pool.model).set(pool.inflight)
        m.admission_max_inflight.labels(pool.model).set(pool.backstop)

    def _refuse(
        self, model: str, gate: str, code: ErrorCode, message: str, retry_after: float | None
    ) -> AdmissionRefused:
        self.metrics.admission_rejections.labels(gate, model).inc()
        return AdmissionRefused(code, message, retry_after=retry_after, gate=gate)

    def statistics(self) -> dict[str, dict[str, int]]:
        """Per model: occupancy, budget, in flight, backstop, parked (/admin views, tests)."""
        return {
            model: {
                "occupancy_tokens": pool.occupancy,
                "budget_tokens": pool.budget,
                "inflight": pool.inflight,
                "max_inflight": pool.backstop,
                "parked": len(pool.lot),
            }
            for model, pool in self.pools.items()
        }
