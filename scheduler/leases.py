"""`LeaseLedger`: every prefill→decode KV handoff as a lease in Redis, with explicit states and a reaper.

A lease is PINNED when the prefill worker pins the prompt's blocks, PULLING once the decode worker
starts reading them, and ends RELEASED (pull done), ABORTED (cancelled or failed) or EXPIRED (nobody
finished it in time: the reaper tells the prefill worker to free the blocks). Every transition is one
Lua script, so two scheduler replicas can never both move the same lease. Keys, prefix ``baton:``:

* ``baton:lease:{id}`` — HASH of the `Lease`. Active leases carry a safety TTL (ttl + retention) so
  that nothing outlives a cluster without a reaper; finished ones expire after ``retention_s``.
* ``baton:leases:pinned`` / ``baton:leases:pulling`` — ZSETs of active lease ids scored by expiry
  time: the reaper's index, and how `counts` and `stranded_blocks` stay O(log n) per lease.
* ``baton:leases:released`` / ``:expired`` / ``:aborted`` — ZSETs of finished ids scored by finish time,
  trimmed to the retention window (so they count exactly the finished leases still in Redis).
* ``baton:leases:totals`` — HASH: how many leases ever entered each state (counters for metrics).
* ``baton:lease-ended:{id}`` — STRING ``released`` | ``aborted``, for ``retention_s``: the end of a lease
  reported before its pin. Reports travel as concurrent calls, so an end can reach Redis first; the pin
  that follows then records the lease as ended at once instead of leaving it active until its TTL.

Times are wall-clock seconds (``time.time()``) of whichever replica acts: replicas on different hosts
share them, which a monotonic clock could not do; NTP skew is small next to lease TTLs.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from scheduler.redis_pipe import RedisPipe, register_script

log = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    """Where a KV lease is: PINNED → PULLING → RELEASED | EXPIRED | ABORTED (PINNED may finish directly)."""

    PINNED = "pinned"
    PULLING = "pulling"
    RELEASED = "released"
    EXPIRED = "expired"
    ABORTED = "aborted"

    @property
    def active(self) -> bool:
        return self in (LeaseState.PINNED, LeaseState.PULLING)


# The only legal transitions: target → the states it may come from. EXPIRED is reached by `expire_due`.
_SOURCES: dict[LeaseState, tuple[LeaseState, ...]] = {
    LeaseState.PULLING: (LeaseState.PINNED,),
    LeaseState.RELEASED: (LeaseState.PINNED, LeaseState.PULLING),
    LeaseState.ABORTED: (LeaseState.PINNED, LeaseState.PULLING),
}

# KEYS: lease hash, pinned zset, totals, end mark, released zset, aborted zset.
# ARGV: id, request, prefill, decode, blocks, now, expires_at, safety_ms, retention cutoff, retention_ms.
# An end (release/abort) reported before the pin left an end mark: the lease is recorded as ended at once
# (returns 2), never as an active lease that only its TTL would end.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local ended = redis.call('GET', KEYS[4])
redis.call('HSET', KEYS[1], 'lease_id', ARGV[1], 'request_id', ARGV[2], 'prefill_worker', ARGV[3],
           'decode_worker', ARGV[4], 'num_blocks', ARGV[5], 'state', ended or 'pinned', 'created_at', ARGV[6],
           'expires_at', ARGV[7], 'updated_at', ARGV[6])
redis.call('HINCRBY', KEYS[3], 'pinned', 1)
if ended then
  local z = KEYS[6]
  if ended == 'released' then z = KEYS[5] end
  redis.call('DEL', KEYS[4])
  redis.call('ZADD', z, ARGV[6], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', z, '-inf', ARGV[9])
  redis.call('PEXPIRE', KEYS[1], ARGV[10])
  redis.call('HINCRBY', KEYS[3], ended, 1)
  return 2
end
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('ZADD', KEYS[2], ARGV[7], ARGV[1])
return 1
"""

# KEYS: lease hash, pinned zset, pulling zset, target zset, totals, end mark.
# ARGV: id, target, now, retention cutoff, retention_ms, allowed source states…
# The end of a lease not created yet (its pin is still on the way) leaves an end mark for `_CREATE`.
# Starting a pull on an overdue lease is refused: the prefill worker may already have freed the blocks.
_TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  if ARGV[2] == 'released' or ARGV[2] == 'aborted' then redis.call('SET', KEYS[6], ARGV[2], 'PX', ARGV[5]) end
  return 0
end
local allowed = false
for i = 6, #ARGV do if ARGV[i] == state then allowed = true end end
if not allowed then return 0 end
if ARGV[2] == 'pulling' and tonumber(redis.call('HGET', KEYS[1], 'expires_at')) <= tonumber(ARGV[3]) then
  return 0
end
if state == 'pinned' then redis.call('ZREM', KEYS[2], ARGV[1]) else redis.call('ZREM', KEYS[3], ARGV[1]) end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'updated_at', ARGV[3])
if ARGV[2] == 'pulling' then
  redis.call('ZADD', KEYS[4], redis.call('HGET', KEYS[1], 'expires_at'), ARGV[1])
else
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
return 1
"""

# KEYS: pinned zset, pulling zset, expired zset, totals. ARGV: now, retention cutoff, retention_ms, limit,
# lease key prefix. One script, so two reapers never both claim the same lease.
_EXPIRE_DUE = """
local out = {}
local limit = tonumber(ARGV[4])
for z = 1, 2 do
  local room = limit - #out
  if room <= 0 then break end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[z], '-inf', ARGV[1], 'LIMIT', 0, room)) do
    redis.call('ZREM', KEYS[z], id)
    local key = ARGV[5] .. id
    -- an id without a hash outlived its safety TTL (no reaper ran for a long time): just drop it
    if redis.call('EXISTS', key) == 1 then
      redis.call('HSET', key, 'state', 'expired', 'updated_at', ARGV[1])
      redis.call('PEXPIRE', key, ARGV[3])
      redis.call('ZADD', KEYS[3], ARGV[1], id)
      redis.call('HINCRBY', KEYS[4], 'expired', 1)
      table.insert(out, redis.call('HGETALL', key))
    end
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[2])
return out
"""

# KEYS: pinned zset, pulling zset. ARGV: now, lease key prefix.
_STRANDED = """
local total = 0
for z = 1, 2 do
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[z], '-inf', ARGV[1])) do
    local n = redis.call('HGET', ARGV[2] .. id, 'num_blocks')
    if n then total = total + tonumber(n) end
  end
end
return total
"""


@dataclass(frozen=True, slots=True)
class Lease:
    """One handoff's blocks pinned on a prefill worker for a decode worker to pull."""

    lease_id: str
    request_id: str
    prefill_worker: str  # worker id (gRPC address) that holds the blocks
    decode_worker: str
    num_blocks: int
    state: LeaseState
    created_at: float  # wall-clock seconds
    expires_at: float
    updated_at: float  # last state change


def _parse_lease(row: dict[str, str]) -> Lease:
    return Lease(
        lease_id=row["lease_id"],
        request_id=row["request_id"],
        prefill_worker=row["prefill_worker"],
        decode_worker=row["decode_worker"],
        num_blocks=int(row["num_blocks"]),
        state=LeaseState(row["state"]),
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
        updated_at=float(row["updated_at"]),
    )


def _pairs_to_dict(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class LeaseLedger:
    """The cluster's record of KV leases: create, move through the legal states, and reap overdue ones.

    Transitions return False when illegal (unknown lease, wrong state, pull on an overdue lease) and
    never raise for that: a late or duplicate release from a worker is normal, not an error.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "baton:",
        retention_s: float = 300.0,
        pipe: RedisPipe | None = None,
    ) -> None:
        if retention_s <= 0:
            raise ValueError("retention_s must be positive")
        self._redis = client
        self._prefix = prefix
        self.retention_s = retention_s
        self._retention_ms = max(1, round(retention_s * 1000))
        self._totals = f"{prefix}leases:totals"
        # Once or twice per request (a pin, its end): on the pipe if given (scheduler.redis_pipe).
        self._create = register_script(client, pipe, _CREATE)
        self._transition = register_script(client, pipe, _TRANSITION)
        self._expire_due = client.register_script(_EXPIRE_DUE)
        self._stranded = client.register_script(_STRANDED)

    def _lease_key(self, lease_id: str) -> str:
        return f"{self._prefix}lease:{lease_id}"

    def _end_key(self, lease_id: str) -> str:
        return f"{self._prefix}lease-ended:{lease_id}"

    def _state_key(self, state: LeaseState) -> str:
        return f"{self._prefix}leases:{state.value}"

    async def create(
        self,
        lease_id: str,
        request_id: str,
        prefill_worker: str,
        decode_worker: str,
        num_blocks: int,
        ttl_s: float,
        now: float | None = None,
    ) -> Lease | None:
        """Record a new PINNED lease expiring ``ttl_s`` from now; None if ``lease_id`` already exists."""
        if ttl_s <= 0 or num_blocks < 0:
            raise ValueError("ttl_s must be positive and num_blocks non-negative")
        now = time.time() if now is None else now
        expires_at = now + ttl_s
        safety_ms = round((ttl_s + self.retention_s) * 1000)
        ok = await self._create(
            keys=[
                self._lease_key(lease_id),
                self._state_key(LeaseState.PINNED),
                self._totals,
                self._end_key(lease_id),
                self._state_key(LeaseState.RELEASED),
                self._state_key(LeaseState.ABORTED),
            ],
            args=[
                lease_id,
                request_id,
                prefill_worker,
                decode_worker,
                num_blocks,
                repr(now),
                repr(expires_at),
                safety_ms,
                repr(now - self.retention_s),
                self._retention_ms,
            ],
        )
        if not ok:
            log.warning("lease %s for request %s already exists", lease_id, request_id)
            return None
        if ok == 2:  # its end was reported first
            lease = await self.get(lease_id)
            log.info(
                "lease %s of request %s pinned after its end was reported: recorded as %s",
                lease_id,
                request_id,
                lease.state.value if lease is not None else "ended",
            )
            return lease
        log.info(
            "lease %s pinned: request %s, %d blocks on %s for %s, ttl %.1fs",
            lease_id,
            request_id,
            num_blocks,
            prefill_worker,
            decode_worker,
            ttl_s,
        )
        return Lease(
            lease_id,
            request_id,
            prefill_worker,
            decode_worker,
            num_blocks,
            LeaseState.PINNED,
            now,
            expires_at,
            now,
        )

    async def _move(self, lease_id: str, target: LeaseState, now: float | None) -> bool:
        now = time.time() if now is None else now
        ok = await self._transition(
            keys=[
                self._lease_key(lease_id),
                self._state_key(LeaseState.PINNED),
                self._state_key(LeaseState.PULLING),
                self._state_key(target),
                self._totals,
                self._end_key(lease_id),
            ],
            args=[
                lease_id,
                target.value,
                repr(now),
                repr(now - self.retention_s),
                self._retention_ms,
                *(source.value for source in _SOURCES[target]),
            ],
        )
        if ok:
            log.info("lease %s %s", lease_id, target.value)
        else:
            log.debug("lease %s: no legal transition to %s", lease_id, target.value)
        return bool(ok)

    async def pulling(self, lease_id: str, now: float | None = None) -> bool:
        """PINNED → PULLING: the decode worker starts reading. Refused once the lease is overdue."""
        return await self._move(lease_id, LeaseState.PULLING, now)

    async def release(self, lease_id: str, now: float | None = None) -> bool:
        """PINNED | PULLING → RELEASED: the decode worker has the blocks (or needed none of them). False if
        the lease is not there yet (its pin is on the way: it will be recorded as released) or has ended."""
        return await self._move(lease_id, LeaseState.RELEASED, now)

    async def abort(self, lease_id: str, now: float | None = None) -> bool:
        """PINNED | PULLING → ABORTED: cancelled or failed; the prefill worker frees the blocks."""
        return await self._move(lease_id, LeaseState.ABORTED, now)

    async def expire_due(self, now: float | None = None, limit: int = 1000) -> list[Lease]:
        """Move up to ``limit`` overdue PINNED/PULLING leases to EXPIRED and return them.

        Atomic: of several replicas reaping at once, exactly one gets each lease and so exactly one
        tells its prefill worker to free the blocks. A full batch means: call again.
        """
        now = time.time() if now is None else now
        rows = cast(
            list[list[str]],
            await self._expire_due(
                keys=[
                    self._state_key(LeaseState.PINNED),
                    self._state_key(LeaseState.PULLING),
                    self._state_key(LeaseState.EXPIRED),
                    self._totals,
                ],
                args=[
                    repr(now),
                    repr(now - self.retention_s),
                    self._retention_ms,
                    limit,
                    f"{self._prefix}lease:",
                ],
            ),
        )
        leases = [_parse_lease(_pairs_to_dict(row)) for row in rows]
        for lease in leases:
            log.warning(
                "lease %s expired: request %s, %d blocks on %s never released by %s",
                lease.lease_id,
                lease.request_id,
                lease.num_blocks,
                lease.prefill_worker,
                lease.decode_worker,
            )
        return leases

    async def get(self, lease_id: str) -> Lease | None:
        """A lease, active or finished within the retention period; None if unknown or gone."""
        row = cast(dict[str, str], await self._redis.hgetall(self._lease_key(lease_id)))
        return _parse_lease(row) if row else None

    async def counts(self, now: float | None = None) -> dict[LeaseState, int]:
        """How many leases are in Redis in each state (finished ones: within the retention period)."""
        now = time.time() if now is None else now
        cutoff = repr(now - self.retention_s)
        pipe = self._redis.pipeline(transaction=True)
        for state in LeaseState:
            if not state.active:
                pipe.zremrangebyscore(self._state_key(state), "-inf", cutoff)
            pipe.zcard(self._state_key(state))
        results: list[int] = await pipe.execute()
        cards = iter(results)
        counts = {}
        for state in LeaseState:
            if not state.active:
                next(cards)  # the trim's count of removed ids
            counts[state] = next(cards)
        return counts

    async def totals(self) -> dict[LeaseState, int]:
        """How many leases ever entered each state (since Redis started): counters for metrics."""
        raw = cast(dict[str, str], await self._redis.hgetall(self._totals))
        return {state: int(raw.get(state.value, 0)) for state in LeaseState}

    async def stranded_blocks(self, now: float | None = None) -> int:
        """Blocks of leases past their expiry but still PINNED/PULLING: should read zero after each reap."""
        now = time.time() if now is None else now
        return int(
            await self._stranded(
                keys=[self._state_key(LeaseState.PINNED), self._state_key(LeaseState.PULLING)],
                args=[repr(now), f"{self._prefix}lease:"],
            )
        )
