"""`WorkerRegistry`: which workers are alive, what they serve, how loaded they are, and which prefix blocks they hold.

All state lives in Redis so that scheduler replicas stay stateless. Liveness is a TTL: every heartbeat
re-arms it, and a worker that misses heartbeats for ``heartbeat_timeout_s`` simply disappears from
placement (no scheduler has to notice it died). Keys, with the default prefix ``baton:``:

* ``baton:workers`` — SET of worker ids ever registered and not yet swept (an index; may hold expired ids).
* ``baton:worker:{id}`` — HASH: the `WorkerRecord`, the last `WorkerLoad`, and the scheduler's drain flag.
  TTL = heartbeat timeout.
* ``baton:prefix:{id}`` — SET of the block hashes (hex) in the worker's prefix cache. Same TTL.
* ``baton:workers:epoch`` — a counter: every registration gets the next value as its *epoch*. A
  heartbeat names the epoch it belongs to; one of a superseded or evicted registration is refused, and
  the worker is fenced (it gives up the work it held, then registers again): a worker that hung or was
  partitioned past its heartbeat timeout never carries on as though nothing happened.

Scripts build per-worker keys from the prefix, so this assumes one Redis (or primary/replica), not Cluster.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast

import redis.asyncio as aioredis

from core.errors import InvalidRequest

log = logging.getLogger(__name__)

WorkerRole = Literal["prefill", "decode", "both"]
ROLES: frozenset[str] = frozenset({"prefill", "decode", "both"})

# KEYS[4] is a counter: every change of a worker's prefix set gets a new ``prefix_gen``, so a
# scheduler's local copy re-reads only the sets that changed (RegistrySnapshot). KEYS[5]: the epoch
# counter; the registration's epoch is the reply.
_REGISTER = """
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
local epoch = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[1], 'prefix_gen', redis.call('INCR', KEYS[4]), 'epoch', epoch)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
return epoch
"""

# KEYS: worker hash, prefix set. ARGV: ttl_ms, replace ("1"/"0"), number of load fields*2, epoch ("0":
# any), fields…, hashes… A heartbeat of another epoch than the record's is refused like an expired one.
# Lua's unpack() fails past a few thousand values, so the hashes go in with SADDs of 1000.
_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[4] ~= '0' and redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[4] then return 0 end
local nfields = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 5, 4 + nfields))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if ARGV[2] == '1' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'prefix_gen', redis.call('INCR', KEYS[3]))
  local first = 5 + nfields
  for i = first, #ARGV, 1000 do
    redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
end
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# Conditional so that setting the flag on an expired worker cannot resurrect a hash without a TTL.
_SET_DRAINING = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'drain_requested', ARGV[1])
return 1
"""

# Atomic, so a worker that re-registers between the check and the removal is never dropped from the index.
_SWEEP = """
local gone = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    redis.call('SREM', KEYS[1], id)
    table.insert(gone, id)
  end
end
return gone
"""

# One round trip for a scheduler's short-lived local copy (scheduler.snapshot): every live, undrained
# worker of the model with its whole published prefix set, as (id, record, prefix_gen, set).
# ARGV[4]: JSON {worker id: [prefix_gen, timestamp]} of what the caller already holds. A record whose
# load timestamp it holds comes back as 0 (its copy stands: most heartbeats reach the replica that
# refreshes, which applied them already), and so does a set of the generation it holds.
_SNAPSHOT_SETS = """
local out = {}
local known = cjson.decode(ARGV[4])
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  -- The few fields that decide, first: most records are unchanged and never read whole.
  local m = redis.call('HMGET', ARGV[1] .. id, 'model', 'draining', 'drain_requested', 'timestamp', 'prefix_gen')
  if m[1] == ARGV[3] and m[2] ~= '1' and m[3] ~= '1' then
    local k = known[id]
    table.insert(out, id)
    if k ~= nil and k[2] == m[4] then
      table.insert(out, 0)
    else
      local row = redis.call('HGETALL', ARGV[1] .. id)
      local f = {}
      for i = 1, #row, 2 do f[row[i]] = row[i + 1] end
      table.insert(out, cjson.encode(f))
    end
    table.insert(out, m[5] or '')
    if k ~= nil and k[1] == m[5] then
      table.insert(out, 0)
    else
      table.insert(out, redis.call('SMEMBERS', ARGV[2] .. id))
    end
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a worker is: identity, role, the model version it serves and the shape of its KV cache."""

    worker_id: str  # the worker's gRPC address, host:port
    role: WorkerRole
    model: str  # served model name
    version: str  # model digest: P and D are only paired within one version
    address: str
    num_blocks: int
    block_size: int
    max_model_len: int
    kv_backend: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"role must be one of {sorted(ROLES)}, got {self.role!r}")
        if not self.worker_id or not self.model or not self.version:
            raise InvalidRequest("worker_id, model and version must be non-empty")
        if self.num_blocks <= 0 or self.block_size <= 0 or self.max_model_len <= 0:
            raise InvalidRequest("num_blocks, block_size and max_model_len must be positive")

    def serves(self, role: str) -> bool:
        """True if this worker takes ``role`` work: a "both" worker serves prefill and decode."""
        return self.role == role or (self.role == "both" and role in ("prefill", "decode"))


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as of one heartbeat."""

    free_blocks: int
    running: int
    waiting: int
    transfers: int  # KV pulls in flight
    leases: int  # KV leases held (blocks pinned for a decode worker)
    draining: bool = False  # the worker itself is shutting down and takes no new work
    queued_tokens: int = 0  # prompt tokens still to compute (the prefill backlog an autoscaler reads)
    timestamp: float = field(default_factory=time.time)  # wall clock, when the load was measured


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A live worker as placement sees it: its record, last load, and whether the scheduler drains it."""

    record: WorkerRecord
    load: WorkerLoad
    drain_requested: bool = (
        False  # set by `WorkerRegistry.set_draining`, independent of the worker's own flag
    )
    epoch: int = 0  # its registration's (0: registered before epochs existed)

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def draining(self) -> bool:
        return self.load.draining or self.drain_requested


def _load_fields(load: WorkerLoad) -> list[str]:
    return [
        "free_blocks",
        str(load.free_blocks),
        "running",
        str(load.running),
        "waiting",
        str(load.waiting),
        "transfers",
        str(load.transfers),
        "leases",
        str(load.leases),
        "draining",
        "1" if load.draining else "0",
        "queued_tokens",
        str(load.queued_tokens),
        "timestamp",
        repr(load.timestamp),
    ]


def _record_fields(record: WorkerRecord) -> list[str]:
    return [
        "worker_id",
        record.worker_id,
        "role",
        record.role,
        "model",
        record.model,
        "version",
        record.version,
        "address",
        record.address,
        "num_blocks",
        str(record.num_blocks),
        "block_size",
        str(record.block_size),
        "max_model_len",
        str(record.max_model_len),
        "kv_backend",
        record.kv_backend,
    ]


def _parse_view(row: dict[str, str]) -> WorkerView:
    record = WorkerRecord(
        worker_id=row["worker_id"],
        role=cast(WorkerRole, row["role"]),
        model=row["model"],
        version=row["version"],
        address=row["address"],
        num_blocks=int(row["num_blocks"]),
        block_size=int(row["block_size"]),
        max_model_len=int(row["max_model_len"]),
        kv_backend=row["kv_backend"],
    )
    load = WorkerLoad(
        free_blocks=int(row["free_blocks"]),
        running=int(row["running"]),
        waiting=int(row["waiting"]),
        transfers=int(row["transfers"]),
        leases=int(row["leases"]),
        draining=row["draining"] == "1",
        queued_tokens=int(row.get("queued_tokens", "0")),
        timestamp=float(row["timestamp"]),
    )
    return WorkerView(
        record=record,
        load=load,
        drain_requested=row.get("drain_requested") == "1",
        epoch=int(row.get("epoch", "0")),
    )


class KnownWorker(NamedTuple):
    """What a registry reader already holds of one worker (see `WorkerRegistry.snapshot_with_prefixes`)."""

    view: WorkerView
    prefix_gen: str
    held: frozenset[str]


class WorkerRegistry:
    """Worker membership, load and prefix-cache contents in Redis, with TTL-based failure detection.

    A worker calls `register` once and `heartbeat` every ``heartbeat_timeout_s / 3`` or so; when a
    heartbeat returns False its registration expired (or was removed) and it must `register` again.
    """

    def __init__(
        self, client: aioredis.Redis, prefix: str = "baton:", heartbeat_timeout_s: float = 3.0
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        self._redis = client
        self._prefix = prefix
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._ttl_ms = max(1, round(heartbeat_timeout_s * 1000))
        self._index = f"{prefix}workers"
        self._gen_key = f"{prefix}workers:prefix_gen"
        self._epoch_key = f"{prefix}workers:epoch"
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._set_draining = client.register_script(_SET_DRAINING)
        self._sweep = client.register_script(_SWEEP)
        self._snapshot_sets = client.register_script(_SNAPSHOT_SETS)

    def _worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}worker:{worker_id}"

    def _prefix_key(self, worker_id: str) -> str:
        return f"{self._prefix}prefix:{worker_id}"

    async def register(
        self, record: WorkerRecord, load: WorkerLoad, cached_hashes: Sequence[str] | None = None
    ) -> int:
        """(Re)register a worker: a new incarnation, so its prefix set and the drain flag start empty.
        Returns its epoch, larger than any registration's before it."""
        fields = [*_record_fields(record), *_load_fields(load), "drain_requested", "0"]
        epoch = int(
            await self._register(
                keys=[
                    self._worker_key(record.worker_id),
                    self._prefix_key(record.worker_id),
                    self._index,
                    self._gen_key,
                    self._epoch_key,
                ],
                args=[self._ttl_ms, record.worker_id, *fields],
            )
        )
        if cached_hashes:
            await self.heartbeat(record.worker_id, load, cached_hashes, epoch)
        log.info(
            "worker %s registered: role=%s model=%s version=%s blocks=%d epoch=%d",
            record.worker_id,
            record.role,
            record.model,
            record.version,
            record.num_blocks,
            epoch,
        )
        return epoch

    async def heartbeat(
        self, worker_id: str, load: WorkerLoad, cached_hashes: Sequence[str] | None = None, epoch: int = 0
    ) -> bool:
        """Refresh the worker's TTL and load; with ``cached_hashes`` also replace its published prefix set.

        Returns False if the worker is unknown or expired, or ``epoch`` (0: any) is not its current
        registration's: it must `register` again.
        """
        fields = _load_fields(load)
        replace = cached_hashes is not None
        args: list[str | int] = [self._ttl_ms, "1" if replace else "0", len(fields), str(epoch), *fields]
        if cached_hashes:
            args.extend(cached_hashes)
        ok = await self._heartbeat(
            keys=[self._worker_key(worker_id), self._prefix_key(worker_id), self._gen_key], args=args
        )
        return bool(ok)

    async def deregister(self, worker_id: str) -> None:
        """Remove a worker at once (graceful shutdown), rather than waiting for its TTL."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._worker_key(worker_id), self._prefix_key(worker_id))
        pipe.srem(self._index, worker_id)
        await pipe.execute()
        log.info("worker %s deregistered", worker_id)

    async def set_draining(self, worker_id: str, draining: bool) -> bool:
        """Stop (or resume) placing new work on a worker; False if it is unknown or expired.

        The flag belongs to the current registration: a worker that re-registers starts undrained.
        """
        ok = await self._set_draining(keys=[self._worker_key(worker_id)], args=["1" if draining else "0"])
        if ok:
            log.info("worker %s %s", worker_id, "draining" if draining else "undrained")
        return bool(ok)

    async def get(self, worker_id: str) -> WorkerView | None:
        """One live worker, or None if it is unknown or expired."""
        row = cast(dict[str, str], await self._redis.hgetall(self._worker_key(worker_id)))
        return _parse_view(row) if row else None

    async def all_workers(self) -> list[WorkerView]:
        """Every live worker (draining ones included), sorted by id; expired ones are already gone."""
        ids = sorted(cast(set[str], await self._redis.smembers(self._index)))
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self._worker_key(worker_id))
        rows: list[dict[str, str]] = await pipe.execute()
        return [_parse_view(row) for row in rows if row]

    async def healthy(
        self,
        model: str,
        version: str | None = None,
        roles: Collection[str] | None = None,
        include_draining: bool = False,
    ) -> list[WorkerView]:
        """Live workers that may take new work for ``model`` (and ``version``, if given).

        ``roles``: keep workers that serve any of them (a "both" worker serves prefill and decode).
        Draining workers are left out unless ``include_draining``.
        """
        views = []
        for view in await self.all_workers():
            record = view.record
            if record.model != model or (version is not None and record.version != version):
                continue
            if roles is not None and not any(record.serves(role) for role in roles):
                continue
            if view.draining and not include_draining:
                continue
            views.append(view)
        return views

    async def sweep(self) -> list[str]:
        """Drop expired workers from the index; returns their ids (for a log line or a metric)."""
        gone = cast(list[str], await self._sweep(keys=[self._index], args=[f"{self._prefix}worker:"]))
        for worker_id in gone:
            log.warning(
                "worker %s missed its heartbeats for %.1fs: evicted", worker_id, self.heartbeat_timeout_s
            )
        return gone

    async def snapshot_with_prefixes(
        self, model: str, known: Mapping[str, KnownWorker] | None = None
    ) -> list[tuple[WorkerView, str, frozenset[str]]]:
        """Every live, undrained worker of ``model`` with its prefix-set generation and set, in one
        round trip. ``known`` (worker id → what the caller holds of it) saves sending and parsing what
        did not change: a record whose load timestamp it holds, a set of the generation it holds."""
        known = known or {}
        raw = cast(
            list[Any],
            await self._snapshot_sets(
                keys=[self._index],
                args=[
                    f"{self._prefix}worker:",
                    f"{self._prefix}prefix:",
                    model,
                    json.dumps({k: [w.prefix_gen, repr(w.view.load.timestamp)] for k, w in known.items()})
                    if known
                    else "{}",
                ],
            ),
        )
        rows = []
        for i in range(0, len(raw), 4):
            worker_id, fields, gen, held = raw[i : i + 4]
            view = known[worker_id].view if fields == 0 else _parse_view(json.loads(fields))
            rows.append((view, gen, known[worker_id].held if held == 0 else frozenset(held)))
        return rows
