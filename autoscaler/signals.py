"""What `baton autoscale` decides on: `Signals`, read from the cluster's own Prometheus endpoints — every
gateway's ``/metrics`` (demand counted on arrival, refusals, the TTFT and inter-token latency
histograms) and one scheduler's (the fair queue, and each pool's load summed from the workers'
heartbeats) — by a `MetricsSource` that keeps a short history of the cumulative series, so rates and
p95s are over a window (as Prometheus's ``rate`` and ``histogram_quantile`` would give), a gateway
restart (its counters back to zero) included. No Prometheus server is needed, and none is in the way:
the autoscaler reads the processes directly."""

from __future__ import annotations

import logging
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
REFUSED_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")  # a request turned away for want of capacity


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool's serving workers (draining ones left out), summed from their last heartbeats."""

    workers: int = 0
    running: int = 0  # requests in the running batches
    waiting: int = 0  # requests waiting for a batch slot or blocks
    queued_tokens: int = 0  # prompt tokens still to compute
    kv_blocks: int = 0
    kv_blocks_free: int = 0

    @property
    def kv_usage(self) -> float:
        """Share of the pool's KV cache in use, 0-1 (0 without workers)."""
        return 1.0 - self.kv_blocks_free / self.kv_blocks if self.kv_blocks else 0.0


@dataclass(frozen=True, slots=True)
class Signals:
    """The cluster over the last ``window_s`` seconds (rates, p95s) and now (the pools, the queue)."""

    window_s: float
    arrival_rate: float = 0.0  # requests/s arriving at the gateways, whatever became of them
    refused_rate: float = 0.0  # requests/s refused for capacity (RESOURCE_EXHAUSTED, UNAVAILABLE)
    completed: int = 0  # requests completed in the window
    ttft_p95_s: float | None = None  # None: nothing completed in the window
    itl_p95_s: float | None = None  # None: no token gap observed in the window
    queue_depth: int = 0  # requests waiting in the scheduler's fair queue for capacity
    queue_for_prefill: int = 0  # of those, the ones whose last look found every prefill worker full
    queue_for_decode: int = 0  # … and no decode worker with room
    prefill: PoolSignals = field(default_factory=PoolSignals)
    decode: PoolSignals = field(default_factory=PoolSignals)
    sources_down: tuple[str, ...] = ()  # endpoints that did not answer this time

    def pool(self, name: str) -> PoolSignals:
        return self.prefill if name == "prefill" else self.decode


# --- reading the exposition format ----------------------------------------------------------------

Buckets = dict[float, float]  # upper bound (le) → cumulative count


@dataclass(slots=True)
class GatewaySample:
    """The cumulative series of one gateway, as of one scrape (summed over models, versions, tenants)."""

    arrivals: float = 0.0
    refused: float = 0.0
    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)


def parse_gateway(text: str) -> GatewaySample:
    sample = GatewaySample()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "baton_gateway_arrivals_total":
                sample.arrivals += s.value
            elif s.name == "baton_gateway_requests_total" and s.labels.get("code") in REFUSED_CODES:
                sample.refused += s.value
            elif s.name in ("baton_gateway_ttft_seconds_bucket", "baton_gateway_itl_seconds_bucket"):
                buckets = sample.ttft if s.name.startswith("baton_gateway_ttft") else sample.itl
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return sample


def parse_scheduler(text: str) -> tuple[int, dict[str, int], dict[str, PoolSignals]]:
    """From a scheduler replica's exposition: the fair queue's depth (cluster-wide), this replica's
    waiters by the pool they wait for, and each role's pool (cluster-wide)."""
    depth, workers, waiting_for = 0, dict[str, int](), dict[str, int]()
    values: dict[tuple[str, str], float] = {}  # (series, role) → value
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "baton_scheduler_queue_depth":
                depth = int(s.value)
            elif s.name == "baton_scheduler_queue_waiting_for":
                waiting_for[s.labels.get("pool", "")] = int(s.value)
            elif s.name == "baton_scheduler_workers" and s.labels.get("state") == "serving":
                role = s.labels.get("role", "")
                workers[role] = workers.get(role, 0) + int(s.value)
            elif s.name.startswith("baton_scheduler_pool_"):
                values[(s.name.removeprefix("baton_scheduler_pool_"), s.labels.get("role", ""))] = s.value
    pools = {}
    for role in ("prefill", "decode", "both"):
        pools[role] = PoolSignals(
            workers=workers.get(role, 0),
            running=int(values.get(("requests_running", role), 0)),
            waiting=int(values.get(("requests_waiting", role), 0)),
            queued_tokens=int(values.get(("queued_tokens", role), 0)),
            kv_blocks=int(values.get(("kv_blocks", role), 0)),
            kv_blocks_free=int(values.get(("kv_blocks_free", role), 0)),
        )
    return depth, waiting_for, pools


def quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile of a histogram's (non-cumulative in time, cumulative in le) bucket counts, by
    linear interpolation inside the bucket it falls in, as Prometheus's ``histogram_quantile``. None
    when the histogram is empty; the highest finite bound when it falls in the +Inf bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _grew(new: float, old: float) -> float:
    """How much a counter grew between two samples; one that went down was reset (its process
    restarted) and counts from zero."""
    return new - old if new >= old else new


def _increase(new: Buckets, old: Buckets) -> Buckets:
    return {le: _grew(v, old.get(le, 0.0)) for le, v in new.items()}


def _add(total: Buckets, more: Buckets) -> None:
    for le, v in more.items():
        total[le] = total.get(le, 0.0) + v


# --- the source ------------------------------------------------------------------------------------


def fetch(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode())


def expand(url: str, resolve: Callable[[str], Iterable[str]] | None = None) -> list[str]:
    """The URLs to scrape for one configured URL: one per address its host resolves to (a Kubernetes
    headless Service names every gateway pod), the URL itself when it resolves to one or none."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        addresses = sorted(set((resolve or _resolve)(host)))
    except OSError:
        return [url]
    if len(addresses) <= 1:
        return [url]
    port = f":{parts.port}" if parts.port else ""
    return [
        urllib.parse.urlunsplit(parts._replace(netloc=(f"[{a}]" if ":" in a else a) + port))
        for a in addresses
    ]


def _resolve(host: str) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]


class MetricsSource:
    """Scrapes the gateways and a scheduler at each `read`, keeps the gateways' cumulative series for
    ``window_s`` (per URL, so one restarted gateway's reset counters are read as such), and returns the
    `Signals` over that window."""

    def __init__(
        self,
        gateway_urls: Sequence[str],
        scheduler_url: str,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        get: Callable[[str], str] = fetch,
        resolve: Callable[[str], Iterable[str]] | None = None,
    ) -> None:
        self.gateway_urls = tuple(gateway_urls)
        self.scheduler_url = scheduler_url
        self.window_s = window_s
        self._clock = clock
        self._get = get
        self._resolve = resolve
        self._history: deque[tuple[float, dict[str, GatewaySample]]] = deque()

    def read(self) -> Signals:
        now = self._clock()
        down: list[str] = []
        samples: dict[str, GatewaySample] = {}
        for configured in self.gateway_urls:
            for url in expand(configured, self._resolve):
                try:
                    samples[url] = parse_gateway(self._get(url))
                except (OSError, ValueError, urllib.error.URLError) as e:
                    log.warning("cannot scrape %s: %s", url, e)
                    down.append(url)
        depth, waiting_for, pools = 0, dict[str, int](), dict[str, PoolSignals]()
        # Every scheduler replica (a headless Service names each): the queue's waiters are per replica.
        for url in expand(self.scheduler_url, self._resolve) if self.scheduler_url else ():
            try:
                replica_depth, replica_waiting, pools = parse_scheduler(self._get(url))
            except (OSError, ValueError, urllib.error.URLError) as e:
                log.warning("cannot scrape %s: %s", url, e)
                down.append(url)
                continue
            depth = max(depth, replica_depth)
            for pool, n in replica_waiting.items():
                waiting_for[pool] = waiting_for.get(pool, 0) + n
        self._history.append((now, samples))
        while len(self._history) > 2 and self._history[1][0] <= now - self.window_s:
            self._history.popleft()  # keep one sample at or before the window's start
        return self._signals(now, depth, waiting_for, pools, tuple(down))

    def _signals(
        self,
        now: float,
        depth: int,
        waiting_for: Mapping[str, int],
        pools: Mapping[str, PoolSignals],
        down: tuple[str, ...],
    ) -> Signals:
        since = self._history[0][0]
        span = now - since
        arrivals = refused = 0.0
        ttft: Buckets = {}
        itl: Buckets = {}
        # Walk consecutive samples, as Prometheus's increase() does: a counter that went down in one
        # step was reset (the gateway restarted) and counts from zero there, not as a drop.
        for (_, before), (_, after) in zip(self._history, list(self._history)[1:], strict=False):
            for url, sample in after.items():
                prev = before.get(url)
                if prev is None:
                    continue  # a gateway first seen here: its series start with the next sample
                arrivals += _grew(sample.arrivals, prev.arrivals)
                refused += _grew(sample.refused, prev.refused)
                _add(ttft, _increase(sample.ttft, prev.ttft))
                _add(itl, _increase(sample.itl, prev.itl))
        completed = int(max(ttft.values(), default=0.0))
        decode = pools.get("decode", PoolSignals())
        if not decode.workers and pools.get("both", PoolSignals()).workers:
            decode = pools["both"]  # a colocated cluster: its workers are the decode pool
        return Signals(
            window_s=span,
            arrival_rate=arrivals / span if span > 0 else 0.0,
            refused_rate=refused / span if span > 0 else 0.0,
            completed=completed,
            ttft_p95_s=quantile(0.95, ttft),
            itl_p95_s=quantile(0.95, itl),
            queue_depth=depth,
            queue_for_prefill=waiting_for.get("prefill", 0),
            queue_for_decode=waiting_for.get("decode", 0),
            prefill=pools.get("prefill", PoolSignals()),
            decode=decode,
            sources_down=down,
        )
