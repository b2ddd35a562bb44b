"""`RegistrySnapshot`: a scheduler replica's short-lived copy of the worker registry.

Workers publish their load and prefix hashes once per heartbeat (about a second apart), so reading
the registry from Redis for every decision buys no freshness — it only costs a round trip and a
parse of every worker's record per request. A replica re-reads at most every ``max_age_s`` (default
50 ms, well under a heartbeat) and decides from memory in between; concurrent decisions share one
refresh. Eviction stays prompt: a worker that misses its heartbeats is gone from the next refresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Generic, TypeVar

from scheduler.registry import KnownWorker, WorkerLoad, WorkerRegistry, WorkerView

K = TypeVar("K")
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """A replica's memory of slow-changing Redis state (tenants, rollout weights) for ``ttl_s``:
    a decision saves a round trip; a change made on another replica shows within ``ttl_s``, and
    one made here shows at once (``invalidate``)."""

    def __init__(self, ttl_s: float, max_items: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_items = max_items
        self._items: dict[K, tuple[float, V]] = {}

    def get(self, key: K) -> V | None:
        hit = self._items.get(key)
        if hit is None or time.monotonic() - hit[0] > self.ttl_s:
            return None
        return hit[1]

    def put(self, key: K, value: V) -> V:
        if len(self._items) >= self.max_items:
            self._items.clear()  # rare; simpler than LRU bookkeeping on the hot path
        self._items[key] = (time.monotonic(), value)
        return value

    def invalidate(self) -> None:
        self._items.clear()


def leading_hits(held: frozenset[str], chain: Sequence[str]) -> int:
    """How many leading blocks of a request's hash chain a worker holds (the first miss ends it)."""
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


class RegistrySnapshot:
    """Per model: the live workers and their prefix sets. A decision never waits for a refresh unless
    the copy is older than ``max_stale_s``: past ``max_age_s`` it gets the current copy while one
    background refresh re-reads the registry (only the prefix sets that changed come back)."""

    def __init__(self, registry: WorkerRegistry, max_age_s: float = 0.05, max_stale_s: float = 1.0) -> None:
        self.registry = registry
        self.max_age_s = max_age_s
        self.max_stale_s = max_stale_s
        self._data: dict[str, tuple[float, list[tuple[WorkerView, frozenset[str]]]]] = {}
        self._known: dict[str, dict[str, KnownWorker]] = {}  # model → id → what the last refresh read
        self._pending: dict[str, asyncio.Task[list[tuple[WorkerView, frozenset[str]]]]] = {}

    async def workers(self, model: str) -> list[tuple[WorkerView, frozenset[str]]]:
        cached = self._data.get(model)
        age = time.monotonic() - cached[0] if cached is not None else float("inf")
        if age <= self.max_age_s and cached is not None:
            return cached[1]
        task = self._pending.get(model)
        if task is None:
            task = self._pending[model] = asyncio.create_task(self._refresh(model))
            task.add_done_callback(
                lambda t: self._pending.pop(model, None) if self._pending.get(model) is t else None
            )
        if cached is not None and age <= self.max_stale_s:
            return cached[1]  # stale-while-revalidate: the refresh lands for the next decision
        return await asyncio.shield(task)

    def cached(self) -> dict[str, list[tuple[WorkerView, frozenset[str]]]]:
        """Every model's current copy (no refresh)."""
        return {model: rows for model, (_, rows) in self._data.items()}

    def update_load(self, worker_id: str, load: WorkerLoad) -> bool:
        """A heartbeat this replica just wrote: applies the worker's new load to the copy at once (a new
        list, so decisions holding the old one are unaffected). False if no copy holds the worker."""
        for model, (read_at, rows) in self._data.items():
            for i, (view, held) in enumerate(rows):
                if view.worker_id == worker_id:
                    if view.load.timestamp >= load.timestamp:
                        return False
                    fresh = list(rows)
                    fresh[i] = (replace(view, load=load), held)
                    self._data[model] = (read_at, fresh)
                    return True
        return False

    def invalidate(self, model: str | None = None) -> None:
        """Forget the copy (after a registration, so a new worker is placeable at once)."""
        if model is None:
            self._data.clear()
        else:
            self._data.pop(model, None)

    def _known_now(self, model: str) -> dict[str, KnownWorker] | None:
        """What the last refresh read, with the loads this replica applied since (`update_load`): a
        worker whose newest load in Redis is the one held here is not sent or parsed again."""
        known = self._known.get(model)
        cached = self._data.get(model)
        if known is None or cached is None:
            return known
        for view, _ in cached[1]:
            held = known.get(view.worker_id)
            if held is not None and held.view is not view:
                known[view.worker_id] = held._replace(view=view)
        return known

    async def _refresh(self, model: str) -> list[tuple[WorkerView, frozenset[str]]]:
        rows = await self.registry.snapshot_with_prefixes(model, self._known_now(model))
        self._known[model] = {view.worker_id: KnownWorker(view, gen, held) for view, gen, held in rows}
        result = [(view, held) for view, _, held in rows]
        self._data[model] = (time.monotonic(), result)
        return result
