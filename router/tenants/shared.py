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
import secrets
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

# KEYS: bucket hash, in-flight sorted set, tokens-of-the-day counter, leased slots per
# router (hash holder -> count), their expiry (sorted set holder -> when).
# ARGV: rate (requests/s, 0: none), burst, max concurrent (0: none), tokens per day
# (0: none), ticket id ('': admit nothing, only settle the lease, and grant when
# requests are wanted: a top-up), lease seconds,
# seconds to midnight, tokens the request may need, tokens charged now (its input
# estimate); then the lease: holder ('': none), bucket tokens given back, leased slots
# still in use, day tokens given back (negative: owed), requests wanted, divisor,
# smallest grant.
# Server time (TIME) keeps routers with skewed clocks on one bucket.
# Returns {code, retry, requests left, tokens left, granted requests, granted day
# tokens, day count}.
_ADMIT = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local maxc, quota = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease = tonumber(ARGV[6])
local holder = ARGV[10]
local keep = math.ceil(lease) + 60
-- Settle this router's last lease: unspent bucket tokens back (the bucket never over
-- its burst), its slots down to those in use, its unspent day tokens back (or owed).
if holder ~= '' then
  local back = tonumber(ARGV[11])
  if rate > 0 and back > 0 then
    local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
    local tokens = tonumber(b[1]) or burst
    local ts = tonumber(b[2]) or now
    tokens = math.min(burst, tokens + math.max(0, now - ts) * rate + back)
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
  end
  local inuse = tonumber(ARGV[12])
  if inuse > 0 then
    redis.call('HSET', KEYS[4], holder, inuse)
    redis.call('ZADD', KEYS[5], now + lease, holder)
    redis.call('EXPIRE', KEYS[4], keep)
    redis.call('EXPIRE', KEYS[5], keep)
  else
    redis.call('HDEL', KEYS[4], holder)
    redis.call('ZREM', KEYS[5], holder)
  end
  local owed = -tonumber(ARGV[13])
  if quota > 0 and owed ~= 0 then
    if redis.call('INCRBY', KEYS[3], owed) < 0 then redis.call('SET', KEYS[3], '0') end
    redis.call('EXPIRE', KEYS[3], 172800)
  end
end
-- No ticket: a settle, or (requests wanted) a grant alone, topping up a lease.
local admit = ARGV[5] ~= ''
if not admit and tonumber(ARGV[14]) == 0 then return {'', '0', -1, -1, 0, 0, 0} end
local mine = admit and 1 or 0
local left_requests, left_tokens = -1, -1
local used = 0
if quota > 0 then
  used = tonumber(redis.call('GET', KEYS[3]) or '0')
  if admit and (used >= quota or used + tonumber(ARGV[8]) > quota) then
    return {'token_limit_exceeded', ARGV[7], -1, math.max(0, quota - used), 0, 0, used}
  end
  left_tokens = quota - used
end
local count = 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  count = redis.call('ZCARD', KEYS[2])
  -- Slots leased by routers count as in flight; a crashed router's go at their expiry.
  for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)) do
    redis.call('HDEL', KEYS[4], gone)
    redis.call('ZREM', KEYS[5], gone)
  end
  for _, n in ipairs(redis.call('HVALS', KEYS[4])) do count = count + tonumber(n) end
  if admit and count >= maxc then
    return {'concurrency_limit_exceeded', '1', -1, -1, 0, 0, used}
  end
end
local tokens = 0
if rate > 0 then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  tokens = tonumber(b[1]) or burst
  local ts = tonumber(b[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  if admit and tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
    return {'rate_limit_exceeded', tostring((1 - tokens) / rate), 0, -1, 0, 0, used}
  end
  tokens = tokens - mine
  left_requests = math.floor(tokens)
end
local charge = admit and tonumber(ARGV[9]) or 0
used = used + charge
-- A grant: at most 1/divisor of what every limit has left after this request, and
-- none below the smallest grant (small limits stay exact, one call per request).
local grant = 0
if holder ~= '' then
  grant = tonumber(ARGV[14])
  local div = tonumber(ARGV[15])
  if rate > 0 then grant = math.min(grant, math.floor(tokens / div)) end
  if maxc > 0 then grant = math.min(grant, math.floor((maxc - count - mine) / div)) end
  local unit = math.max(1, tonumber(ARGV[8]))
  if quota > 0 then grant = math.min(grant, math.floor((quota - used) / div / unit)) end
  if grant < tonumber(ARGV[16]) then grant = 0 end
end
local allowance = 0
if rate > 0 then
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - grant), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 60)
end
if maxc > 0 then
  if grant > 0 then
    -- This request's slot is the lease's too: it is given back with the lease.
    redis.call('HSET', KEYS[4], holder, tonumber(ARGV[12]) + mine + grant)
    redis.call('ZADD', KEYS[5], now + lease, holder)
    redis.call('EXPIRE', KEYS[4], keep)
    redis.call('EXPIRE', KEYS[5], keep)
  elseif admit then
    redis.call('ZADD', KEYS[2], now + lease, ARGV[5])
    redis.call('EXPIRE', KEYS[2], keep)
  end
end
if quota > 0 then
  allowance = grant * math.max(1, tonumber(ARGV[8]))
  if charge + allowance > 0 then
    used = redis.call('INCRBY', KEYS[3], charge + allowance)
    redis.call('EXPIRE', KEYS[3], 172800)
  end
end
return {'', '0', left_requests, left_tokens, grant, allowance, used}
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
    return [
        f"{base}:rpm",
        f"{base}:inflight",
        f"{base}:tokens:{day}",
        f"{base}:held",
        f"{base}:holders",
    ]


# Leases (issue 51): a router takes a slice of a tenant's limits with the admission
# that needs a call anyway, and admits the next requests from it without one; once half
# a grant is spent a background call tops it up, so requests rarely wait for one. A
# grant is at most 1/LEASE_DIVISOR of what each limit has left and at most LEASE_MAX
# requests (twice the last grant: 4, 8, ... 256), and none when that is under
# LEASE_MIN: a limit needs LEASE_DIVISOR x LEASE_MIN (64) requests of headroom before
# any router leases it, so small limits keep one exact call per request. In-process,
# 64 requests at a time on one router: 64 as the most, every request still waited for a
# renewal (9.2 µs of CPU a request); 256, one call per ~240 requests and 6.2 µs, against
# 5.0 µs for local counts and 52 µs for a call per admission, day read and release.
LEASE_DIVISOR = 16
LEASE_MIN = 4
LEASE_MAX = 256
# What is leased and unspent goes back after this long, or once the router admitted
# nothing from it for LEASE_IDLE seconds: another router is never refused for long
# by a slice this one does not use.
LEASE_TTL = 1.0
LEASE_IDLE = 0.25
SWEEP_INTERVAL = 0.25


class Lease:
    """One tenant's slice held by this router: bucket tokens, concurrent slots (those in
    use by its requests and those free), day tokens charged in Redis and not yet spent
    (negative: spent past the slice, owed to the day's count)."""

    __slots__ = (
        "allowance",
        "bucket",
        "counter",
        "day",
        "free",
        "granted",
        "last",
        "limits",
        "renewed",
        "renewing",
        "taken",
        "tokens",
        "unit",
        "used",
        "waiting",
    )

    def __init__(self, limits: tuple[int, int, int, int]) -> None:
        self.limits = limits  # (requests per minute, burst, max concurrent, per day)
        self.day = ""
        self.tokens = 0
        self.free = 0
        self.used: set[str] = set()
        self.allowance = 0
        self.granted = 0  # requests the last grant allowed (the next one wants 2x)
        self.taken = -math.inf  # monotonic time of the last grant
        self.last = -math.inf  # of the last admission from it
        self.bucket = 0  # the bucket's level after the last grant (headers)
        self.counter = 0  # the day's count in Redis after the last grant
        # Set while a call settles it: other requests wait for its grant.
        self.renewing: trio.Event | None = None
        self.waiting = 0  # requests waiting on that call
        self.renewed = -math.inf  # when its slots' expiry was last pushed back
        self.unit = 1  # day tokens per request in the last grant (a request's need)

    def room(self) -> int:
        """How many more requests it admits alone (each limit's slice, the least)."""
        rpm, _, maxc, quota = self.limits
        room = LEASE_MAX * 4
        if rpm:
            room = min(room, self.tokens)
        if maxc:
            room = min(room, self.free)
        if quota:
            room = min(room, self.allowance // self.unit)
        return room

    def holds(self) -> bool:
        """Anything to give back (or owe)."""
        return bool(self.tokens or self.free or self.allowance)

    def forfeit(self) -> None:
        """Redis failed: what the slice held is gone from this router (Redis settles
        it with the next grant, or lets it expire)."""
        self.tokens = self.free = self.allowance = 0
        self.taken = -math.inf


class TenantState:
    """Where admissions and charges go: Redis when configured and up, else local."""

    def __init__(
        self,
        url: str | None,
        metrics: RouterMetrics,
        lease: float,
        wall: Callable[[], float] = time.time,
        leases: bool = True,
    ) -> None:
        self.url = url
        self.metrics = metrics
        self.lease = lease
        # What names the day of a token count, here and in the local fallback.
        self.local = LocalCounters(wall=wall)
        self.up = False
        self._said_down = False
        # Slices of tenants' limits this router holds (tenant name -> lease); False:
        # every admission one exact call (the routers' counts as before leases).
        self.leasing = leases
        self.leases: dict[str, Lease] = {}
        # What a router counting alone starts from when Redis goes away (`_down`): the
        # tickets Redis admitted by an exact call and not yet released (a lease's are in
        # its `used`), and each tenant's day's count as last seen in Redis.
        self.exact: dict[str, set[str]] = {}
        self.seen: dict[str, tuple[str, int]] = {}
        # This process's name on the leases it holds in Redis.
        self.holder = secrets.token_hex(8)
        # Where lease top-ups run (`watch`'s); none: no top-ups, renewals only.
        self._nursery: trio.Nursery | None = None
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
        """Keep pinging Redis: notice it going away between requests, and coming back;
        give back leases nobody uses."""
        if self.store is None:
            return
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._sweep_leases)
                while True:
                    try:
                        await self.store.call("PING")
                    except StoreError as exc:
                        self._down(exc)
                    else:
                        self._up()
                    await trio.sleep(PING_INTERVAL)
        finally:
            self._nursery = None  # stopping: leases are renewed when spent, no top-ups

    def _up(self) -> None:
        if not self.up:
            for name in self.leases.keys() | self.exact.keys():
                self.local.unhold(name, self._in_flight(name))
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
        if self.up:
            # Counting alone from here: this router's requests in flight count against
            # `max_concurrent`, and the day's tokens start from the count last seen.
            for name in self.leases.keys() | self.exact.keys() | self.seen.keys():
                day, used = self.seen.get(name, ("", 0))
                self.local.hold(name, self._in_flight(name), day, used)
        self.up = False
        self.metrics.state_store_up.labels("redis").set(0)
        for lease in self.leases.values():
            lease.forfeit()

    def _in_flight(self, name: str) -> set[str]:
        """`name`'s tickets that Redis admitted and this router has not released."""
        lease = self.leases.get(name)
        return (lease.used if lease is not None else set()) | self.exact.get(name, set())

    async def admit(
        self, tenant: Tenant, ticket_id: str, need: int = 0, charge: int = 0
    ) -> tuple[Verdict, bool]:
        """The verdict, and whether it was taken in Redis (release it there too): from
        this router's lease of the tenant's limits when it has room, else by a call."""
        if self.up:
            lease = self.leases.get(tenant.name)
            if lease is not None:
                verdict = self._from_lease(lease, tenant, ticket_id, need, charge)
                if verdict is not None:
                    return verdict, True
            try:
                verdict = await self._admit_shared(tenant, ticket_id, need, charge)
            except StoreError as exc:
                self._down(exc)
            else:
                return verdict, True
        return self.local.admit(tenant, ticket_id, need, charge), False

    def _from_lease(
        self, lease: Lease, tenant: Tenant, ticket_id: str, need: int, charge: int
    ) -> Verdict | None:
        """An admission from the lease, or None when it has no room (or is stale)."""
        now = time.monotonic()
        rpm, quota, maxc = tenant.requests_per_minute, tenant.tokens_per_day, tenant.max_concurrent
        if (
            now - lease.taken > LEASE_TTL
            or (rpm and lease.tokens < 1)
            or (maxc and lease.free < 1)
            or (quota and (lease.allowance < need or lease.allowance <= 0))
            or lease.limits != (rpm, tenant.burst, maxc, quota)
        ):
            return None
        day = ""
        if quota:
            day = utc_day(self.local.wall())
            if day != lease.day:
                return None
        lease.last = now
        if (
            lease.renewing is None
            and self._nursery is not None
            and 2 * (lease.room() - 1) < lease.granted
        ):
            # Half the grant spent: more comes before it runs out, and the requests
            # meanwhile need not wait for a call.
            lease.renewing = trio.Event()
            self._nursery.start_soon(self._top_up, tenant.name, lease)
        requests_left = tokens_left = None
        if rpm:
            lease.tokens -= 1
            # What the headers say: the bucket as the grant left it, and this slice.
            requests_left = lease.bucket + lease.tokens
        if maxc:
            lease.free -= 1
        lease.used.add(ticket_id)  # its release goes to the lease, whatever it holds
        if quota:
            tokens_left = max(0, quota - lease.counter + lease.allowance)
            lease.allowance -= charge
        return Verdict(None, 0.0, requests_left, tokens_left, day)

    def release_now(self, tenant: str, ticket_id: str, tokens: int, shared: bool, day: str) -> bool:
        """`release` where it needs no call: counted locally, or admitted under this
        router's lease (its slot goes back to the lease, its tokens to the lease's
        slice). False: `release` must call Redis."""
        if not shared:
            self.local.release(tenant, ticket_id, tokens, day)
            return True
        lease = self.leases.get(tenant)
        if lease is None or ticket_id not in lease.used:
            return False
        lease.used.discard(ticket_id)
        if not self.up:
            return False  # counted alone meanwhile: `release` frees it there
        if lease.limits[2]:
            lease.free += 1  # still held in Redis: the next request's
        if tokens and day != lease.day:
            return False  # the slot is back; the tokens go to their day's count
        lease.allowance -= tokens
        return True

    async def release(
        self, tenant: str, ticket_id: str, tokens: int, shared: bool, day: str
    ) -> None:
        """Give back `ticket_id`'s slot and charge `tokens` more to `day` (the day its
        admission charged, `Verdict.day`)."""
        if self.release_now(tenant, ticket_id, tokens, shared, day):
            return
        exact = self.exact.get(tenant)
        if exact is not None:
            exact.discard(ticket_id)
            if not exact:
                del self.exact[tenant]
        if self.up:
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
        charged them (`shared`: Redis; this router's lease while it has one: the day's
        count at its grant, less what the slice has not spent)."""
        if shared and self.up and self.store is not None:
            lease = self.leases.get(tenant)
            if lease is not None and lease.day == day and lease.allowance > 0:
                return max(0, lease.counter - lease.allowance)
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
        rpm, quota, maxc = tenant.requests_per_minute, tenant.tokens_per_day, tenant.max_concurrent
        lease = self.leases.get(tenant.name) if self.leasing else None
        while lease is not None and lease.renewing is not None:
            # Another request is renewing it: its grant may hold this one too, or this
            # one renews it next. Where the last call granted nothing (a limit near its
            # bound) requests call exactly, side by side, as without leases.
            lease.waiting += 1
            try:
                await lease.renewing.wait()
            finally:
                lease.waiting -= 1
            verdict = self._from_lease(lease, tenant, ticket_id, need, charge)
            if verdict is not None:
                return verdict
            if not lease.granted:
                lease = None
                break
            lease = self.leases.get(tenant.name)
        else:
            if lease is None and self.leasing:
                lease = self.leases[tenant.name] = Lease((rpm, tenant.burst, maxc, quota))
            elif (
                lease is not None
                and not lease.granted
                and time.monotonic() - lease.taken < LEASE_TTL
            ):
                lease = None  # the last try granted nothing: once a LEASE_TTL at most
        now = self.local.wall()  # one clock for both stores' days
        day = utc_day(now)
        settle = self._settle(lease, day)
        try:
            code, retry, *left = await self.store.evalsha(
                _ADMIT,
                _keys(tenant.name, day),
                [
                    rpm / 60.0,
                    tenant.burst,
                    maxc,
                    quota,
                    ticket_id,
                    self.lease,
                    math.ceil(until_midnight(now)),
                    need,
                    charge,
                    *settle,
                ],
            )
        finally:
            if lease is not None:
                self._settled(tenant.name, lease)
        requests, tokens, granted, allowance, counter = (int(v) for v in left)
        if quota:
            self.seen[tenant.name] = (day, counter)
        if maxc and not code and not (lease is not None and granted):
            self.exact.setdefault(tenant.name, set()).add(ticket_id)
        if lease is not None:
            lease.limits = (rpm, tenant.burst, maxc, quota)
            lease.day, lease.counter, lease.granted = day, counter, granted
            lease.taken = lease.renewed = time.monotonic()
            if granted:
                # Added, not set: requests that ended meanwhile gave theirs back to it.
                lease.last = lease.taken
                lease.tokens += granted if rpm else 0
                lease.free += granted if maxc else 0
                lease.allowance += allowance
                lease.unit = max(1, need)
                lease.bucket = max(0, requests - granted)
                lease.used.add(ticket_id)  # its slot is the lease's
            if not lease.used and not lease.holds():
                self._drop(tenant.name, lease)
        return Verdict(
            ErrorCode(code.decode()) if code else None,
            float(retry) if code else 0.0,
            None if requests < 0 else requests,
            None if tokens < 0 else tokens,
            day if quota and not code else "",
        )

    def _settle(self, lease: Lease | None, day: str) -> list[object]:
        """The lease's part of a call: what goes back, and what this router wants. What
        goes back leaves the lease now, before the call: nothing is spent twice."""
        if lease is None:
            return ["", 0, 0, 0, 0, LEASE_DIVISOR, LEASE_MIN]
        # Twice the last grant, or enough for the requests waiting on this one.
        want = min(LEASE_MAX, max(LEASE_MIN, 2 * lease.granted, lease.waiting + 1))
        settle: list[object] = [
            self.holder,
            lease.tokens,
            len(lease.used) if lease.limits[2] else 0,
            lease.allowance if lease.day == day else 0,
            want,
            LEASE_DIVISOR,
            LEASE_MIN,
        ]
        lease.tokens = lease.free = lease.allowance = 0
        lease.renewing = trio.Event()
        return settle

    def _settled(self, name: str, lease: Lease) -> None:
        event, lease.renewing = lease.renewing, None
        if event is not None:
            event.set()

    def _drop(self, name: str, lease: Lease) -> None:
        if self.leases.get(name) is lease:
            del self.leases[name]

    async def _top_up(self, name: str, lease: Lease) -> None:
        """One more grant on top of what `lease` holds (the caller set `renewing`):
        nothing goes back, and its places held stay those in use and free."""
        assert self.store is not None
        rpm, burst, maxc, quota = lease.limits
        day = utc_day(self.local.wall())
        granted = 0
        try:
            if not self.up or (quota and lease.day != day):
                return
            want = min(LEASE_MAX, max(LEASE_MIN, 2 * lease.granted))
            held = len(lease.used) + lease.free if maxc else 0
            args = [rpm / 60.0, burst, maxc, quota, "", self.lease, 0, lease.unit, 0]
            settle = [self.holder, 0, held, 0, want, LEASE_DIVISOR, LEASE_MIN]
            reply = await self.store.evalsha(_ADMIT, _keys(name, day), [*args, *settle])
            requests, _, granted, allowance, counter = (int(v) for v in reply[2:])
        except StoreError as exc:
            self._down(exc)
            return
        finally:
            self._settled(name, lease)
        if not granted or lease.limits != (rpm, burst, maxc, quota):
            return
        lease.granted = granted  # the next one wants twice as many
        lease.tokens += granted if rpm else 0
        lease.free += granted if maxc else 0
        lease.allowance += allowance
        lease.counter = counter
        self.seen[name] = (day, counter)
        lease.bucket = max(0, requests - granted)
        # Not `taken`: what a lease holds still goes back LEASE_TTL after its last
        # renewal, whatever was added since.

    async def _give_back(self, name: str, lease: Lease) -> None:
        """Settle `lease` in Redis: everything unspent goes back, the slots in use stay
        held (their expiry renewed)."""
        assert self.store is not None
        rpm, burst, maxc, quota = lease.limits
        day = utc_day(self.local.wall())
        settle = self._settle(lease, day)
        settle[4] = 0  # wants nothing
        try:
            await self.store.evalsha(
                _ADMIT,
                _keys(name, day),
                [rpm / 60.0, burst, maxc, quota, "", self.lease, 0, 0, 0, *settle],
            )
        finally:
            self._settled(name, lease)
        lease.renewed = time.monotonic()  # its slots in use were renewed now
        if not lease.used and not lease.holds():
            self._drop(name, lease)

    async def _sweep_leases(self) -> None:
        """Give back what an idle or old lease holds, and renew the expiry of slots in
        use by long requests (a quarter of `lease` before they would go)."""
        while True:
            await trio.sleep(SWEEP_INTERVAL)
            await self.give_back(idle_only=True)

    async def give_back(self, idle_only: bool = False) -> None:
        """Every lease settled in Redis (at shutdown), or those idle or old."""
        if not self.up or self.store is None:
            return
        now = time.monotonic()
        for name, lease in list(self.leases.items()):
            if lease.renewing is not None:
                continue
            if idle_only:
                stale = now - lease.taken > LEASE_TTL or now - lease.last > LEASE_IDLE
                renew = lease.used and now - lease.renewed > self.lease / 4
                if not ((stale and lease.holds()) or renew):
                    continue
            try:
                await self._give_back(name, lease)
            except StoreError as exc:
                self._down(exc)
                return

    async def _release_shared(self, tenant: str, ticket_id: str, tokens: int, day: str) -> None:
        assert self.store is not None
        if not day:
            tokens = 0  # no day's count was charged: none to correct (nor a key to make)
        keys = _keys(tenant, day)
        await self.store.evalsha(_RELEASE, [keys[1], keys[2]], [ticket_id, tokens])

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
