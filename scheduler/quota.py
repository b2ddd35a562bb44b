"""`QuotaLedger`: per-tenant rate limits, concurrency and KV-block quotas, charged atomically in Redis.

One Lua script decides an admission against all of a tenant's limits at once, so replicas never
interleave a check with a charge, and a refusal charges nothing. Time is Redis server time, so every
replica refills the buckets against the same clock.

Keys, per tenant (the ``{tenant}`` hash tag keeps one tenant's keys in one Redis Cluster slot):

* ``{prefix}quota:{tenant}:bucket``   hash ``r``, ``t``, ``ts``: request and token bucket levels at ``ts``.
  It expires once it would have refilled anyway, so idle tenants cost no memory.
* ``{prefix}quota:{tenant}:inflight`` zset request id → expiry (server seconds).
* ``{prefix}quota:{tenant}:charges``  hash request id → ``"tokens:kv_blocks"`` charged at admission.
* ``{prefix}quota:{tenant}:kv``       KV blocks held by the in-flight requests.

Concurrency is the size of ``inflight``. A request that is never finished (its gateway died) drops out
when its expiry passes: every script first prunes expired entries and gives back their KV blocks, so a
crash costs the tenant capacity for at most ``request_ttl_s`` — and for much less once the scheduler
sees that gateway go (`orphan`, called by `scheduler.calls.serve_calls`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from core.errors import CapacityExceeded, InvalidRequest
from scheduler.redis_pipe import RedisPipe, register_script
from scheduler.tenants import TenantConfig

# A thousandth of a token or request: below anything a client could notice, above float error.
_EPS = 1e-3

# Shared by the scripts below. KEYS: 1 bucket, 2 inflight, 3 charges, 4 kv.
_LIB = (
    f"local EPS = {_EPS!r}\n"
    + """
-- Numbers as text at full precision (Lua's own conversion keeps 14 digits: 0.1 ms of a Unix time).
local function num(x) return string.format('%.17g', x) end

local function clock(arg)
  local n = tonumber(arg)
  if n then return n end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Expired requests give back their slot and KV blocks but not their tokens, which were likely served.
local function prune(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', num(now))) do
    local charge = redis.call('HGET', KEYS[3], id)
    if charge then
      local _, blocks = string.match(charge, '^(%d+):(%d+)$')
      redis.call('DECRBY', KEYS[4], blocks)
      redis.call('HDEL', KEYS[3], id)
    end
    redis.call('ZREM', KEYS[2], id)
  end
  local concurrent = redis.call('ZCARD', KEYS[2])
  -- With nothing in flight the counters must be zero; deleting them repairs any drift.
  if concurrent == 0 then redis.call('DEL', KEYS[3], KEYS[4]) end
  return concurrent, tonumber(redis.call('GET', KEYS[4]) or '0')
end

-- Bucket levels at `now`: an absent bucket is full.
local function levels(now, rrate, rcap, trate, tcap)
  local b = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
  local ts = tonumber(b[3])
  if not ts then return rcap, tcap end
  local dt = math.max(0, now - ts)
  return math.min(rcap, tonumber(b[1]) + dt * rrate), math.min(tcap, tonumber(b[2]) + dt * trate)
end

local function store(now, r, t, ttl_ms)
  local ts = tonumber(redis.call('HGET', KEYS[1], 'ts'))
  if ts and ts > now then now = ts end  -- never move a bucket's clock backwards
  redis.call('HSET', KEYS[1], 'r', num(r), 't', num(t), 'ts', num(now))
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
end
"""
)

# ARGV: now, id, tokens, kv_blocks, rrate, rcap, trate, tcap, max_concurrent, max_kv, ttl_s, bucket_ttl_ms,
#       reservation_ttl_s, then the sibling ids (charged the same, as reservations)
_ADMIT = (
    _LIB
    + """
local now = clock(ARGV[1])
local id, tokens, blocks = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local rrate, rcap, trate, tcap = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local concurrent, kv = prune(now)
local previous = redis.call('HGET', KEYS[3], id)
if previous then
  -- A retried admission (same idempotency key) is not charged twice.
  local t, b = string.match(previous, '^(%d+):(%d+)$')
  return {'dup', tostring(redis.call('ZSCORE', KEYS[2], id)), t, b}
end
local r, t = levels(now, rrate, rcap, trate, tcap)
local n = 1 + #ARGV - 13  -- this request and its siblings: one call's choices, charged together
-- EPS: float time arithmetic may leave an exactly refilled bucket a hair short.
if concurrent + n > tonumber(ARGV[9]) or kv + n * blocks > tonumber(ARGV[10])
    or r + EPS < 1 or t + EPS < n * tokens then
  return {'no', tostring(concurrent + n - 1), tostring(kv), num(r), num(t)}
end
local expiry = now + tonumber(ARGV[11])
store(now, math.max(0, r - 1), math.max(0, t - n * tokens), tonumber(ARGV[12]))
redis.call('ZADD', KEYS[2], num(expiry), id)
redis.call('HSET', KEYS[3], id, tokens .. ':' .. blocks)
for i = 14, #ARGV do
  redis.call('ZADD', KEYS[2], num(now + tonumber(ARGV[13])), ARGV[i])
  redis.call('HSET', KEYS[3], ARGV[i], tokens .. ':' .. blocks)
end
redis.call('INCRBY', KEYS[4], n * blocks)
-- Every entry expires within the TTL, so the keys may go with the latest of them.
local ttl_ms = math.ceil(tonumber(ARGV[11]) * 1000) + 1000
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ttl_ms) end
return {'ok', num(expiry)}
"""
)

# ARGV: now, id, ttl_s. A sibling's reservation becomes a request's charge (its own Place came).
_CLAIM = (
    _LIB
    + """
local now = clock(ARGV[1])
prune(now)
return redis.call('ZADD', KEYS[2], 'XX', 'GT', 'CH', num(now + tonumber(ARGV[3])), ARGV[2])
"""
)

# ARGV: now, id, tokens used, rrate, rcap, trate, tcap, bucket_ttl_ms
_FINISH = (
    _LIB
    + """
local now = clock(ARGV[1])
prune(now)
local charge = redis.call('HGET', KEYS[3], ARGV[2])
if not charge then return -1 end
local tokens, blocks = string.match(charge, '^(%d+):(%d+)$')
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('DECRBY', KEYS[4], blocks)
if redis.call('ZCARD', KEYS[2]) == 0 then redis.call('DEL', KEYS[3], KEYS[4]) end
local refund = math.max(0, tonumber(tokens) - tonumber(ARGV[3]))
if refund > 0 then
  local tcap = tonumber(ARGV[7])
  local r, t = levels(now, tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tcap)
  store(now, r, math.min(tcap, t + refund), tonumber(ARGV[8]))
end
return refund
"""
)

# ARGV: now, retention_s, then the request ids. Brings each one's expiry forward to now + retention_s,
# never later than it was (LT), and only for an id still in flight (XX): its gateway is gone.
_ORPHAN = (
    _LIB
    + """
local now = clock(ARGV[1])
prune(now)
local expiry = num(now + tonumber(ARGV[2]))
local changed = 0
for i = 3, #ARGV do
  changed = changed + redis.call('ZADD', KEYS[2], 'XX', 'LT', 'CH', expiry, ARGV[i])
end
return changed
"""
)

# ARGV: now, rrate, rcap, trate, tcap
_USAGE = (
    _LIB
    + """
local now = clock(ARGV[1])
local concurrent, kv = prune(now)
local r, t = levels(now, tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]))
return {tostring(concurrent), tostring(kv), num(r), num(t)}
"""
)


@dataclass(frozen=True, slots=True)
class Admission:
    """What an admitted request was charged; ``finish`` gives back what it did not use."""

    tenant: str
    request_id: str
    tokens_charged: int  # prompt_tokens + max_tokens
    kv_blocks: int
    expires_at_s: float  # Redis server time after which the ledger forgets the request
    already_admitted: bool = False  # the same request id was admitted before and not finished


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """A tenant's quota state now, for metrics and the admin API."""

    tenant: str
    concurrent: int
    kv_blocks: int
    requests_available: float  # request bucket level
    tokens_available: float  # token bucket level


class QuotaLedger:
    """Admits requests against their tenant's quotas and credits them back when they finish.

    ``request_ttl_s`` bounds how long an unfinished request holds its concurrency slot and KV blocks;
    it should exceed the longest request you serve. ``busy_retry_after_s`` is the retry-after given when
    concurrency or KV blocks are full (no bucket deficit to compute it from). ``clock`` replaces Redis
    server time (seconds), for tests. ``pipe``: admissions and finishes, once per request each, go through
    this connection instead of ``client`` (scheduler.redis_pipe: a quarter of a decision's CPU).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "baton:",
        request_ttl_s: float = 3600.0,
        busy_retry_after_s: float = 1.0,
        clock: Callable[[], float] | None = None,
        pipe: RedisPipe | None = None,
        reservation_ttl_s: float = 60.0,
    ) -> None:
        if request_ttl_s <= 0 or reservation_ttl_s <= 0:
            raise ValueError("request_ttl_s and reservation_ttl_s must be positive")
        self.reservation_ttl_s = reservation_ttl_s
        self._prefix = prefix
        self.request_ttl_s = request_ttl_s
        self.busy_retry_after_s = busy_retry_after_s
        self._clock = clock
        self._admit = register_script(client, pipe, _ADMIT)
        self._finish = register_script(client, pipe, _FINISH)
        self._claim = register_script(client, pipe, _CLAIM)
        self._usage = client.register_script(_USAGE)
        self._orphan = client.register_script(_ORPHAN)

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}quota:{{{tenant}}}:"
        return [base + "bucket", base + "inflight", base + "charges", base + "kv"]

    def _now(self) -> str:
        return "" if self._clock is None else repr(self._clock())

    @staticmethod
    def _bucket_ttl_ms(tenant: TenantConfig) -> int:
        # From empty, a bucket is full again after burst_s: past that, its absence means the same.
        return math.ceil(tenant.burst_s * 1000) + 1000

    async def admit(
        self,
        tenant: TenantConfig,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        kv_blocks: int,
        siblings: Sequence[str] = (),
    ) -> Admission:
        """Charge one request, ``prompt_tokens + max_tokens`` tokens and ``kv_blocks`` against the
        tenant's limits, all or nothing — with ``siblings`` (the other choices of the same call), the
        same again for each of them, one concurrency slot each, before any of them runs. A sibling's
        charge is a reservation: its own placement `claim`s it, or it lapses after
        ``reservation_ttl_s`` (giving back its slot and blocks). Raises `CapacityExceeded` naming every
        limit that refused, with a retry-after; `InvalidRequest` if the request could never fit the
        tenant's quota."""
        if min(prompt_tokens, max_tokens, kv_blocks) < 0:
            raise ValueError("token and block counts must not be negative")
        n, tokens = 1 + len(siblings), prompt_tokens + max_tokens
        what = "the request needs" if n == 1 else f"the request's {n} choices need"
        if n * tokens > tenant.token_burst:
            raise InvalidRequest(
                f"{what} {n * tokens} tokens (prompt + max_tokens) but tenant {tenant.name!r} may "
                f"spend at most {tenant.token_burst:.0f} at once; lower max_tokens"
            )
        if n * kv_blocks > tenant.max_kv_blocks:
            raise InvalidRequest(
                f"{what} {n * kv_blocks} KV blocks but tenant {tenant.name!r} may hold at most "
                f"{tenant.max_kv_blocks}; send a shorter prompt or lower max_tokens"
            )
        if n > tenant.max_concurrent:
            raise InvalidRequest(
                f"{what} {n} requests at once but tenant {tenant.name!r} may run at most "
                f"{tenant.max_concurrent}; lower n"
            )
        reply = await self._admit(
            keys=self._keys(tenant.name),
            args=[
                self._now(),
                request_id,
                tokens,
                kv_blocks,
                repr(tenant.requests_per_s),
                repr(tenant.request_burst),
                repr(tenant.tokens_per_s),
                repr(tenant.token_burst),
                tenant.max_concurrent,
                tenant.max_kv_blocks,
                repr(self.request_ttl_s),
                self._bucket_ttl_ms(tenant),
                repr(self.reservation_ttl_s),
                *siblings,
            ],
        )
        if reply[0] == "ok":
            return Admission(tenant.name, request_id, tokens, kv_blocks, float(reply[1]))
        if reply[0] == "dup":
            return Admission(
                tenant.name, request_id, int(reply[2]), int(reply[3]), float(reply[1]), already_admitted=True
            )
        concurrent, kv_used = int(reply[1]), int(reply[2])
        raise self._refusal(
            tenant, n * tokens, n * kv_blocks, concurrent, kv_used, float(reply[3]), float(reply[4])
        )

    def _refusal(
        self,
        tenant: TenantConfig,
        tokens: int,
        kv_blocks: int,
        concurrent: int,
        kv_used: int,
        requests_available: float,
        tokens_available: float,
    ) -> CapacityExceeded:
        reasons: list[str] = []
        waits: list[float] = []
        if concurrent >= tenant.max_concurrent:
            reasons.append(f"{concurrent} requests in flight (max_concurrent={tenant.max_concurrent})")
            waits.append(self.busy_retry_after_s)
        if kv_used + kv_blocks > tenant.max_kv_blocks:
            reasons.append(
                f"{kv_used} KV blocks held and {kv_blocks} more requested "
                f"(max_kv_blocks={tenant.max_kv_blocks})"
            )
            waits.append(self.busy_retry_after_s)
        if requests_available + _EPS < 1:
            reasons.append(f"request rate over {tenant.requests_per_s:g}/s")
            waits.append((1 - requests_available) / tenant.requests_per_s)
        if tokens_available + _EPS < tokens:
            reasons.append(
                f"token rate over {tenant.tokens_per_s:g}/s ({tokens} tokens requested, "
                f"{tokens_available:.0f} available)"
            )
            waits.append((tokens - tokens_available) / tenant.tokens_per_s)
        # Retrying before the longest wait would only be refused again.
        retry_after_s = max(waits, default=self.busy_retry_after_s)
        return CapacityExceeded(
            f"tenant {tenant.name!r} is over quota: {'; '.join(reasons)}; retry after {retry_after_s:.2f} s",
            retry_after_s=retry_after_s,
        )

    async def claim(self, tenant: TenantConfig, request_id: str) -> bool:
        """A sibling's reservation becomes its charge, for as long as a request's (its Place came);
        False if it holds none (never reserved, lapsed, or not a sibling)."""
        changed = await self._claim(
            keys=self._keys(tenant.name), args=[self._now(), request_id, repr(self.request_ttl_s)]
        )
        return bool(int(changed))

    async def finish(
        self, tenant: TenantConfig, request_id: str, prompt_tokens: int, completion_tokens: int
    ) -> int | None:
        """Release a request's slot and KV blocks and refund the tokens it was charged but did not use.

        Returns the tokens refunded, or None if the request is not in flight (finished already, never
        admitted or expired): finishing is idempotent.
        """
        refund = await self._finish(
            keys=self._keys(tenant.name),
            args=[
                self._now(),
                request_id,
                prompt_tokens + completion_tokens,
                repr(tenant.requests_per_s),
                repr(tenant.request_burst),
                repr(tenant.tokens_per_s),
                repr(tenant.token_burst),
                self._bucket_ttl_ms(tenant),
            ],
        )
        return None if int(refund) < 0 else int(refund)

    async def orphan(self, tenant: str, request_ids: Sequence[str], retention_s: float) -> int:
        """Requests of tenant ``tenant`` (its name) that their gateway placed and will never finish (it
        is gone): each one still in flight now expires ``retention_s`` from now instead of at the end of
        the request TTL — unless it expires sooner already. Until then it keeps its slot and KV blocks,
        and a first placement of the same id is still refused as a duplicate; then both are given back
        (its tokens, likely served, are not). A later `finish` of one is as idempotent as ever. Returns
        how many expiries were brought forward."""
        if retention_s < 0:
            raise ValueError("retention_s must not be negative")
        if not request_ids:
            return 0
        changed = await self._orphan(
            keys=self._keys(tenant), args=[self._now(), repr(retention_s), *request_ids]
        )
        return int(changed)

    async def usage(self, tenant: TenantConfig) -> TenantUsage:
        reply = await self._usage(
            keys=self._keys(tenant.name),
            args=[
                self._now(),
                repr(tenant.requests_per_s),
                repr(tenant.request_burst),
                repr(tenant.tokens_per_s),
                repr(tenant.token_burst),
            ],
        )
        return TenantUsage(tenant.name, int(reply[0]), int(reply[1]), float(reply[2]), float(reply[3]))
