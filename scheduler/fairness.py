"""`FairQueue`: the bounded waiting queue in Redis, served token-fairly between tenants.

When admission must wait (no free decode blocks), requests wait here and leave in Virtual Token Counter
order (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24): each tenant has a counter
of the tokens it was served divided by its weight; the next request comes from the waiting tenant with
the smallest counter, FIFO within a tenant. A tenant that starts waiting is put next to the *reference*
— the next waiter's counter, or with nobody waiting the counter of the last tenant that stopped waiting
(VTC's lift) — within ``burst_credit_tokens`` of it either way:

* lifted if it lags (idle time banks no more than that), lowered if it is ahead (service it had while
  nobody else waited — the scheduler charges admissions that did not wait too — is a debt of at most
  a burst's worth, so its next request is never kept behind everything that waits);
* moved down by the whole burst credit if it has *asked for less recently* than the reference
  tenant: its *recent demand* (the tokens / weight of the requests it sent — queued or admitted at
  once — decaying with a half-life of ``DEMAND_HALF_LIFE_S``) is below that tenant's. A light
  tenant's short burst then goes before a heavy tenant's requests instead of alternating with them.
  Demand, not service, decides: a flood that has just begun has been served little but asks for a lot,
  and a light tenant that had the cluster to itself was served much but asked for little. A tenant
  that never sent a request has no record and no credit: it joins level with the others (plain VTC);
* never level with or before a waiting tenant whose counter is lower than its own without that credit:
  a heavy tenant that comes and goes (each of its requests placed or refused before the next
  arrives) neither overtakes a light tenant's waiting request on every return nor has its service
  beyond the credit forgotten each time. Its queue emptying for a moment does not earn it credit
  either — its recent demand stays above the light tenant's.

Fairness is therefore token-weighted, not per request: while two tenants both wait, their counters
differ by at most one request's cost / weight plus the burst credit.

Popping charges the request's ``cost_tokens`` (the caller's estimate, e.g. prompt + max_tokens) at
once, in the same script, so concurrent replicas always see the updated counters; ``charge`` corrects
the estimate later (a negative charge credits unused tokens back).

Keys, all under one hash tag so one queue lives in one Redis Cluster slot (the per-tenant keys are
built inside the scripts, which is allowed because they share the tag):
``{prefix}fq:{name}:entries`` hash id → entry JSON, ``:deadlines`` zset id → deadline,
``:q:<tenant>`` zset id → arrival sequence (FIFO), ``:seq`` the sequence, ``:active`` zset waiting
tenant → counter, ``:vtc`` hash tenant → counter, ``:weights`` hash tenant → weight, ``:floor`` the
counter of the last tenant that stopped waiting and ``:floor_tenant`` its name, ``:demand`` hash tenant →
``sum:time:since`` (its decayed demand as of that time, and when its history began).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from core.errors import CapacityExceeded
from scheduler.tenants import TenantConfig

TIE = 1e-3  # tokens: how far above the next waiter's counter a joining tenant with more service is put
# Recent demand halves in this time: "asked for less recently" compares the last several seconds of
# requests, long enough that a steady flood's demand stays above a light tenant's between its requests,
# short enough that the last minute's traffic does not decide this second's bursts.
DEMAND_HALF_LIFE_S = 5.0
DEMAND_MIN_WINDOW_S = 1.0  # a young history's demand is a rate over at least this long
DEMAND_RESTART = 0.125  # a history whose decayed sum is below this share of a new request starts again
LIGHT_SHARE = 0.5  # `is_light`: a tenant asking for less than this share of another waiting tenant's demand

# ARGV[1] is the key prefix of the queue, ARGV[2] the time ('' = Redis server time).
_LIB = (
    (
        f"local TIE = {TIE!r}\nlocal HALF_LIFE = {DEMAND_HALF_LIFE_S!r}\n"
        f"local MIN_WINDOW = {DEMAND_MIN_WINDOW_S!r}\nlocal RESTART = {DEMAND_RESTART!r}\n"
    )
    + """
local base = ARGV[1]
-- Numbers as text at full precision (Lua's own conversion keeps 14 digits: 0.1 ms of a Unix time).
local function num(x) return string.format('%.17g', x) end
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function deactivate(tenant)
  redis.call('ZREM', base .. 'active', tenant)
  redis.call('SET', base .. 'floor', redis.call('HGET', base .. 'vtc', tenant) or '0')
  redis.call('SET', base .. 'floor_tenant', tenant)
end

-- A tenant's recent demand now: tokens / weight asked for, decayed by the half-life, and divided by
-- the share of a full window its history covers, at least MIN_WINDOW's (an exponentially weighted sum
-- started at zero reads low for a young history: a flood that began a moment ago is not a light
-- tenant). Returns nil if it never asked; else the demand, the decayed sum and when its history began.
local function demand(tenant)
  local rec = redis.call('HGET', base .. 'demand', tenant)
  if not rec then return nil end
  local a = string.find(rec, ':', 1, true)
  local b = string.find(rec, ':', a + 1, true)
  local at, since = tonumber(string.sub(rec, a + 1, b - 1)), tonumber(string.sub(rec, b + 1))
  local sum = tonumber(string.sub(rec, 1, a - 1)) * 2 ^ (-math.max(0, now - at) / HALF_LIFE)
  local covered = 1 - 2 ^ (-math.max(MIN_WINDOW, now - since) / HALF_LIFE)
  return sum / covered, sum, since
end

-- A history whose decayed sum fell below RESTART of the new request's amount (about three half-lives
-- of silence) starts again: a tenant back after a long silence is judged on what it asks for now.
local function add_demand(tenant, amount)
  local _, sum, since = demand(tenant)
  if not sum or sum < RESTART * amount then sum, since = 0, now end
  redis.call('HSET', base .. 'demand', tenant, num(sum + amount) .. ':' .. num(now) .. ':' .. num(since))
end

-- Takes an entry out of every structure; a tenant whose queue empties stops being active.
local function drop(id)
  local entry = redis.call('HGET', base .. 'entries', id)
  if not entry then return nil end
  local tenant = cjson.decode(entry)['tenant']
  local q = base .. 'q:' .. tenant
  redis.call('HDEL', base .. 'entries', id)
  redis.call('ZREM', base .. 'deadlines', id)
  redis.call('ZREM', q, id)
  if redis.call('ZCARD', q) == 0 then deactivate(tenant) end
  return entry
end

-- The reply: a status, then the entries whose deadline passed (dropped here, before any other step).
local reply = {}
local function reap()
  reply[1] = ''
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', base .. 'deadlines', '-inf', num(now))) do
    local entry = drop(id)
    if entry then table.insert(reply, entry) end
  end
end
"""
)

# ARGV: base, now, id, tenant, cost, timeout_s, weight, tenant max depth, global max depth, burst credit
_ENQUEUE = (
    _LIB
    + """
reap()
local id, tenant = ARGV[3], ARGV[4]
local existing = redis.call('HGET', base .. 'entries', id)
if existing then
  reply[1] = existing  -- a retried enqueue keeps its place
  return reply
end
local waiting = redis.call('ZCARD', base .. 'deadlines')
if waiting >= tonumber(ARGV[9]) then
  reply[1] = 'full:' .. waiting
  return reply
end
local q = base .. 'q:' .. tenant
local mine = redis.call('ZCARD', q)
if mine >= tonumber(ARGV[8]) then
  reply[1] = 'tenant_full:' .. mine
  return reply
end
if not redis.call('ZSCORE', base .. 'active', tenant) then
  -- Becoming active. The values stay Redis's own text where no arithmetic is needed, so that no
  -- precision is lost on the way through Lua. The reference: the next waiter's counter, or with nobody
  -- waiting the counter of the last tenant that left. A joiner is put within [ref - cap, ref + cap]:
  -- lifted if it lags, lowered if ahead; then moved down by the whole credit if it asked for less
  -- recently than the reference tenant (its own new request not counted yet). With others waiting it
  -- is never level with the next waiter: a tie goes to the joiner if it lags, to the waiter otherwise.
  local cap = tonumber(ARGV[10])
  local top = redis.call('ZRANGE', base .. 'active', 0, 0, 'WITHSCORES')
  local ref_tenant = top[1] or redis.call('GET', base .. 'floor_tenant')
  local credit = 0
  local mine = demand(tenant)
  if mine and ref_tenant and ref_tenant ~= tenant and mine < (demand(ref_tenant) or 0) then credit = cap end
  local own = tonumber(redis.call('HGET', base .. 'vtc', tenant) or '0')
  local ref = tonumber(top[2] or redis.call('GET', base .. 'floor') or '0')
  local counter
  if own < ref then
    counter = math.max(own, ref - math.max(credit, top[2] and TIE or 0))
  else
    counter = math.min(own, ref + cap) - credit
    if top[2] and counter >= ref then counter = math.max(counter, ref + TIE) end
  end
  if counter ~= own then redis.call('HSET', base .. 'vtc', tenant, num(counter)) end
  counter = num(counter)
  redis.call('ZADD', base .. 'active', counter, tenant)
end
redis.call('HSET', base .. 'weights', tenant, ARGV[7])
add_demand(tenant, tonumber(ARGV[5]) / tonumber(ARGV[7]))
local entry = cjson.encode({id = id, tenant = tenant, cost = tonumber(ARGV[5]), enqueued = num(now),
                            deadline = num(now + tonumber(ARGV[6]))})
redis.call('ZADD', q, redis.call('INCR', base .. 'seq'), id)
redis.call('ZADD', base .. 'deadlines', num(now + tonumber(ARGV[6])), id)
redis.call('HSET', base .. 'entries', id, entry)
reply[1] = entry
return reply
"""
)

# ARGV: base, now, only ('' = whichever is next; else pop only if this id is next)
_POP = (
    _LIB
    + """
reap()
while true do
  local top = redis.call('ZRANGE', base .. 'active', 0, 0)
  if not top[1] then return reply end
  local tenant = top[1]
  local q = base .. 'q:' .. tenant
  local head = redis.call('ZRANGE', q, 0, 0)
  local entry = head[1] and redis.call('HGET', base .. 'entries', head[1])
  if entry and ARGV[3] ~= '' and head[1] ~= ARGV[3] then return reply end
  if entry then
    redis.call('HDEL', base .. 'entries', head[1])
    redis.call('ZREM', base .. 'deadlines', head[1])
    redis.call('ZREM', q, head[1])
    local weight = tonumber(redis.call('HGET', base .. 'weights', tenant) or '1')
    local served = num(cjson.decode(entry)['cost'] / weight)
    local counter = redis.call('HINCRBYFLOAT', base .. 'vtc', tenant, served)
    if redis.call('ZCARD', q) == 0 then
      deactivate(tenant)
    else
      redis.call('ZADD', base .. 'active', counter, tenant)
    end
    reply[1] = entry
    return reply
  end
  -- A head without an entry (or an active tenant with an empty queue) should not exist; repair it.
  if head[1] then redis.call('ZREM', q, head[1]) else deactivate(tenant) end
end
"""
)

# ARGV: base, now, tenant, tokens / weight
_CHARGE = (
    _LIB
    + """
local counter = redis.call('HINCRBYFLOAT', base .. 'vtc', ARGV[3], ARGV[4])
-- An admission that did not wait is demand too (a negative correction is not).
if tonumber(ARGV[4]) > 0 then add_demand(ARGV[3], tonumber(ARGV[4])) end
if redis.call('ZSCORE', base .. 'active', ARGV[3]) then
  redis.call('ZADD', base .. 'active', counter, ARGV[3])
end
return counter
"""
)

# ARGV: base, now, tenant, share. Light: another waiting tenant (of the first 16 in the fair order), or the
# last one that stopped waiting, asked for more than its demand / share recently.
_LIGHT = (
    _LIB
    + """
local mine = demand(ARGV[3]) or 0
local others = redis.call('ZRANGE', base .. 'active', 0, 15)
table.insert(others, redis.call('GET', base .. 'floor_tenant') or ARGV[3])
for _, other in ipairs(others) do
  if other ~= ARGV[3] and mine < tonumber(ARGV[4]) * (demand(other) or 0) then return 1 end
end
return 0
"""
)

# ARGV: base, now, id
_REMOVE = (
    _LIB
    + """
return drop(ARGV[3]) or false
"""
)

# ARGV: base, now
_REAP = (
    _LIB
    + """
reap()
return reply
"""
)


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request waiting for admission, as the queue holds it."""

    request_id: str
    tenant: str
    cost_tokens: int  # charged to the tenant's counter (÷ weight) when the request leaves the queue
    enqueued_at_s: float  # queue clock (Redis server time unless a clock is given)
    deadline_s: float  # after this the request is dropped instead of served

    @classmethod
    def from_json(cls, text: str) -> QueuedRequest:
        d: dict[str, Any] = json.loads(text)
        return cls(str(d["id"]), str(d["tenant"]), int(d["cost"]), float(d["enqueued"]), float(d["deadline"]))


class FairQueue:
    """A bounded waiting queue shared by all scheduler replicas, served in token-fair order.

    ``name`` separates independent queues (e.g. one per model version) under one prefix; ``max_depth``
    bounds the whole queue, each tenant's ``max_queue_depth`` its own share of it. Requests dropped for
    their timeout by any call of this instance are collected for `expired` (their waiters also know their
    own deadline, so a request dropped by another replica is failed by its waiter). ``clock`` replaces
    Redis server time (seconds), for tests.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "baton:",
        name: str = "default",
        max_depth: int = 10_000,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] | None = None,
        burst_credit_tokens: float = 0.0,
    ) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        if burst_credit_tokens < 0:
            raise ValueError("burst_credit_tokens must not be negative")
        self.burst_credit_tokens = burst_credit_tokens
        self.name = name
        self.max_depth = max_depth
        self.retry_after_s = retry_after_s
        self._client = client
        self._base = f"{prefix}fq:{{{name}}}:"
        # Scripts name one real key, so a cluster-aware client routes them to the queue's slot.
        self._keys = [self._base + "entries"]
        self._clock = clock
        self._expired: list[QueuedRequest] = []
        self._enqueue = client.register_script(_ENQUEUE)
        self._pop = client.register_script(_POP)
        self._charge = client.register_script(_CHARGE)
        self._remove = client.register_script(_REMOVE)
        self._light = client.register_script(_LIGHT)
        self._reap = client.register_script(_REAP)

    def _args(self, *args: str | int | float) -> list[str | int | float]:
        return [self._base, "" if self._clock is None else repr(self._clock()), *args]

    def _collect(self, reply: list[str]) -> str:
        """Keep the dropped entries that follow the status in a script's reply; return the status."""
        self._expired.extend(QueuedRequest.from_json(text) for text in reply[1:])
        return reply[0]

    async def enqueue(
        self, tenant: TenantConfig, request_id: str, cost_tokens: int, timeout_s: float
    ) -> QueuedRequest:
        """Put a request at the back of its tenant's line; `CapacityExceeded` when the tenant's line or
        the whole queue is full. Enqueueing an id that is already waiting returns it unchanged."""
        if cost_tokens < 0 or not timeout_s > 0:
            raise ValueError("cost_tokens must not be negative and timeout_s must be positive")
        status = self._collect(
            await self._enqueue(
                keys=self._keys,
                args=self._args(
                    request_id,
                    tenant.name,
                    cost_tokens,
                    repr(float(timeout_s)),
                    repr(tenant.weight),
                    tenant.max_queue_depth,
                    self.max_depth,
                    repr(self.burst_credit_tokens),
                ),
            )
        )
        if status.startswith("full:"):
            raise CapacityExceeded(
                f"the waiting queue is full ({status[5:]} requests waiting); retry after "
                f"{self.retry_after_s:g} s",
                retry_after_s=self.retry_after_s,
            )
        if status.startswith("tenant_full:"):
            raise CapacityExceeded(
                f"tenant {tenant.name!r} already has {status[12:]} requests waiting "
                f"(max_queue_depth={tenant.max_queue_depth}); retry after {self.retry_after_s:g} s",
                retry_after_s=self.retry_after_s,
            )
        return QueuedRequest.from_json(status)

    async def pop_next(self) -> QueuedRequest | None:
        """The next request to admit (charging its cost to its tenant), or None if nothing waits."""
        status = self._collect(await self._pop(keys=self._keys, args=self._args("")))
        return QueuedRequest.from_json(status) if status else None

    async def pop_if_next(self, request_id: str) -> bool:
        """Takes ``request_id`` out (charging its cost) only if it is the next request to admit: how a
        waiter that sees room claims it without overtaking anyone the fair order puts first."""
        status = self._collect(await self._pop(keys=self._keys, args=self._args(request_id)))
        return bool(status)

    async def charge(self, tenant: TenantConfig, tokens: float) -> float:
        """Add tokens served beyond (or, if negative, short of) what was charged at pop; returns the
        tenant's new counter."""
        weighted = repr(tokens / tenant.weight)
        counter = await self._charge(keys=self._keys, args=self._args(tenant.name, weighted))
        return float(counter)

    async def is_light(self, tenant: str) -> bool:
        """Whether ``tenant`` asked for less than ``LIGHT_SHARE`` of another waiting tenant's recent
        demand: a light tenant next to a heavy one (scheduler.placement: latency isolation)."""
        return bool(await self._light(keys=self._keys, args=self._args(tenant, repr(LIGHT_SHARE))))

    async def remove(self, request_id: str) -> QueuedRequest | None:
        """Take a waiting request out (cancelled, or its waiter gave up); None if it is not waiting."""
        entry = await self._remove(keys=self._keys, args=self._args(request_id))
        return None if entry is None else QueuedRequest.from_json(str(entry))

    async def reap_expired(self) -> list[QueuedRequest]:
        """Drop every request whose deadline passed; returns them with any dropped earlier (`expired`)."""
        self._collect(await self._reap(keys=self._keys, args=self._args()))
        return self.expired()

    def expired(self) -> list[QueuedRequest]:
        """The requests this instance dropped for their timeout since the last call; fail them."""
        out, self._expired = self._expired, []
        return out

    async def depth(self, tenant: str | None = None) -> int:
        """Requests waiting, in total or for one tenant (including any past their deadline not yet
        dropped)."""
        key = self._base + ("deadlines" if tenant is None else f"q:{tenant}")
        return int(await self._client.zcard(key))

    async def counter(self, tenant: str) -> float:
        """A tenant's virtual token counter (tokens served / weight, lifted when it starts waiting)."""
        value = await self._client.hget(self._base + "vtc", tenant)
        return 0.0 if value is None else float(value)
