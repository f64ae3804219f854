"""B2 occupancy and B4 key buckets shared by several routers in Redis.

The same rules as the local counts (occupancy.py, control.py), each check-and-take one
Lua script, so two routers never both take the last of a budget. Redis is reached the
way the tenant counts reach it (router/tenants/shared.py: the same trio-native client,
router/redis_trio.py, its short deadlines and its up/down state): while Redis is unreachable each
router counts alone, and an entry a router took before it lost Redis expires after the
lease (the request timeout and a minute), so a crashed router's occupancy comes back.

A parked request cannot hear another router's release, so it re-checks every
`PARK_POLL` seconds until its park timeout.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.redis_trio import Script, StoreError
from router.tenants.shared import TenantState

# 20 ms: a few re-checks within upstream's 250 ms park, each one Redis round trip.
PARK_POLL = 0.02
# Streamed output is sent to Redis in steps of this many tokens (one call per step).
GROW_STEP = 32

# KEYS: entries hash (id -> "tokens:key"), lease sorted set, totals hash (tokens,
# count, k:<key>), input bucket hash, output bucket hash.
# ARGV: id, tokens, key id ('' none), budget, backstop, key share (0 none), lease
# seconds, input per minute, output per minute, input tokens, pooled (1/0).
# Returns {gate or '', occupancy, count, wait seconds}.
_RESERVE = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local id, tokens, key = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local budget, backstop, share = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lease, itpm, otpm = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local input, pooled = tonumber(ARGV[10]), ARGV[11] == '1'
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  local e = redis.call('HGET', KEYS[1], old)
  if e then
    local n, k = string.match(e, '^(%-?%d+):(.*)$')
    redis.call('HINCRBY', KEYS[3], 'tokens', -tonumber(n))
    redis.call('HINCRBY', KEYS[3], 'count', -1)
    if k ~= '' then redis.call('HINCRBY', KEYS[3], 'k:' .. k, -tonumber(n)) end
    redis.call('HDEL', KEYS[1], old)
  end
  redis.call('ZREM', KEYS[2], old)
end
local occ = tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0')
local count = tonumber(redis.call('HGET', KEYS[3], 'count') or '0')
local function bucket(k, per_minute)
  local b = redis.call('HMGET', k, 'level', 'ts')
  local level = tonumber(b[1]) or per_minute
  local ts = tonumber(b[2]) or now
  return math.min(per_minute, level + math.max(0, now - ts) * per_minute / 60)
end
local in_level, out_level = 0, 0
if key ~= '' then
  if share > 0 then
    local held = tonumber(redis.call('HGET', KEYS[3], 'k:' .. key) or '0')
    if held > 0 and held + tokens > share then
      return {'b4_occupancy', tostring(occ), tostring(count), '1'}
    end
  end
  if itpm > 0 then
    in_level = bucket(KEYS[4], itpm)
    if in_level < input then
      return {'b4_itpm', tostring(occ), tostring(count), tostring((input - in_level) * 60 / itpm)}
    end
  end
  if otpm > 0 then
    out_level = bucket(KEYS[5], otpm)
    if out_level < 1 then
      return {'b4_otpm', tostring(occ), tostring(count), tostring((1 - out_level) * 60 / otpm)}
    end
  end
end
if pooled then
  local full = (backstop > 0 and count >= backstop) or (budget > 0 and occ + tokens > budget)
  if full then
    return {'b2', tostring(occ), tostring(count), '1'}
  end
  redis.call('HSET', KEYS[1], id, tokens .. ':' .. key)
  redis.call('ZADD', KEYS[2], now + lease, id)
  redis.call('HINCRBY', KEYS[3], 'tokens', tokens)
  redis.call('HINCRBY', KEYS[3], 'count', 1)
  if key ~= '' then redis.call('HINCRBY', KEYS[3], 'k:' .. key, tokens) end
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], math.ceil(lease) + 60) end
  occ, count = occ + tokens, count + 1
end
if key ~= '' and itpm > 0 then
  redis.call('HSET', KEYS[4], 'level', tostring(in_level - input), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[4], 120)
end
return {'', tostring(occ), tostring(count), '0'}
""")

# KEYS: entries, lease set, totals. ARGV: id, tokens to add (negative: release all).
# Returns {occupancy, count}.
_CHANGE = Script("""
local e = redis.call('HGET', KEYS[1], ARGV[1])
if e then
  local n, k = string.match(e, '^(%-?%d+):(.*)$')
  n = tonumber(n)
  local add = tonumber(ARGV[2])
  if add < 0 then
    redis.call('HINCRBY', KEYS[3], 'tokens', -n)
    redis.call('HINCRBY', KEYS[3], 'count', -1)
    if k ~= '' then redis.call('HINCRBY', KEYS[3], 'k:' .. k, -n) end
    redis.call('HDEL', KEYS[1], ARGV[1])
    redis.call('ZREM', KEYS[2], ARGV[1])
  else
    redis.call('HSET', KEYS[1], ARGV[1], (n + add) .. ':' .. k)
    redis.call('HINCRBY', KEYS[3], 'tokens', add)
    if k ~= '' then redis.call('HINCRBY', KEYS[3], 'k:' .. k, add) end
  end
end
return {redis.call('HGET', KEYS[3], 'tokens') or '0', redis.call('HGET', KEYS[3], 'count') or '0'}
""")

# KEYS: output bucket. ARGV: per minute, tokens spent.
_SPEND = Script("""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local per_minute, spent = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(b[1]) or per_minute
local ts = tonumber(b[2]) or now
level = math.min(per_minute, level + math.max(0, now - ts) * per_minute / 60)
redis.call('HSET', KEYS[1], 'level', tostring(math.max(0, level - spent)), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], 120)
return 1
""")


def _pool_keys(model: str) -> list[str]:
    # One hash tag per model: its keys sit in one slot of a Redis Cluster.
    base = f"hivenet:admission:{{{model}}}"
    return [f"{base}:entries", f"{base}:lease", f"{base}:totals"]


def _bucket_keys(model: str, key_id: str) -> list[str]:
    base = f"hivenet:admission:{{{model}}}:key:{key_id}"
    return [f"{base}:input", f"{base}:output"]


@dataclass(frozen=True)
class SharedVerdict:
    gate: str  # '' admitted
    occupancy: int
    count: int
    wait: float


class SharedAdmission:
    def __init__(self, state: TenantState, lease: float) -> None:
        self.state = state
        self.lease = lease
        assert state.store is not None
        self.store = state.store

    @property
    def up(self) -> bool:
        return self.state.up

    async def call(self, fn: Callable[..., Awaitable[object]], *args: object) -> object | None:
        """`await fn(*args)`; None (and local counts) when Redis fails."""
        try:
            return await fn(*args)
        except StoreError as exc:
            self.state._down(exc)
            return None

    async def reserve(
        self,
        model: str,
        entry: str,
        tokens: int,
        key_id: str,
        budget: int,
        backstop: int,
        share: int,
        itpm: int,
        otpm: int,
        input_tokens: int,
        pooled: bool,
    ) -> SharedVerdict:
        gate, occupancy, count, wait = await self.store.evalsha(
            _RESERVE,
            [*_pool_keys(model), *_bucket_keys(model, key_id or "-")],
            [
                entry,
                tokens,
                key_id,
                budget,
                backstop,
                share,
                self.lease,
                itpm,
                otpm,
                input_tokens,
                1 if pooled else 0,
            ],
        )
        return SharedVerdict(
            gate.decode() if isinstance(gate, bytes) else str(gate),
            int(occupancy),
            int(count),
            float(wait),
        )

    async def change(self, model: str, entry: str, tokens: int) -> tuple[int, int]:
        occupancy, count = await self.store.evalsha(_CHANGE, _pool_keys(model), [entry, tokens])
        return int(occupancy), int(count)

    async def spend(self, model: str, key_id: str, per_minute: int, tokens: int) -> bool:
        """True once spent in Redis (the caller's local bucket is then left alone)."""
        await self.store.evalsha(_SPEND, _bucket_keys(model, key_id)[1:], [per_minute, tokens])
        return True


def entry_id() -> str:
    """A reservation's id in Redis: unique across routers and restarts."""
    return secrets.token_hex(8)
