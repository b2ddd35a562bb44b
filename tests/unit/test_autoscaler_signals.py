"""`autoscaler.signals`: the autoscaler's inputs read from real exposition text (rendered by
prometheus-client from the gateway's and the scheduler's own metric objects), rates and p95s over a
window, counter resets, DNS expansion of a headless Service, and a source that is down."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from autoscaler.signals import MetricsSource, PoolSignals, expand, parse_scheduler, quantile
from rpc.metrics import LATENCY_BUCKETS
from scheduler import metrics as scheduler_metrics
from services.gateway.metrics import ITL_BUCKETS

pytestmark = pytest.mark.unit


class FakeGateway:
    """A gateway's series (the real names, labels and buckets) in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.arrivals = Counter("baton_gateway_arrivals", "", ["model", "api"], registry=r)
        self.requests = Counter(
            "baton_gateway_requests", "", ["model", "version", "tenant", "api", "outcome", "code"], registry=r
        )
        self.ttft = Histogram(
            "baton_gateway_ttft_seconds",
            "",
            ["model", "version", "tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "baton_gateway_itl_seconds", "", ["model", "version"], buckets=ITL_BUCKETS, registry=r
        )

    def serve(self, n: int, ttft_s: float, itl_s: float, tenant: str = "a") -> None:
        for _ in range(n):
            self.arrivals.labels("m", "grpc").inc()
            self.requests.labels("m", "v", tenant, "grpc", "ok", "OK").inc()
            self.ttft.labels("m", "v", tenant).observe(ttft_s)
            for _ in range(10):
                self.itl.labels("m", "v").observe(itl_s)

    def refuse(self, n: int) -> None:
        for _ in range(n):
            self.arrivals.labels("m", "http").inc()
            self.requests.labels("m", "none", "none", "http", "error", "RESOURCE_EXHAUSTED").inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def scheduler_text(
    depth: int = 0, waiting_for: dict[str, int] | None = None, **pools: scheduler_metrics.PoolLoad
) -> str:
    collector = scheduler_metrics.ClusterStateCollector()
    state = collector.state
    state.redis_up = True
    state.queue_depth = depth
    state.waiting_for = dict(waiting_for or {})
    for role, load in pools.items():
        state.pools[role] = load
        state.workers[("m", "v", role, "serving")] = 2
    state.workers[("m", "v", "decode", "draining")] = 1  # a draining worker is not capacity
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def source(pages: dict[str, str], clock: Clock, window_s: float = 30.0) -> MetricsSource:
    def get(url: str) -> str:
        if url not in pages:
            raise OSError(f"connection refused: {url}")
        return pages[url]

    return MetricsSource(
        list(u for u in pages if "gw" in u), "http://sched/metrics", window_s, clock, get, lambda h: [h]
    )


def test_the_scheduler_page_gives_each_pool_its_serving_workers_load() -> None:
    text = scheduler_text(
        3,
        {"prefill": 1, "decode": 2},
        decode=scheduler_metrics.PoolLoad(running=12, waiting=2, kv_blocks=1000, kv_blocks_free=250),
        prefill=scheduler_metrics.PoolLoad(queued_tokens=5000, kv_blocks=500, kv_blocks_free=500),
    )
    depth, waiting_for, pools = parse_scheduler(text)
    assert depth == 3 and waiting_for == {"prefill": 1, "decode": 2}
    assert pools["decode"] == PoolSignals(
        workers=2, running=12, waiting=2, kv_blocks=1000, kv_blocks_free=250
    )
    assert pools["decode"].kv_usage == pytest.approx(0.75)
    assert pools["prefill"].queued_tokens == 5000 and pools["prefill"].kv_usage == 0.0
    assert pools["both"] == PoolSignals()


def test_rates_and_p95s_are_over_the_window_and_survive_a_gateway_restart() -> None:
    clock, gw = Clock(), FakeGateway()
    pages = {"http://gw/metrics": "", "http://sched/metrics": scheduler_text()}
    gw.serve(100, ttft_s=2.0, itl_s=0.2)  # long before the window: must not count
    pages["http://gw/metrics"] = gw.text()
    src = source(pages, clock, window_s=30)
    first = src.read()
    assert first.completed == 0 and first.ttft_p95_s is None and first.arrival_rate == 0.0
    clock.t += 10
    gw.serve(40, ttft_s=0.07, itl_s=0.015)
    gw.refuse(10)
    pages["http://gw/metrics"] = gw.text()
    s = src.read()
    assert s.window_s == 10 and s.completed == 40
    assert s.arrival_rate == pytest.approx(5.0) and s.refused_rate == pytest.approx(1.0)
    assert 0.05 < s.ttft_p95_s <= 0.1 and 0.01 < s.itl_p95_s <= 0.02  # the old 2 s / 200 ms are gone
    # The gateway restarts: its counters start again from zero, and are read as an increase, not a drop.
    restarted = FakeGateway()
    restarted.serve(20, ttft_s=0.3, itl_s=0.05)
    pages["http://gw/metrics"] = restarted.text()
    clock.t += 10
    s = src.read()
    assert s.completed == 60 and s.arrival_rate == pytest.approx(70 / 20)
    # Past the window, only the recent samples count.
    for _ in range(4):
        clock.t += 10
        s = src.read()
    assert s.window_s == 30 and s.completed == 0 and s.ttft_p95_s is None and s.arrival_rate == 0


def test_several_gateways_add_up_and_one_that_is_down_is_named() -> None:
    clock, a, b = Clock(), FakeGateway(), FakeGateway()
    pages = {
        "http://gw-a/metrics": a.text(),
        "http://gw-b/metrics": b.text(),
        "http://sched/metrics": scheduler_text(),
    }
    src = source(pages, clock)
    src.read()
    clock.t += 5
    a.serve(10, 0.1, 0.01)
    b.serve(30, 0.1, 0.01)
    pages["http://gw-a/metrics"], pages["http://gw-b/metrics"] = a.text(), b.text()
    s = src.read()
    assert s.completed == 40 and s.arrival_rate == pytest.approx(8.0) and s.sources_down == ()
    del pages["http://gw-b/metrics"]
    clock.t += 5
    assert src.read().sources_down == ("http://gw-b/metrics",)


def test_quantile_interpolates_inside_its_bucket_like_prometheus() -> None:
    buckets = {0.01: 0.0, 0.02: 50.0, 0.04: 100.0, math.inf: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.02)
    assert quantile(0.95, buckets) == pytest.approx(0.038)
    assert quantile(0.95, {0.1: 0.0, math.inf: 10.0}) == 0.1  # in +Inf: the highest finite bound
    assert quantile(0.95, {0.1: 0.0, math.inf: 0.0}) is None


def test_every_scheduler_replica_is_read_for_its_own_waiters() -> None:
    """The queue's depth and the pools are cluster-wide (any replica says the same); who waits for what
    is each replica's own, so the waiters of all replicas are added up."""
    pages = {
        "http://10.0.0.1:9400/metrics": scheduler_text(
            5, {"prefill": 1, "decode": 2}, decode=scheduler_metrics.PoolLoad(running=3)
        ),
        "http://10.0.0.2:9400/metrics": scheduler_text(
            5, {"decode": 2}, decode=scheduler_metrics.PoolLoad(running=3)
        ),
    }
    src = MetricsSource(
        [],
        "http://sched-headless:9400/metrics",
        30,
        Clock(),
        pages.__getitem__,
        lambda h: ["10.0.0.1", "10.0.0.2"],
    )
    s = src.read()
    assert (s.queue_depth, s.queue_for_prefill, s.queue_for_decode) == (5, 1, 4) and s.decode.workers == 2


def test_a_headless_service_is_scraped_at_every_address() -> None:
    url = "http://baton-gateway-headless.ns.svc:8000/metrics"
    assert expand(url, lambda host: ["10.0.0.7", "10.0.0.5"]) == [
        "http://10.0.0.5:8000/metrics",
        "http://10.0.0.7:8000/metrics",
    ]
    assert expand(url, lambda host: ["10.0.0.5"]) == [url]  # one address: the name as given

    def unresolvable(host: str) -> list[str]:
        raise OSError("no such host")

    assert expand(url, unresolvable) == [url]  # the scrape then fails and says so
