"""Tenant counts shared by several routers in Redis, with a local fallback.

Calls go through the router's own trio-native client (router/redis_trio.py: one
pipelined connection, no thread per call; the calls of concurrent requests share round
trips). Every call has a short deadline and no retries; the first failure switches the
router to its local counts (one log line, the gauge, `/health`), and a background task
pings Redis until it answers again. Each check-and-take is one Lua script, so two
routers can never both take the last unit of a bucket: the counts stay exact across
routers, with no budget held locally.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import redis
import trio

from protocol.errors import ErrorCode
from protocol.logs import quote
from router import state_url
from router.metrics import RouterMetrics
from router.redis_trio import RedisTrio, Script, StoreError
from router.tenants.config import Tenant
from router.tenants.counters import (
    LocalCounters,
    Verdict,
    until_midnight,
    utc_day,
)

log = logging.getLogger("tenant")

# Redis on the same network answers in well under a millisecond; past this the router
# counts alone rather than hold requests.
CALL_TIMEOUT = 0.25
PING_INTERVAL = 1.0

# KEYS: bucket hash, in-flight sorted set, tokens-of-the-day counter.
# ARGV: rate (requests/s, 0: none), burst, max concurrent (0: none), tokens per day
# (0: none), ticket id, lease seconds, seconds to midnight, tokens the request may need,
# tokens charged now (its input estimate).
# Server time (TIME) keeps routers with skewed clocks on one bucket.
_ADMIT = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local maxc, quota = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease = tonumber(ARGV[6])
local left_requests, left_tokens = -1, -1
if quota > 0 then
  local used = tonumber(redis.call('GET', KEYS[3]) or '0')
  if used >= quota or used + tonumber(ARGV[8]) > quota then
    return {'token_limit_exceeded', ARGV[7], -1, math.max(0, quota - used)}
  end
  left_tokens = quota - used
end
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxc then return {'concurrency_limit_exceeded', '1'} end
end
if rate > 0 then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(b[1]) or burst
  local ts = tonumber(b[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  if tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
    return {'rate_limit_exceeded', tostring((1 - tokens) / rate), 0, -1}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(now))
  left_requests = math.floor(tokens - 1)
  redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 60)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[2], now + lease, ARGV[5])
  redis.call('EXPIRE', KEYS[2], math.ceil(lease) + 60)
end
local charge = tonumber(ARGV[9])
if quota > 0 and charge > 0 then
  redis.call('INCRBY', KEYS[3], charge)
  redis.call('EXPIRE', KEYS[3], 172800)
end
return {'', '0', left_requests, left_tokens}
""")

# KEYS: in-flight sorted set, the counter of the day the admission charged. ARGV: ticket
# id, tokens still to charge (negative when the admission's estimate was more than the
# usage). The counter never goes below zero: a Redis that restarted (or a key that
# expired) since the admission has lost the charge that a refund would give back.
_RELEASE = Script("""
redis.call('ZREM', KEYS[1], ARGV[1])
local n = tonumber(ARGV[2])
if n ~= 0 then
  if redis.call('INCRBY', KEYS[2], n) < 0 then redis.call('SET', KEYS[2], '0') end
  redis.call('EXPIRE', KEYS[2], 172800)
end
return 1
""")


def _keys(tenant: str, day: str) -> list[str]:
    # The hash tag keeps a tenant's keys in one slot of a Redis Cluster.
    base = f"hivenet:tenant:{{{tenant}}}"
    return [f"{base}:rpm", f"{base}:inflight", f"{base}:tokens:{day}"]


class TenantState:
    """Where admissions and charges go: Redis when configured and up, else local."""

    def __init__(
        self,
        url: str | None,
        metrics: RouterMetrics,
        lease: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.metrics = metrics
        self.lease = lease
        # What names the day of a token count, here and in the local fallback.
        self.local = LocalCounters(wall=wall)
        self.up = False
        self._said_down = False
        # redis-py's client, for inspection off the request path (it connects only when
        # used); the counts go through `store`.
        self.client: redis.Redis | None = None
        self.store: RedisTrio | None = None
        if url is not None:
            # A malformed URL is refused here, at start-up (exit 2); a Sentinel URL
            # follows the primary it promotes (router/state_url.py).
            self.client = state_url.connect(url, CALL_TIMEOUT)
            self.store = RedisTrio(url, CALL_TIMEOUT)
            metrics.state_store_up.labels("redis").set(0)

    @property
    def mode(self) -> str:
        """`local` (no --state-url), `redis`, or `local_fallback` (Redis unreachable)."""
        if self.client is None:
            return "local"
        return "redis" if self.up else "local_fallback"

    async def watch(self) -> None:
        """Keep pinging Redis: notice it going away between requests, and coming back."""
        if self.store is None:
            return
        while True:
            try:
                await self.store.call("PING")
            except StoreError as exc:
                self._down(exc)
            else:
                self._up()
            await trio.sleep(PING_INTERVAL)

    def _up(self) -> None:
        if not self.up:
            self.up = True
            self._said_down = False
            self.metrics.state_store_up.labels("redis").set(1)
            log.info("state_store_available url=%s counts=shared", quote(_safe(self.url)))

    def _down(self, exc: Exception) -> None:
        if not self._said_down:
            self._said_down = True
            log.warning(
                "state_store_unavailable url=%s counts=local reason=%s",
                quote(_safe(self.url)),
                quote(state_url.reason(exc)),
            )
        self.up = False
        self.metrics.state_store_up.labels("redis").set(0)

    async def admit(
        self, tenant: Tenant, ticket_id: str, need: int = 0, charge: int = 0
    ) -> tuple[Verdict, bool]:
        """The verdict, and whether it was taken in Redis (release it there too)."""
        if self.up:
            try:
                verdict = await self._admit_shared(tenant, ticket_id, need, charge)
            except StoreError as exc:
                self._down(exc)
            else:
                return verdict, True
        return self.local.admit(tenant, ticket_id, need, charge), False

    async def release(
        self, tenant: str, ticket_id: str, tokens: int, shared: bool, day: str
    ) -> None:
        """Give back `ticket_id`'s slot and charge `tokens` more to `day` (the day its
        admission charged, `Verdict.day`)."""
        if shared and self.up:
            try:
                await self._release_shared(tenant, ticket_id, tokens, day)
            except StoreError as exc:
                self._down(exc)
            else:
                return
        # Admitted in Redis but released while it is away: its in-flight entry expires
        # after the lease; the tokens are counted here so they are not lost entirely.
        self.local.release(tenant, ticket_id, tokens, day)

    async def used(self, tenant: str, day: str, shared: bool) -> int:
        """The tokens `tenant` has spent on `day` so far, from where its admission
        charged them (`shared`: Redis)."""
        if shared and self.up and self.store is not None:
            key = _keys(tenant, day)[2]
            try:
                raw = await self.store.call("GET", key)
            except StoreError as exc:
                self._down(exc)
            else:
                return int(raw or 0)
        return self.local.used_today(tenant)

    async def _admit_shared(
        self, tenant: Tenant, ticket_id: str, need: int, charge: int
    ) -> Verdict:
        assert self.store is not None
        now = self.local.wall()  # one clock for both stores' days
        day = utc_day(now)
        code, retry, *left = await self.store.evalsha(
            _ADMIT,
            _keys(tenant.name, day),
            [
                tenant.requests_per_minute / 60.0,
                tenant.burst,
                tenant.max_concurrent,
                tenant.tokens_per_day,
                ticket_id,
                self.lease,
                math.ceil(until_midnight(now)),
                need,
                charge,
            ],
        )
        requests, tokens = (int(v) for v in left) if left else (-1, -1)
        return Verdict(
            ErrorCode(code.decode()) if code else None,
            float(retry) if code else 0.0,
            None if requests < 0 else requests,
            None if tokens < 0 else tokens,
            day if tenant.tokens_per_day else "",
        )

    async def _release_shared(self, tenant: str, ticket_id: str, tokens: int, day: str) -> None:
        assert self.store is not None
        if not day:
            tokens = 0  # no day's count was charged: none to correct (nor a key to make)
        keys = _keys(tenant, day)
        await self.store.evalsha(_RELEASE, keys[1:], [ticket_id, tokens])

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.store is not None:
            self.store.close()


def _safe(url: str | None) -> str:
    """The URL without a password, for logs."""
    if not url:
        return ""
    scheme, sep, rest = url.partition("://")
    _creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}" if sep else url
