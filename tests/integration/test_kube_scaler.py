"""`KubernetesScaler` with the real ``kubernetes`` client over real HTTP, against the stand-in API server
of tests/fake_kube_apiserver.py: no kube-apiserver can run on this machine (none on PyPI, npm or apt, and
no Docker), so what a real cluster adds (admission, controllers creating pods, RBAC enforcement) stays
for an opt-in real-cluster check. The calls the scaler makes are checked against `rbac_rules` instead.

Asynchronous watch effects are awaited by bounded polling, never by fixed sleeps: CI runs on two busy
cores."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from fake_kube_apiserver import PATCH_TYPES, FakeKubeApiServer, Request
from harness import eventually
from kubernetes import client

from autoscaler.config import AutoscaleConfig
from autoscaler.kube import KubernetesScaler, new_api_client, rbac_rules
from autoscaler.scaling import PoolState, ScalerError

pytestmark = pytest.mark.integration

NS = "serving"
DECODE = "baton-decode"
LABELS = {"app.kubernetes.io/instance": "baton", "app.kubernetes.io/component": "decode"}
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/{DECODE}/scale"
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"
WAIT_S = 10.0  # the longest a watch's effect may take to show, on a loaded machine


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Path:
    return tmp_path / "kubeconfig"


@pytest.fixture
def apiserver(kubeconfig: Path) -> Iterator[FakeKubeApiServer]:
    """The stand-in with the decode pool's Deployment (1 replica), created through the real client."""
    with FakeKubeApiServer() as server:
        server.write_kubeconfig(kubeconfig, NS)
        api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        template = client.V1PodTemplateSpec(
            metadata=client.V1ObjectMeta(labels=LABELS),
            spec=client.V1PodSpec(containers=[client.V1Container(name="worker", image="baton")]),
        )
        spec = client.V1DeploymentSpec(
            replicas=1, selector=client.V1LabelSelector(match_labels=LABELS), template=template
        )
        body = client.V1Deployment(metadata=client.V1ObjectMeta(name=DECODE), spec=spec)
        client.AppsV1Api(api).create_namespaced_deployment(NS, body)
        api.close()
        server.clear_requests()
        yield server


@pytest.fixture
def make_scaler(apiserver: FakeKubeApiServer, kubeconfig: Path) -> Iterator[Callable[..., KubernetesScaler]]:
    """Builds scalers on the stand-in (the decode pool managed, 2 s request timeout); closes them after."""
    made: list[KubernetesScaler] = []

    def make(deployments: dict[str, str] | None = None, **options: Any) -> KubernetesScaler:
        options = {"request_timeout_s": 2.0} | options
        scaler = KubernetesScaler(
            new_api_client(str(kubeconfig)), NS, deployments or {"decode": DECODE}, **options
        )
        made.append(scaler)
        return scaler

    yield make
    for scaler in made:
        scaler.close()


def calls(server: FakeKubeApiServer, rbac: tuple[str, str, str] | None = None) -> list[Request]:
    """The requests made so far, only those with these RBAC attributes if given."""
    return [r for r in server.requests if rbac is None or r.rbac() == rbac]


GET_SCALE = ("apps", "deployments/scale", "get")
PATCH_SCALE = ("apps", "deployments/scale", "patch")
LIST_PODS = ("", "pods", "list")
WATCH_PODS = ("", "pods", "watch")


def test_scale_patches_the_scale_subresource_with_a_precondition(
    apiserver: FakeKubeApiServer,
    make_scaler: Callable[..., KubernetesScaler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    scaler = make_scaler()
    with caplog.at_level(logging.INFO, logger="autoscaler.kube"):
        scaler.scale("decode", 3)
    get, patch = apiserver.requests
    assert (get.method, get.path) == ("GET", SCALE_PATH)
    assert (patch.method, patch.path) == ("PATCH", SCALE_PATH)
    assert patch.content_type in PATCH_TYPES
    assert patch.body == {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 3}}
    assert apiserver.replicas(NS, DECODE) == 3
    assert "scale decode: 1 → 3 replicas" in caplog.text

    apiserver.clear_requests()
    scaler.scale("decode", 3)  # already there: a read, no write
    assert [r.rbac() for r in apiserver.requests] == [GET_SCALE]
    assert scaler.state("decode").desired == 3


def test_a_conflict_is_read_again_and_retried(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    apiserver.conflict_next_patches(1)
    make_scaler().scale("decode", 4)
    assert [r.rbac() for r in apiserver.requests] == [GET_SCALE, PATCH_SCALE, GET_SCALE, PATCH_SCALE]
    first, second = calls(apiserver, PATCH_SCALE)
    # the retry carries the resourceVersion it read after the conflict, not the stale one
    assert first.body["metadata"]["resourceVersion"] != second.body["metadata"]["resourceVersion"]
    assert apiserver.replicas(NS, DECODE) == 4


def test_conflicts_beyond_the_bound_are_a_scaler_error(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    apiserver.conflict_next_patches(3)
    with pytest.raises(ScalerError, match="409 Conflict"):
        make_scaler(max_conflict_retries=2).scale("decode", 4)
    assert len(calls(apiserver, PATCH_SCALE)) == 3
    assert apiserver.replicas(NS, DECODE) == 1


def test_a_missing_deployment_is_a_clear_scaler_error(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    scaler = make_scaler({"decode": "baton-decoder"})
    start = time.monotonic()
    for attempt in (lambda: scaler.scale("decode", 2), lambda: scaler.state("decode")):
        with pytest.raises(ScalerError) as error:
            attempt()
        message = str(error.value)
        assert f"deployment {NS}/baton-decoder not found (404)" in message
        assert "--decode-deployment" in message and "chart installed" in message
        assert isinstance(error.value.__cause__, client.ApiException)  # kept as the cause, for the log
    assert time.monotonic() - start < WAIT_S
    assert not calls(apiserver, PATCH_SCALE)


def test_an_unmanaged_pool_and_a_bad_replica_count_are_scaler_errors(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    scaler = make_scaler()
    with pytest.raises(ScalerError, match="prefill: not managed"):
        scaler.state("prefill")
    with pytest.raises(ScalerError, match="prefill: not managed"):
        scaler.scale("prefill", 1)
    with pytest.raises(ScalerError, match="422 .*must be >= 0"):  # the API server's validation, verbatim
        scaler.scale("decode", -1)
    assert apiserver.replicas(NS, DECODE) == 1


def test_a_refused_patch_is_a_scaler_error_that_names_the_role(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    apiserver.fail_next(403, match="PATCH ")
    with pytest.raises(
        ScalerError, match=f"refused \\(403 Forbidden\\).*Role grant patch on deployments/scale in {NS}"
    ):
        make_scaler().scale("decode", 2)
    assert apiserver.replicas(NS, DECODE) == 1


def test_pod_list_failures_back_off_and_retry(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    apiserver.add_pod(NS, "decode-a", LABELS, ready=True)
    apiserver.fail_next(403, match="/pods", times=1000)
    scaler = make_scaler(request_timeout_s=1.5)
    with pytest.raises(ScalerError, match="not listed within 1.5 s \\(403 Forbidden"):
        scaler.state("decode")  # the last failure, for whoever reads the error
    apiserver.clear_faults()
    eventually(
        lambda: state_or_none(scaler) == PoolState(desired=1, ready=1, pending=0),
        WAIT_S,
        "a list after the failures",
    )
    retries = len(calls(apiserver, LIST_PODS))
    assert 2 <= retries < 20  # retried with a growing pause, not in a tight loop


def state_or_none(scaler: KubernetesScaler) -> PoolState | None:
    try:
        return scaler.state("decode")
    except ScalerError:
        return None


def test_state_follows_the_pods(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    scaler = make_scaler()
    scaler.scale("decode", 3)

    def becomes(expected: PoolState, what: str) -> None:
        eventually(lambda: scaler.state("decode") == expected, WAIT_S, what)

    becomes(PoolState(desired=3, ready=0, pending=3), "three replicas asked for, no pods yet: all pending")
    apiserver.add_pod(NS, "decode-a", LABELS)
    apiserver.add_pod(NS, "decode-b", LABELS)
    apiserver.add_pod(NS, "prefill-a", LABELS | {"app.kubernetes.io/component": "prefill"})  # not selected
    becomes(PoolState(desired=3, ready=0, pending=3), "two pods starting and one not created")
    apiserver.set_pod_ready(NS, "decode-a")
    becomes(PoolState(desired=3, ready=1, pending=2), "one pod Ready")
    apiserver.add_pod(NS, "decode-c", LABELS, ready=True)
    apiserver.set_pod_ready(NS, "decode-b")
    becomes(PoolState(desired=3, ready=3, pending=0), "all Ready")
    apiserver.add_pod(NS, "decode-evicted", LABELS, phase="Failed")
    apiserver.terminate_pod(NS, "decode-c")
    becomes(PoolState(desired=3, ready=2, pending=1), "a terminating pod and a Failed one are not live")
    apiserver.delete_pod(NS, "decode-c")
    apiserver.set_pod_ready(NS, "decode-a", ready=False)
    becomes(PoolState(desired=3, ready=1, pending=2), "a pod gone, a pod no longer Ready")
    # the pods are those the scale's status.selector names, listed once and then only watched: state
    # costs one GET of the scale
    (listed,) = calls(apiserver, LIST_PODS)
    assert listed.path == PODS_PATH
    assert listed.query["labelSelector"] == ",".join(f"{k}={v}" for k, v in sorted(LABELS.items()))


def test_the_watch_resumes_after_a_timeout_and_relists_after_410(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    scaler = make_scaler(watch_timeout_s=1)
    apiserver.add_pod(NS, "decode-a", LABELS, ready=True)
    assert scaler.state("decode") == PoolState(desired=1, ready=1, pending=0)

    # A watch that ends after timeoutSeconds resumes from the last resourceVersion: no second list.
    eventually(
        lambda: len(calls(apiserver, WATCH_PODS)) >= 2, WAIT_S, "a second watch after the first timed out"
    )
    first, second = calls(apiserver, WATCH_PODS)[:2]
    assert first.query["timeoutSeconds"] == "1"
    assert second.query["resourceVersion"] == first.query["resourceVersion"]  # nothing happened in between
    assert len(calls(apiserver, LIST_PODS)) == 1

    apiserver.set_pod_ready(NS, "decode-a", ready=False)
    eventually(lambda: scaler.state("decode").ready == 0, WAIT_S, "a change after the resumed watch")

    # 410 Gone (an ERROR event, history compacted): the scaler lists again, then watches from there.
    apiserver.expire_watches()
    eventually(lambda: len(calls(apiserver, LIST_PODS)) == 2, WAIT_S, "a fresh list after 410 Gone")
    apiserver.set_pod_ready(NS, "decode-a")
    apiserver.add_pod(NS, "decode-b", LABELS)
    eventually(
        lambda: scaler.state("decode") == PoolState(desired=1, ready=1, pending=1),
        WAIT_S,
        "changes after the relist",
    )
    relisted = max(int(r.query.get("resourceVersion", 0)) for r in calls(apiserver, WATCH_PODS))
    assert relisted > int(first.query["resourceVersion"])


@pytest.mark.parametrize("actuate", [False, True])
def test_the_calls_made_are_those_the_role_grants(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler], actuate: bool
) -> None:
    scaler = make_scaler(actuate=actuate, watch_timeout_s=1)
    apiserver.add_pod(NS, "decode-a", LABELS)
    scaler.state("decode")
    if actuate:
        scaler.scale("decode", 2)
    else:
        with pytest.raises(ScalerError, match="read-only"):
            scaler.scale("decode", 2)
    apiserver.expire_watches()  # a relist, and resumed watches, are in the record too
    eventually(lambda: len(calls(apiserver, LIST_PODS)) == 2, WAIT_S, "the relist after 410")

    granted = {
        (group, resource, verb)
        for rule in rbac_rules(actuate)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    made = {r.rbac() for r in apiserver.requests}
    assert made <= granted
    assert (PATCH_SCALE in made) is actuate
    assert apiserver.replicas(NS, DECODE) == (2 if actuate else 1)


def test_a_hung_api_server_is_a_scaler_error_within_the_timeout(
    apiserver: FakeKubeApiServer, make_scaler: Callable[..., KubernetesScaler]
) -> None:
    scaler = make_scaler(request_timeout_s=1.0)
    for attempt in (lambda: scaler.scale("decode", 2), lambda: scaler.state("decode")):
        apiserver.hang_next(30.0, match="/scale")
        start = time.monotonic()
        with pytest.raises(ScalerError, match="no answer from the API server within 1.0 s"):
            attempt()
        assert time.monotonic() - start < 1.0 + 2.0  # one try of 1 s, not urllib3's four; slack for CI
    scaler.scale("decode", 2)  # the server answers again
    assert apiserver.replicas(NS, DECODE) == 2


def test_from_config_reads_the_kubeconfig_and_defaults_the_namespace(
    apiserver: FakeKubeApiServer, kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def from_config(**fields: Any) -> KubernetesScaler:
        config = AutoscaleConfig(
            scaler="kubernetes", kubeconfig=str(kubeconfig), decode_deployment=DECODE, **fields
        )
        scaler = KubernetesScaler.from_config(config)
        scaler.close()  # these checks make no API call
        return scaler

    pod_namespace = tmp_path / "namespace"
    monkeypatch.setattr("autoscaler.kube.SERVICE_ACCOUNT_NAMESPACE", pod_namespace)
    assert from_config().namespace == "default"  # not in a pod
    pod_namespace.write_text(NS + "\n")
    assert from_config().namespace == NS  # the pod's own
    assert from_config(namespace="elsewhere").namespace == "elsewhere"
    assert from_config(actuate=False).deployments == {"decode": DECODE}

    scaler = KubernetesScaler.from_config(
        AutoscaleConfig(
            scaler="kubernetes", kubeconfig=str(kubeconfig), decode_deployment=DECODE, actuate=False
        )
    )
    try:
        assert scaler.state("decode") == PoolState(desired=1, ready=0, pending=1)
        with pytest.raises(ScalerError, match="read-only"):
            scaler.scale("decode", 2)
    finally:
        scaler.close()


def test_close_stops_the_watch_threads_promptly(make_scaler: Callable[..., KubernetesScaler]) -> None:
    scaler = make_scaler(watch_timeout_s=60)
    before = set(threading.enumerate())
    scaler.state("decode")
    # (the others are the stand-in's request threads)
    (watcher,) = [t for t in set(threading.enumerate()) - before if t.name == "kube-pods-decode"]
    start = time.monotonic()
    scaler.close()
    assert time.monotonic() - start < 2.0 and not watcher.is_alive()  # not after the watch's 60 s
    with pytest.raises(ScalerError, match="closed"):
        scaler.state("decode")


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("app=baton", ["a", "b"]),
        ("app==baton,role!=prefill", ["a"]),
        ("role in (decode, prefill)", ["a", "b"]),
        ("role notin (decode)", ["b", "c"]),  # c has no role: notin and != match it, as on a real server
        ("spot", ["b"]),
        ("!spot", ["a", "c"]),
    ],
)
def test_the_stand_in_selects_pods_as_the_api_server_does(
    apiserver: FakeKubeApiServer, kubeconfig: Path, selector: str, names: list[str]
) -> None:
    apiserver.add_pod(NS, "a", {"app": "baton", "role": "decode"})
    apiserver.add_pod(NS, "b", {"app": "baton", "role": "prefill", "spot": "true"})
    apiserver.add_pod(NS, "c", {"app": "other"})
    with kubernetes.config.new_client_from_config(config_file=str(kubeconfig)) as api:
        pods = client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=selector)
    assert [pod.metadata.name for pod in pods.items if pod.metadata] == names


def test_baton_autoscale_scales_the_decode_deployment_from_the_clusters_metrics(
    apiserver: FakeKubeApiServer, kubeconfig: Path, tmp_path: Path
) -> None:
    """The whole control loop as the chart runs it: `baton autoscale --scaler kubernetes` (a real
    process) reads a gateway's and a scheduler's /metrics — here small HTTP servers whose pages are
    rendered by the real metric objects, the gateway's inter-token gaps at 80 ms — and patches the
    decode Deployment (1 → 3: 80 ms on one replica wants ~3 for a 30 ms target) on the stand-in API
    server, exporting the decision. The prefill pool has no Deployment: an error it logs, not a crash."""
    import signal
    import subprocess
    import sys
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from scheduler import metrics as scheduler_metrics
    from services.gateway.metrics import ITL_BUCKETS
    from services.supervisor import free_port

    apiserver.add_pod(NS, "decode-0", LABELS, ready=True)
    gateway = CollectorRegistry()
    itl = Histogram(
        "baton_gateway_itl_seconds", "", ["model", "version"], buckets=ITL_BUCKETS, registry=gateway
    )
    cluster = scheduler_metrics.ClusterStateCollector()
    cluster.state.redis_up = True
    cluster.state.workers[("m", "v", "decode", "serving")] = 1
    cluster.state.pools["decode"] = scheduler_metrics.PoolLoad(running=16, kv_blocks=1000, kv_blocks_free=800)
    scheduler = CollectorRegistry(auto_describe=False)
    scheduler.register(cluster)

    class Pages(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/gateway":
                for _ in range(50):  # new gaps at every scrape: the window's p95 is 80 ms
                    itl.labels("m", "v").observe(0.08)
            body = generate_latest(gateway if self.path == "/gateway" else scheduler)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

    pages = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    port = pages.server_address[1]
    metrics_port = free_port()
    log_path = tmp_path / "autoscale.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "-v", "autoscale", "--scaler", "kubernetes"]
            + ["--kubeconfig", str(kubeconfig), "--namespace", NS, "--decode-deployment", DECODE]
            + ["--gateway-metrics", f"http://127.0.0.1:{port}/gateway"]
            + ["--scheduler-metrics", f"http://127.0.0.1:{port}/scheduler"]
            + ["--interval-s", "0.5", "--window-s", "5", "--scale-up-window-s", "0", "--itl-slo-ms", "30"]
            + ["--metrics-port", str(metrics_port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        eventually(lambda: apiserver.replicas(NS, DECODE) == 3, 30, "the decode Deployment scaled to 3")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            exported = r.read().decode()
        assert 'baton_autoscaler_desired_replicas{pool="decode"} 3.0' in exported
        assert 'reason="itl_slo"' in exported
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
        pages.shutdown()
    text = log_path.read_text()
    assert code == 0, text
    assert "decode 1 -> 3 (itl_slo" in text and "cannot read the prefill pool" in text
    assert {r.rbac() for r in apiserver.requests} <= {GET_SCALE, PATCH_SCALE, LIST_PODS, WATCH_PODS}
