"""docs/METRICS.md, the code and the Grafana dashboard name the same metrics: every metric a process
defines is documented with its type and labels, every documented one exists, and every series the
dashboard queries is documented. Plus the label bound and the slow-client wait."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from autoscaler.controller import AutoscalerMetrics
from rpc import metrics as rpc_metrics
from scheduler import metrics as scheduler_metrics
from services.gateway import metrics as service_metrics
from services.gateway.request_stream import Delta, Finished, RequestStream, Timings, Usage
from services.worker import metrics as worker_metrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `(baton_\w+)` \| (\w+) \| ([^|]+) \| ([^|]*) \|")
WORKER_IDENTITY = ["model", "version", "role", "worker"]


@dataclass(frozen=True)
class Documented:
    name: str  # as exposed: counters end in _total
    type: str
    unit: str
    labels: tuple[str, ...]

    @property
    def family(self) -> str:
        """The name prometheus-client's parser gives the family (a counter's without `_total`)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


def documented() -> dict[str, Documented]:
    out = {}
    for line in (ROOT / "docs" / "METRICS.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            labels = tuple(x.strip() for x in m.group(4).split(",") if x.strip() not in ("", "—"))
            out[m.group(1)] = Documented(m.group(1), m.group(2), m.group(3).strip(), labels)
    return out


def defined(
    registry: CollectorRegistry, objects: list[MetricWrapperBase]
) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Family name → (type, label names) of everything a registry exposes: the label names of the
    metric objects given (whose series may not exist yet), else those of the family's first sample."""
    labels = {m._name: tuple(m._labelnames) for m in objects}
    out = {}
    for family in registry.collect():
        names = labels.get(family.name)
        if names is None:
            names = tuple(k for k in family.samples[0].labels if k != "le") if family.samples else ()
        out[family.name] = (family.type, names)
    return out


def module_metrics(module: object) -> list[MetricWrapperBase]:
    return [v for v in vars(module).values() if isinstance(v, MetricWrapperBase)]


def test_every_metric_defined_is_documented_with_its_type_and_labels_and_vice_versa() -> None:
    docs = documented()
    worker = worker_metrics.WorkerMetrics("m", "v", "prefill", "127.0.0.1:1")
    worker.transfer_landed("p:1", 0.1, 10)  # a series of each labelled metric, so its labels show
    worker.transfer_failed("p:1")
    worker.request_ended("prefill", "ok")
    state = scheduler_metrics.ClusterStateCollector()
    state.state.redis_up = True
    state.state.workers[("m", "v", "prefill", "serving")] = 1
    state.state.pools["decode"] = scheduler_metrics.PoolLoad(running=1)
    state.state.waiting_for["decode"] = 1
    scheduler = CollectorRegistry(auto_describe=False)
    scheduler.register(rpc_metrics.Forward(scheduler_metrics.REGISTRY))
    scheduler.register(state)
    scaler = AutoscalerMetrics()
    scaler_objects = [
        scaler.desired,
        scaler.current,
        scaler.ready,
        scaler.decisions,
        scaler.scale_errors,
        scaler.signal,
    ]
    components = {
        "baton_gateway_": (defined(service_metrics.REGISTRY, module_metrics(service_metrics)), []),
        "baton_worker_": (defined(worker.registry, []), WORKER_IDENTITY),
        "baton_scheduler_": (defined(scheduler, module_metrics(scheduler_metrics)), []),
        "baton_autoscaler_": (defined(scaler.registry, scaler_objects), []),
    }
    for prefix, (families, identity) in components.items():
        docs_here = {d.family: d for d in docs.values() if d.name.startswith(prefix)}
        assert set(families) == set(docs_here), f"{prefix}: code and docs/METRICS.md differ"
        for name, (kind, labels) in families.items():
            doc = docs_here[name]
            assert kind == doc.type, f"{doc.name}: documented as a {doc.type}, defined as a {kind}"
            own = tuple(x for x in labels if x not in identity and x != "le")
            assert own == doc.labels, f"{doc.name}: documented labels {doc.labels}, defined {own}"
            if doc.type == "histogram":
                assert doc.unit in ("seconds", "ratio", "nats") and doc.name.endswith(
                    ("_seconds", "agreement", "_nats")
                )
            if doc.unit in ("seconds", "nats"):
                assert doc.name.endswith(f"_{doc.unit}"), doc.name
    worker_families = components["baton_worker_"][0]
    assert all(labels[:4] == tuple(WORKER_IDENTITY) for _, labels in worker_families.values())


def test_the_dashboard_queries_only_documented_metrics_and_shows_the_key_ones() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "baton-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"baton_\w+", e)}
    docs = documented()
    assert names <= set(docs), f"not in docs/METRICS.md: {sorted(names - set(docs))}"
    for key in (
        "baton_gateway_ttft_seconds",
        "baton_gateway_itl_seconds",
        "baton_gateway_e2e_seconds",
        "baton_gateway_requests_total",
        "baton_worker_kv_blocks_used",
        "baton_worker_prefix_cache_hits_total",
        "baton_worker_kv_transfer_bytes_total",
        "baton_scheduler_leases_active",
        "baton_scheduler_decision_seconds",
        "baton_gateway_generation_tokens_total",
        "baton_gateway_decode_seconds",
    ):
        assert key in names, f"the dashboard does not show {key}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["title"]
    for p in dashboard["panels"]:
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_a_bounded_label_keeps_the_first_values_and_folds_the_rest() -> None:
    label = rpc_metrics.BoundedLabel(2)
    assert [label(t) for t in ("a", "b", "c", "a", "", "d", "b")] == [
        "a",
        "b",
        "other",
        "a",
        "none",
        "other",
        "b",
    ]
    assert rpc_metrics.BoundedLabel(0)("a") == "other"


def test_the_stream_counts_how_long_ready_output_waited_for_the_client() -> None:
    async def main() -> tuple[float, float]:
        waits: list[float] = []
        fast = RequestStream("fast", 100, waits.append)
        slow = RequestStream("slow", 100, waits.append)
        done = Finished("stop", Usage(1, 3), Timings())

        async def produce(stream: RequestStream) -> None:
            for i in range(3):
                stream.push(Delta([i], "x"))
                await asyncio.sleep(0.01)
            stream.finish(done)

        async def read(stream: RequestStream, pause_s: float) -> None:
            async for _ in stream:
                await asyncio.sleep(pause_s)  # writing to a client that takes its time

        await asyncio.gather(produce(fast), read(fast, 0.0), produce(slow), read(slow, 0.05))
        assert len(waits) == 2
        return fast.client_wait_s, slow.client_wait_s

    fast, slow = asyncio.run(main())
    assert slow > 0.08  # each event after the first waited for the reader's previous write
    # A reader that is always waiting leaves only scheduling jitter (a few ms on a busy machine: relative).
    assert fast < slow / 4
