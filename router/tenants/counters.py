"""A tenant's counts: request bucket, concurrent requests, tokens of the day.

`LocalCounters` is what one router keeps alone (the state without `--state-url`, and
the fallback while Redis is unreachable); `router/tenants/shared.py` keeps the same
counts in Redis with the same rules, so several routers enforce one quota.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.errors import ErrorCode
from router.tenants.config import Tenant

DAY = 86400.0
# A refusal with nothing better to say waits this long.
MIN_RETRY_AFTER = 1.0


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__
# (about 1 µs for these five); nothing changes a verdict once made.
@dataclass(slots=True)
class Verdict:
    code: ErrorCode | None  # None: admitted
    retry_after: float = 0.0
    # What an admitted request leaves (X-RateLimit-Remaining-*), and on a refusal what
    # refused it: 0 requests, or the tokens the day still has; None: not known here.
    requests_left: int | None = None
    tokens_left: int | None = None
    # The UTC day an admission's tokens were charged to: its correction at release
    # goes to that day, not to the day the answer happens to end on.
    day: str = ""


ADMITTED = Verdict(None)


@functools.lru_cache(maxsize=4)
def _day_name(day: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(day * DAY))


def utc_day(now: float) -> str:
    # strftime costs 3 µs, a quarter of a request's admission: once per day instead.
    return _day_name(int(now // DAY))


def until_midnight(now: float) -> float:
    return DAY - now % DAY


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    # The burst and rate of the last admission, for the idle sweep.
    burst: float = 0.0
    rate: float = 0.0

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.stamp) * self.rate >= self.burst


@dataclass
class _TenantCounts:
    bucket: _Bucket | None = None
    inflight: set[str] = field(default_factory=set)
    day: str = ""
    tokens: int = 0


class LocalCounters:
    """Counts in this router's memory; `monotonic` for buckets, `wall` for days."""

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.monotonic = monotonic
        self.wall = wall
        self.counts: dict[str, _TenantCounts] = {}

    def _of(self, tenant: str) -> _TenantCounts:
        counts = self.counts.get(tenant)
        if counts is None:
            counts = self.counts[tenant] = _TenantCounts()
        return counts

    def admit(self, tenant: Tenant, ticket_id: str, need: int = 0, charge: int = 0) -> Verdict:
        """Checked in this order, and nothing is taken unless all pass. `need` is what
        the request may cost (input estimate + declared output), which must fit in the
        day's budget; `charge` (its input estimate) is taken now, the rest trued up by
        `release` with the exact usage."""
        counts = self._of(tenant.name)
        wall = self.wall()
        day = ""
        if tenant.tokens_per_day:
            day = utc_day(wall)
            if counts.day != day:
                counts.day, counts.tokens = day, 0
            used = counts.tokens
            if used >= tenant.tokens_per_day or used + need > tenant.tokens_per_day:
                left = max(0, tenant.tokens_per_day - used)
                return Verdict(ErrorCode.QUOTA_EXCEEDED, until_midnight(wall), None, left)
        if tenant.max_concurrent and len(counts.inflight) >= tenant.max_concurrent:
            return Verdict(ErrorCode.TOO_MANY_CONCURRENT, MIN_RETRY_AFTER)
        requests_left = None
        if tenant.requests_per_minute:
            now = self.monotonic()
            rate = tenant.requests_per_minute / 60.0
            bucket = counts.bucket
            burst = float(tenant.burst)
            if bucket is None:
                bucket = counts.bucket = _Bucket(burst, now)
            tokens = min(burst, bucket.tokens + (now - bucket.stamp) * rate)
            bucket.tokens, bucket.stamp, bucket.burst, bucket.rate = tokens, now, burst, rate
            if tokens < 1.0:
                return Verdict(ErrorCode.RATE_LIMITED, (1.0 - tokens) / rate, 0)
            bucket.tokens = tokens - 1.0
            requests_left = int(bucket.tokens)
        if tenant.max_concurrent:
            counts.inflight.add(ticket_id)
        # What the day has left before this request's charge, as upstream's header says.
        tokens_left = (
            max(0, tenant.tokens_per_day - counts.tokens) if tenant.tokens_per_day else None
        )
        if tenant.tokens_per_day:
            counts.tokens += charge
        if requests_left is None and tokens_left is None:
            return ADMITTED
        return Verdict(None, 0.0, requests_left, tokens_left, day)

    def release(self, tenant: str, ticket_id: str, tokens: int, day: str) -> None:
        """`tokens`: the usage still to charge to `day` (negative: the admission
        charged more). A day already over is not counted any more: its correction is
        dropped, lest a refund of yesterday's estimate raise today's budget."""
        counts = self._of(tenant)
        counts.inflight.discard(ticket_id)
        if tokens and day == utc_day(self.wall()):
            if counts.day != day:
                counts.day, counts.tokens = day, 0
            # Never below zero: a refund of a charge these counts never saw (taken in
            # Redis before it went away) must not lend the tenant tokens.
            counts.tokens = max(0, counts.tokens + tokens)

    def hold(self, tenant: str, tickets: set[str], day: str = "", used: int = 0) -> None:
        """Redis went away: `tickets` (admitted there, still in flight) count against
        `max_concurrent` here until released, and `day`'s count is at least `used` (the
        day's count last seen in Redis), so a router counting alone starts from what it
        knew, not from zero."""
        counts = self._of(tenant)
        counts.inflight |= tickets
        if day and day == utc_day(self.wall()):
            if counts.day != day:
                counts.day, counts.tokens = day, 0
            counts.tokens = max(counts.tokens, used)

    def unhold(self, tenant: str, tickets: set[str]) -> None:
        """Redis is back: `tickets` are counted there again (their release goes there)."""
        counts = self.counts.get(tenant)
        if counts is not None:
            counts.inflight -= tickets

    def sweep(self) -> int:
        """Forget what a new record would hold alike: a full request bucket, a count of
        a past UTC day, a record with neither and nothing in flight. Returns how many
        records went."""
        now, today = self.monotonic(), utc_day(self.wall())
        gone = []
        for name, counts in self.counts.items():
            bucket = counts.bucket
            if bucket is not None and bucket.full(now):
                counts.bucket = None
            if counts.day and counts.day != today:
                counts.day, counts.tokens = "", 0
            if counts.bucket is None and not counts.inflight and not counts.day:
                gone.append(name)
        for name in gone:
            del self.counts[name]
        return len(gone)

    def used_today(self, tenant: str) -> int:
        counts = self.counts.get(tenant)
        return counts.tokens if counts is not None and counts.day == utc_day(self.wall()) else 0
