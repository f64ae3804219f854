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
from router.admission.idle import IDLE_POOL
from router.admission.limits import AdmissionLimits, AdmitSettings
from router.admission.occupancy import Pool, Reservation
from router.admission.shared import GROW_STEP, PARK_POLL, SharedAdmission, SharedVerdict, entry_id
from router.metrics import RouterMetrics
from router.tenants.config import NO_LIMITS, ApiKey, KeyLimits

B1 = "b1"
B2 = "b2"
B4_OCCUPANCY = "b4_occupancy"
B4_ITPM = "b4_itpm"
B4_OTPM = "b4_otpm"
# Upstream's Retry-After for B2 and B4: a second, then the client's own backoff.
RETRY_AFTER = 1.0
_SHARED_MESSAGES = {
    B2: "the model is at capacity",
    B4_OCCUPANCY: "this key holds its share of the model's occupancy",
    B4_ITPM: "this key is over its input tokens per minute",
    B4_OTPM: "this key is over its output tokens per minute",
}


@dataclass(frozen=True)
class AdmissionRefused(RouterError):
    gate: str = ""


class Admitted:
    """An admitted request's hold on its pool and key: `finish` ends it exactly once."""

    __slots__ = (
        "entry",
        "estimate",
        "key_id",
        "label",
        "local",
        "model",
        "output_limit",
        "pending",
        "pool",
        "reservation",
        "undeclared",
        "usage",
    )

    def __init__(
        self,
        model: str,
        label: str,
        estimate: InputEstimate,
        reservation: Reservation | None,
        key_id: str | None,
        output_limit: int,
    ) -> None:
        self.model = model
        # The pool and buckets it was admitted under, kept: a model's label changes when
        # its first agent registers, and the release must find what the charge took.
        self.label = label
        self.estimate = estimate
        self.reservation = reservation
        self.key_id = key_id
        self.output_limit = output_limit  # the key's output_tokens_per_minute; 0: none
        self.usage: dict[str, int] | None = None
        # False once routing left the local pool (provider fallback).
        self.local = True
        # Its entry in Redis when the pool's counts are shared; None: this router's.
        self.entry: str | None = None
        self.undeclared = not estimate.declared_output
        # Streamed tokens not yet added to the shared entry (sent GROW_STEP at a time).
        self.pending = 0
        # The pool whose gauges the shared counts update (the sweep may drop it from
        # `Admission.pools` while a long request still runs).
        self.pool: Pool | None = None

    @property
    def grows(self) -> bool:
        held = self.reservation is not None or self.entry is not None
        return held and self.undeclared


class Admission:
    def __init__(
        self,
        settings: AdmitSettings,
        metrics: RouterMetrics,
        replicas: Callable[[str], int] = lambda model: 1,
        shared: SharedAdmission | None = None,
        label: Callable[[str], str] = lambda model: model,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.replicas = replicas
        # A model's name in the metrics, in `pools`, in the keys' buckets and in Redis:
        # every model no agent registered shares one (`Dispatcher.model_label`), so
        # clients' names make no series, no counts and no keys of their own.
        self.label = label
        # The counts in Redis (--state-url); local while it is unreachable.
        self.shared = shared
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
                    " (reduce the messages, tools, system prompt or images; max_tokens does"
                    " not count)",
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
        name = self.label(model)
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = Pool(name, quiet_since=trio.current_time())
            # Read at scrape time: a gauge set per change costs about 1.5 µs, and a
            # request changes its pool at least twice.
            m = self.metrics
            m.admission_occupancy.labels(name).set_function(pool.shown_occupancy)
            m.admission_inflight.labels(name).set_function(pool.shown_inflight)
            m.admission_budget.labels(name).set_function(lambda: pool.budget)
            m.admission_max_inflight.labels(name).set_function(lambda: pool.backstop)
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
        pooled = limits.pooled or (serverless and bool(own.max_occupancy_share))
        pool = self._pool(model, limits) if pooled else None
        footprint = estimate.footprint
        if pool is not None and pool.budget:
            budget = pool.budget
            if footprint > budget:
                # Not even an empty pool holds it: waiting would only delay the 429.
                return self._refuse(
                    model,
                    B2,
                    ErrorCode.TOO_MANY_CONCURRENT,
                    f"this request's footprint ({estimate.tokens} input tokens estimated"
                    f" + {estimate.declared_output} declared output) is over model"
                    f" {model!r}'s whole budget of {budget} tokens; lower max_tokens or"
                    " the input",
                    RETRY_AFTER,
                )
        if self.shared is not None and self.shared.up:
            admitted = await self._reserve_shared(
                model, limits, pool, key if serverless else None, own, estimate
            )
            if admitted is not None:
                return admitted
        buckets = None
        if serverless:
            assert key is not None
            buckets = self._buckets(key.id, self.label(model), own)
            refused = self._key_limits(model, limits, key.id, own, buckets, footprint, estimate)
            if refused is not None:
                return refused
        reservation = None
        if pool is not None:
            pool.fleet = None  # counting alone (no --state-url, or Redis away)
            if not pool.fits(footprint):
                if self.settings.park_timeout > 0:
                    with trio.move_on_after(self.settings.park_timeout):
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
            self.label(model) if pool is None else pool.model,
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
            pool = self.pools.get(self.label(model))
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

    async def _reserve_shared(
        self,
        model: str,
        limits: AdmissionLimits,
        pool: Pool | None,
        key: ApiKey | None,
        own: KeyLimits,
        estimate: InputEstimate,
    ) -> Admitted | AdmissionRefused | None:
        """B4 and B2 in Redis; None when Redis failed (the local counts decide)."""
        shared = self.shared
        assert shared is not None
        if pool is None:
            pool = self._pool(model, limits)
        share = 0
        if key is not None and own.max_occupancy_share:
            replicas = max(1, self.replicas(model))
            share = math.floor(own.max_occupancy_share * limits.admit_budget_tokens * replicas)
        pooled = limits.pooled or bool(share)
        key_id = key.id if key is not None else ""
        entry = entry_id()
        deadline = trio.current_time() + self.settings.park_timeout
        while True:
            verdict = await shared.call(
                shared.reserve,
                pool.model,
                entry,
                estimate.footprint,
                key_id,
                pool.budget,
                pool.backstop,
                share,
                own.input_tokens_per_minute if key is not None else 0,
                own.output_tokens_per_minute if key is not None else 0,
                estimate.tokens,
                pooled,
            )
            if not isinstance(verdict, SharedVerdict):
                return None
            if verdict.gate != B2 or trio.current_time() + PARK_POLL >= deadline:
                break
            await trio.sleep(PARK_POLL)
        self._shared_gauges(pool, verdict.occupancy, verdict.count)
        if verdict.gate:
            code = ErrorCode.TOO_MANY_CONCURRENT if verdict.gate == B2 else ErrorCode.RATE_LIMITED
            return self._refuse(
                model,
                verdict.gate,
                code,
                f"{_SHARED_MESSAGES[verdict.gate]} on {model!r} (counted over every router),"
                " please retry",
                max(RETRY_AFTER, verdict.wait),
            )
        admitted = Admitted(
            model,
            pool.model,
            estimate,
            None,
            key.id if key is not None else None,
            own.output_tokens_per_minute if key is not None else 0,
        )
        admitted.entry = entry if pooled else None
        admitted.pool = pool
        pool.served += 1
        return admitted

    async def grow(self, admitted: Admitted, n: int) -> None:
        """Output streamed by a request that declared no limit."""
        if admitted.reservation is not None:
            admitted.reservation.grow(n)
        elif admitted.entry is not None and self.shared is not None:
            admitted.pending += n
            if admitted.pending >= GROW_STEP:
                n, admitted.pending = admitted.pending, 0
                totals = await self.shared.call(
                    self.shared.change, admitted.label, admitted.entry, n
                )
                if isinstance(totals, tuple) and admitted.pool is not None:
                    self._shared_gauges(admitted.pool, *totals)

    async def left_local(self, admitted: Admitted) -> None:
        """Routing went to the external provider: no local KV cache is held any more."""
        admitted.local = False
        await self._release(admitted)

    async def finish(self, admitted: Admitted) -> None:
        """The request ended, however: learn, charge the key's output, release. Only
        the shared counts await (shielded: a cancelled request still gives back).

        A provider's answer is charged to the key's output bucket like an engine's
        (its output is the key's all the same) but teaches the estimator nothing: the
        provider counts with another tokenizer than the model's engines."""
        usage = admitted.usage
        if usage is not None:
            if admitted.local:
                self.estimator.learn(admitted.model, admitted.estimate, usage[PROMPT])
            if admitted.output_limit and admitted.key_id is not None:
                await self._spend(admitted, usage[COMPLETION])
        await self._release(admitted)

    async def _spend(self, admitted: Admitted, tokens: int) -> None:
        assert admitted.key_id is not None
        if self.shared is not None and self.shared.up:
            with trio.CancelScope(shield=True):
                done = await self.shared.call(
                    self.shared.spend,
                    admitted.label,
                    admitted.key_id,
                    admitted.output_limit,
                    tokens,
                )
            if done is not None:
                return
        now = trio.current_time()
        name = admitted.label
        buckets = self.buckets.get((admitted.key_id, name))
        if buckets is None:
            # Swept while the request ran (its buckets were full): it starts full again.
            buckets = self.buckets[(admitted.key_id, name)] = KeyModelBuckets()
        bucket = buckets.output
        if bucket is None:
            bucket = buckets.output = TokenBucket(
                admitted.output_limit, float(admitted.output_limit), now
            )
        bucket.refill(now, admitted.output_limit)
        # One answer drains at most the bucket (a minute of output).
        bucket.level = max(0.0, bucket.level - tokens)

    async def _release(self, admitted: Admitted) -> None:
        reservation = admitted.reservation
        if reservation is not None:
            reservation.release()
        entry, admitted.entry = admitted.entry, None
        if entry is not None and self.shared is not None:
            # Redis away: the entry expires after its lease.
            with trio.CancelScope(shield=True):
                totals = await self.shared.call(self.shared.change, admitted.label, entry, -1)
            if isinstance(totals, tuple) and admitted.pool is not None:
                self._shared_gauges(admitted.pool, *totals)

    def _shared_gauges(self, pool: Pool, occupancy: int, count: int) -> None:
        """Shared counts: the gauges show the fleet's occupancy, as every router sees it."""
        pool.fleet = (occupancy, count)

    def _refuse(
        self, model: str, gate: str, code: ErrorCode, message: str, retry_after: float | None
    ) -> AdmissionRefused:
        self.metrics.admission_rejections.labels(gate, self.label(model)).inc()
        return AdmissionRefused(code, message, retry_after=retry_after, gate=gate)

    def sweep(self, now: float) -> tuple[int, int]:
        """Upstream's idle-state cleanup, every `SWEEP_INTERVAL`: key buckets that are
        full, pools that held no request for `IDLE_POOL` seconds (with their gauges).
        Returns how many of each went."""
        full = [pair for pair, buckets in self.buckets.items() if buckets.idle(now)]
        for pair in full:
            del self.buckets[pair]
        quiet = []
        for model, pool in self.pools.items():
            if pool.inflight or pool.lot or pool.served != pool.seen:
                pool.seen, pool.quiet_since = pool.served, now
            elif now - pool.quiet_since >= IDLE_POOL:
                quiet.append(model)
        m = self.metrics
        gauges = (
            m.admission_occupancy,
            m.admission_inflight,
            m.admission_budget,
            m.admission_max_inflight,
        )
        for model in quiet:
            del self.pools[model]
            for gauge in gauges:
                gauge.remove(model)
        return len(full), len(quiet)

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
