"""The Helm chart (deploy/helm/baton), offline: `helm lint --strict` and `helm template` of every values
file in its ci/ folder, for the oldest and a recent Kubernetes, then checks of what comes out.

* Every built-in object is validated strictly against that Kubernetes version's OpenAPI schema
  (`kubernetes_validate`, which knows no CRDs). The ServiceMonitor and the KEDA ScaledObject are validated
  with `jsonschema` against tests/unit/chart_data/*.schema.json: hand-written subsets of the two CRDs'
  openAPIV3Schema (the fields the chart renders, with their real types and required keys, closed where
  the CRD is), written from the Prometheus Operator's and KEDA's definitions because this machine
  cannot download them. They prove the shape we render, not that a given operator version accepts it.
* values.schema.json turns bad values away with the offending key named.
* Structure: GPUs, replicas under autoscaling, selectors, probes, secrets never inlined, the autoscaler's
  RBAC equal to `autoscaler.kube.rbac_rules`, the drain's grace periods, toggles, name lengths, the
  NetworkPolicies and the ServiceMonitor's reach; and every Baton container's args parse with the real
  `baton` parsers into a valid config.

What this cannot prove (docs/DEPLOY.md says more): no API server admits the objects, no defaulting or
admission webhook runs, nothing is scheduled, no controller reconciles. helm comes from `make tools`
(.tools/bin/helm, or $BATON_HELM); without it these tests fail, they never skip.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from autoscaler.config import AutoscaleConfig
from autoscaler.kube import rbac_rules
from rpc.flags import add_flags, config_from_args

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "baton"
DATA = Path(__file__).resolve().parent / "chart_data"
CI_FILES = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
KUBE_VERSIONS = ("1.29.0", "1.33.0")
CRD_API_VERSIONS = ("monitoring.coreos.com/v1", "keda.sh/v1alpha1")
RELEASE, NAMESPACE = "rel", "inference"
POOLS = ("prefill", "decode")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.schema.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.schema.json",
}
Doc = dict[str, Any]


def helm_binary() -> Path:
    helm = Path(os.environ.get("BATON_HELM") or ROOT / ".tools" / "bin" / "helm")
    if not (helm.is_file() and os.access(helm, os.X_OK)):
        pytest.fail(f"helm not found at {helm}: run `make tools` (deploy/helm/install-tools.sh .tools)")
    return helm


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=60)


@cache
def render(
    files: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    kube: str = "1.33.0",
    api_versions: tuple[str, ...] = CRD_API_VERSIONS,
    release: str = RELEASE,
) -> tuple[Doc, ...]:
    """The objects `helm template` renders (cached: the same render serves every test that asks)."""
    args = ["template", release, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube]
    for f in files:
        args += ["-f", str(CHART / "ci" / f)]
    for s in sets:
        args += ["--set", s]
    for api in api_versions:
        args += ["--api-versions", api]
    out = helm(*args)
    assert out.returncode == 0, f"helm {' '.join(args)} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(docs: tuple[Doc, ...], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(doc: Doc) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


def deployments(docs: tuple[Doc, ...]) -> dict[str, Doc]:
    """The Deployments by component (gateway, scheduler, prefill, decode, redis, autoscaler)."""
    return {component(d): d for d in docs if d["kind"] == "Deployment"}


def pod_spec(deployment: Doc) -> Doc:
    spec: Doc = deployment["spec"]["template"]["spec"]
    return spec


def baton_containers(docs: tuple[Doc, ...]) -> Iterator[tuple[str, Doc]]:
    for comp, dep in deployments(docs).items():
        for c in pod_spec(dep)["containers"]:
            if c.get("command") == ["baton"]:
                yield comp, c


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def arg(container: Doc, flag: str) -> str | None:
    for a in container["args"]:
        if a.startswith(f"{flag}="):
            return str(a.split("=", 1)[1])
    return None


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------------------------
# lint, schema validation of everything rendered


@pytest.mark.parametrize("values", [None, *CI_FILES])
def test_helm_lint_strict(values: str | None) -> None:
    assert set(CI_FILES) >= {f"{n}-values.yaml" for n in ("minimal", "full", "hpa", "keda", "no-gpu", "rdma")}
    args = ["lint", "--strict", str(CHART)] + (["-f", str(CHART / "ci" / values)] if values else [])
    out = helm(*args)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", CI_FILES)
def test_every_rendered_object_is_valid(values: str, kube: str) -> None:
    docs = render((values,), kube=kube)
    assert docs
    for doc in docs:
        where = f"{values} on {kube}: {doc['kind']} {doc['metadata']['name']}"
        crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if crd:
            schema = json.loads((DATA / crd).read_text())
            errors = list(jsonschema.Draft7Validator(schema).iter_errors(doc))
            assert not errors, f"{where}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
        else:
            try:
                kubernetes_validate.validate(doc, kube, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where}: {e}")


def test_values_file_is_documented_and_valid() -> None:
    """values.yaml meets its own schema, and every key has a comment above it (a "# --" comment on a key
    also covers the keys nested in it, e.g. a probe's timings)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))
    undocumented, comment, parents = [], [], []  # parents: (indent, whether its comment covers children)
    for number, line in enumerate((CHART / "values.yaml").read_text().splitlines(), 1):
        if line.strip().startswith("#"):
            comment.append(line.strip())
            continue
        key = re.match(r"^( *)[A-Za-z0-9_./-]+:", line)
        if key:
            indent = len(key[1])
            parents = [p for p in parents if p[0] < indent]
            covered = any(c for _, c in parents)
            if not (comment or covered):
                undocumented.append(f"{number}: {line.strip()}")
            parents.append((indent, covered or bool(comment and comment[0].startswith("# --"))))
        comment = []
    assert not undocumented, "keys without a comment in values.yaml: " + ", ".join(undocumented)


def test_crd_schemas_catch_what_the_crds_reject() -> None:
    """The vendored CRD subsets are not vacuous: a typo and an unquoted KEDA threshold fail."""
    docs = render(("keda-values.yaml",))
    so = next(d for d in docs if d["kind"] == "ScaledObject")
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    so_schema = json.loads((DATA / "scaledobject.schema.json").read_text())
    sm_schema = json.loads((DATA / "servicemonitor.schema.json").read_text())
    bad_so = json.loads(json.dumps(so))
    bad_so["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    bad_sm = json.loads(json.dumps(sm))
    bad_sm["spec"]["endpoints"][0]["intervall"] = "15s"
    assert not jsonschema.Draft7Validator(so_schema).is_valid(bad_so)
    assert not jsonschema.Draft7Validator(sm_schema).is_valid(bad_sm)


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["decode.gpus=two"], "/decode/gpus"),
        (["autoscaling.mode=sometimes"], "/autoscaling/mode"),
        (["scheduler.replicas=0"], "/scheduler/replicas"),
        (["replicaz=3"], "replicaz"),
        (["prefill.port=70000"], "/prefill/port"),
        (["gateway.terminationMarginSeconds=1"], "/gateway/terminationMarginSeconds"),
        (["prefill.gpuResourceName=Nvidia GPU"], "/prefill/gpuResourceName"),
        (["model.volume.type=hostPath"], "/model/volume/type"),
        (["autoscaler.policy.kvHigh=1.5"], "/autoscaler/policy/kvHigh"),
        (["decode.extraResources.rdma/ib=lots"], "/decode/extraResources"),
        (["decode.enabled=false"], "decode.enabled"),
        (["model.fetch.enabled=false"], "model.volume.type=emptyDir"),
        (["model.subdir="], "model.subdir"),
        (["redis.mode=external"], "redis.external.existingSecret"),
        (["autoscaler.policy.minDecode=9"], "minDecode"),
        (["model.volume.type=pvc", "model.volume.accessModes={ReadOnlyMany}"], "accessModes"),
        (["prefill.hostNetwork=true", "decode.hostNetwork=true"], "hostNetwork"),
    ],
)
def test_bad_values_are_refused_with_the_key_named(sets: list[str], named: str) -> None:
    args = ["template", RELEASE, str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode != 0, f"{sets} rendered"
    assert named in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------------------------
# the pools: GPUs, replicas, RDMA


@pytest.mark.parametrize("values", CI_FILES)
def test_gpu_limit_is_a_quoted_count_of_the_pools_resource(values: str) -> None:
    docs = render((values,))
    chosen = yaml.safe_load((CHART / "ci" / values).read_text()) or {}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for pool in POOLS:
        want = {**defaults[pool], **chosen.get(pool, {})}
        resources = pod_spec(deployments(docs)[pool])["containers"][0]["resources"]
        gpu_keys = {k for k in resources.get("limits", {}) if k.endswith("gpu") or "/mig-" in k}
        if want["gpus"] == 0:
            assert not gpu_keys, f"{values} {pool}: a GPU resource with gpus 0"
            continue
        assert gpu_keys == {want["gpuResourceName"]}, f"{values} {pool}: {gpu_keys}"
        count = resources["limits"][want["gpuResourceName"]]
        assert isinstance(count, str) and count == str(want["gpus"]), f"{values} {pool}: {count!r}"
        for name, quantity in want["extraResources"].items():
            assert resources["requests"][name] == resources["limits"][name] == str(quantity)


def test_full_values_use_the_overridden_gpu_resource_name() -> None:
    limits = pod_spec(deployments(render(("full-values.yaml",)))["decode"])["containers"][0]["resources"][
        "limits"
    ]
    assert limits["nvidia.com/mig-3g.40gb"] == "1" and "nvidia.com/gpu" not in limits


@pytest.mark.parametrize(
    ("values", "mode"),
    [
        ("minimal-values.yaml", "none"),
        ("full-values.yaml", "baton"),
        ("hpa-values.yaml", "hpa"),
        ("keda-values.yaml", "keda"),
    ],
)
def test_only_an_unscaled_pool_renders_its_replicas(values: str, mode: str) -> None:
    deps = deployments(render((values,)))
    for pool in POOLS:
        assert ("replicas" in deps[pool]["spec"]) == (mode == "none"), f"{mode}: {pool}"
    assert deps["gateway"]["spec"]["replicas"] >= 1 and deps["scheduler"]["spec"]["replicas"] >= 1
    if mode == "none":
        deps = deployments(render((values,), ("prefill.replicas=3", "decode.replicas=5")))
        assert (deps["prefill"]["spec"]["replicas"], deps["decode"]["spec"]["replicas"]) == (3, 5)


def test_rdma_values_pin_memory_share_shm_and_keep_dns() -> None:
    deps = deployments(render(("rdma-values.yaml",)))
    for pool in POOLS:
        spec = pod_spec(deps[pool])
        worker = spec["containers"][0]
        assert "IPC_LOCK" in worker["securityContext"]["capabilities"]["add"]
        assert worker["resources"]["limits"]["rdma/ib"] == worker["resources"]["requests"]["rdma/ib"] == "1"
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
        assert {"name": "shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
        assert env_of(worker)["UCX_TLS"]["value"]
    assert pod_spec(deps["decode"])["hostNetwork"] is True
    assert pod_spec(deps["decode"])["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert deps["prefill"]["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
    assert pod_spec(deps["prefill"])["hostIPC"] is True
    # A pool's podSecurityContext replaces the release's keys, falsy values included.
    assert pod_spec(deps["prefill"])["securityContext"]["runAsUser"] == 0
    assert pod_spec(deps["prefill"])["securityContext"]["runAsNonRoot"] is False
    assert pod_spec(deps["decode"])["securityContext"]["runAsUser"] == 10001
    minimal = pod_spec(deployments(render(("minimal-values.yaml",)))["decode"])["containers"][0]
    assert "add" not in minimal["securityContext"]["capabilities"]


def test_without_a_prefill_pool_decode_workers_prefill_too() -> None:
    docs = render(sets=("prefill.enabled=false", "autoscaling.mode=keda"))
    assert not [d for d in docs if d["kind"] != "ServiceAccount" and component(d) == "prefill"]
    assert arg(pod_spec(deployments(docs)["decode"])["containers"][0], "--role") == "both"
    autoscaler = pod_spec(deployments(docs)["autoscaler"])["containers"][0]
    assert arg(autoscaler, "--prefill-deployment") is None
    assert [component(d) for d in docs if d["kind"] == "ScaledObject"] == ["decode"]


# ---------------------------------------------------------------------------------------------------------
# every Baton container: args, probes, drain, secrets


def baton_parser() -> argparse.ArgumentParser:
    from scheduler.server import add_scheduler_parser
    from services.gateway.server import add_gateway_parser
    from services.worker.config import add_worker_parser

    parser = argparse.ArgumentParser(prog="baton", exit_on_error=False)
    sub = parser.add_subparsers(dest="command", required=True)
    add_worker_parser(sub)
    add_gateway_parser(sub)
    add_scheduler_parser(sub)
    # `baton autoscale`'s flags are exactly AutoscaleConfig's (autoscaler/config.py).
    add_flags(sub.add_parser("autoscale"), AutoscaleConfig)
    for command in sub.choices.values():
        command.allow_abbrev = False  # a misspelt flag that happens to be a prefix must not pass
    return parser


@pytest.mark.parametrize("values", CI_FILES)
def test_baton_args_parse_into_valid_configs(values: str) -> None:
    """Every flag the chart passes exists, has a valid value, and the process's config accepts it."""
    from scheduler.config import SchedulerProcessConfig
    from services.gateway.server import GatewayConfig
    from services.worker.config import WorkerConfig

    configs: dict[str, type[Any]] = {
        "worker": WorkerConfig,
        "gateway": GatewayConfig,
        "scheduler": SchedulerProcessConfig,
        "autoscale": AutoscaleConfig,
    }
    parser = baton_parser()
    for comp, container in baton_containers(render((values,))):
        sub = container["args"][0]
        try:
            args = parser.parse_args(container["args"])
            config_from_args(configs[sub], args)
        except (SystemExit, argparse.ArgumentError, ValueError) as e:
            pytest.fail(f"{values} {comp}: {container['args']}: {e!r}")


@pytest.mark.parametrize("values", CI_FILES)
def test_probes_on_every_baton_container_and_liveness_never_asks_health(values: str) -> None:
    containers = list(baton_containers(render((values,))))
    assert {c for c, _ in containers} >= {"gateway", "scheduler", "decode"}
    for comp, c in containers:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, f"{values} {comp}: no {probe}"
        # A draining process is NOT_SERVING: a liveness probe on health would restart it mid-drain.
        assert set(c["livenessProbe"]) & {"grpc", "httpGet", "exec"} == set(), f"{comp}: {c['livenessProbe']}"
        assert "tcpSocket" in c["livenessProbe"]
        if comp != "autoscaler":
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
            for probe in (c["readinessProbe"], c["startupProbe"]):
                if "exec" in probe:  # mutual TLS: the kubelet's gRPC probe shows no certificate
                    command = probe["exec"]["command"]
                    assert command[:3] == ["baton", "health", f"127.0.0.1:{port}"], command
                    assert "--tls-dir=/etc/baton/tls" in command and arg(c, "--tls-dir") == "/etc/baton/tls"
                else:
                    assert probe["grpc"]["port"] == port and arg(c, "--tls-dir") is None
        startup = c["startupProbe"]
        if comp in POOLS:
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "too short for a model load"
        if comp == "gateway":  # it waits for a worker as long as its startup probe waits for it
            assert (
                float(arg(c, "--startup-timeout") or 0)
                == startup["periodSeconds"] * startup["failureThreshold"]
            )


def pre_stop_seconds(container: Doc) -> int:
    hook = container.get("lifecycle", {}).get("preStop")
    if not hook:
        return 0
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", CI_FILES)
def test_grace_period_covers_prestop_and_drain(values: str, kube: str) -> None:
    deps = deployments(render((values,), kube=kube))
    for comp in ("gateway", *POOLS):
        c = pod_spec(deps[comp])["containers"][0]
        drain = arg(c, "--drain-timeout-s")
        assert drain is not None, f"{comp}: no --drain-timeout-s"
        grace = pod_spec(deps[comp])["terminationGracePeriodSeconds"]
        assert grace > pre_stop_seconds(c) + float(drain) + 2, f"{values} {comp}: {grace}"
    gateway = pod_spec(deps["gateway"])["containers"][0]
    assert pre_stop_seconds(gateway) > 0, "the gateway must outwait endpoint propagation"
    hook = gateway["lifecycle"]["preStop"]
    assert ("sleep" in hook) == (kube >= "1.30"), "the kubelet's sleep action is on by default from 1.30"


def test_grace_period_follows_the_values() -> None:
    sets = (
        "gateway.preStopSleepSeconds=7",
        "gateway.drainTimeoutSeconds=40",
        "decode.drainTimeoutSeconds=90",
    )
    deps = deployments(render(sets=sets))
    assert pod_spec(deps["gateway"])["terminationGracePeriodSeconds"] == 7 + 40 + 10
    assert pod_spec(deps["decode"])["terminationGracePeriodSeconds"] == 90 + 10
    assert arg(pod_spec(deps["decode"])["containers"][0], "--drain-timeout-s") == "90"


@pytest.mark.parametrize("values", CI_FILES)
def test_workers_advertise_their_pod_ip(values: str) -> None:
    deps = deployments(render((values,)))
    for pool in POOLS:
        worker = pod_spec(deps[pool])["containers"][0]
        assert arg(worker, "--advertise-host") == "$(POD_IP)"
        assert arg(worker, "--host") == "0.0.0.0"
        assert env_of(worker)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert arg(worker, "--role") == pool


def secret_ref(env: Doc) -> tuple[str, str]:
    ref = env["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


@pytest.mark.parametrize(
    ("sets", "url_ref"),
    [
        (("redis.bundled.auth.password=S3cretRedisPassw0rd",), ("rel-baton-redis", "redis-url")),
        (
            ("redis.mode=external", "redis.external.existingSecret=ext", "redis.external.urlKey=u"),
            ("ext", "u"),
        ),
        (("redis.bundled.auth.existingSecret=mine", "redis.bundled.auth.existingSecretPasswordKey=pw"), None),
    ],
)
def test_redis_url_and_hf_token_come_from_secrets_only(
    sets: tuple[str, ...], url_ref: tuple[str, str] | None
) -> None:
    token_sets = ("model.fetch.hfTokenSecret.name=hf", "model.fetch.hfTokenSecret.key=tok")
    docs = render(sets=sets + token_sets)
    for comp in ("scheduler", *POOLS):
        c = pod_spec(deployments(docs)[comp])["containers"][0]
        assert arg(c, "--redis-url") == "$(BATON_REDIS_URL)"
        env = env_of(c)
        if url_ref:
            assert secret_ref(env["BATON_REDIS_URL"]) == url_ref
        else:  # the URL is composed in the pod from the password Secret, declared before it
            assert secret_ref(env["BATON_REDIS_PASSWORD"]) == ("mine", "pw")
            assert "$(BATON_REDIS_PASSWORD)" in env["BATON_REDIS_URL"]["value"]
            names = [e["name"] for e in c["env"]]
            assert names.index("BATON_REDIS_PASSWORD") < names.index("BATON_REDIS_URL")
    for comp, dep in deployments(docs).items():
        if comp not in ("gateway", *POOLS):  # the pods that read the model
            assert "initContainers" not in pod_spec(dep), comp
            continue
        fetch = pod_spec(dep)["initContainers"][0]
        assert secret_ref(env_of(fetch)["HF_TOKEN"]) == ("hf", "tok")
        assert "HF_TOKEN" not in env_of(pod_spec(dep)["containers"][0])
    if sets[0].startswith("redis.bundled.auth.password"):
        for doc in docs:
            if doc["kind"] != "Secret":
                assert "S3cretRedisPassw0rd" not in json.dumps(doc), f"password inlined in {doc['kind']}"
        (secret,) = objects(docs, "Secret").values()
        assert "stringData" not in secret and set(secret["data"]) == {"redis-password", "redis-url"}
    if "redis.mode=external" in sets:
        assert not [d for d in docs if d["kind"] != "ServiceAccount" and component(d) == "redis"]


# ---------------------------------------------------------------------------------------------------------
# selectors, names, services


@pytest.mark.parametrize("values", CI_FILES)
def test_selectors_are_stable_and_match_their_pods(values: str) -> None:
    docs = render((values,))
    pods = {comp: dep["spec"]["template"]["metadata"]["labels"] for comp, dep in deployments(docs).items()}
    for comp, dep in deployments(docs).items():
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector == {
            "app.kubernetes.io/name": "baton" if values != "full-values.yaml" else "llm",
            "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": comp,
        }
        assert matches(selector, pods[comp])
        assert "helm.sh/chart" in dep["metadata"]["labels"]
        assert "helm.sh/chart" not in pods[comp], "a chart bump would restart every pod"
    selectors = [(d, d["spec"]["selector"]) for d in docs if d["kind"] == "Service"]
    selectors += [
        (d, d["spec"]["selector"]["matchLabels"]) for d in docs if d["kind"] == "PodDisruptionBudget"
    ]
    selectors += [(d, d["spec"]["podSelector"]["matchLabels"]) for d in docs if d["kind"] == "NetworkPolicy"]
    for doc, selector in selectors:
        selected = [comp for comp, labels in pods.items() if matches(selector, labels)]
        assert selected == [component(doc)], f"{doc['kind']} {doc['metadata']['name']} selects {selected}"
    scaled = {d["spec"]["scaleTargetRef"]["name"] for d in docs if "scaleTargetRef" in d.get("spec", {})}
    assert scaled <= set(objects(docs, "Deployment"))


LONG_RELEASE = "a-very-long-release-name-for-the-inference-cluster-xy"  # 53: helm's own limit


@pytest.mark.parametrize(
    ("values", "sets"),
    [
        ("full-values.yaml", ()),
        ("keda-values.yaml", ()),
        ("hpa-values.yaml", ("fullnameOverride=" + "f" * 63,)),
    ],
)
def test_every_name_fits_a_dns_label_even_with_a_long_release(values: str, sets: tuple[str, ...]) -> None:
    assert len(LONG_RELEASE) == 53
    docs = render((values,), sets, release=LONG_RELEASE)
    assert len({(d["kind"], d["metadata"]["name"]) for d in docs}) == len(docs), "two objects share a name"
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
        for value in doc["metadata"].get("labels", {}).values():
            assert len(value) <= 63, value
    # Cut names still point at each other.
    deps = deployments(docs)
    autoscaler = pod_spec(deps["autoscaler"])["containers"][0]
    assert arg(autoscaler, "--decode-deployment") == deps["decode"]["metadata"]["name"]
    scheduler = arg(pod_spec(deps["decode"])["containers"][0], "--scheduler") or ""
    assert scheduler.split(":")[0] in objects(docs, "Service")


@pytest.mark.parametrize("values", CI_FILES)
def test_gateway_services_and_worker_discovery(values: str) -> None:
    docs = render((values,))
    services = objects(docs, "Service")
    gateway = services["rel-llm-gateway" if values == "full-values.yaml" else "rel-baton-gateway"]
    assert {p["name"] for p in gateway["spec"]["ports"]} == {"http", "grpc"}
    headless = next(s for s in services.values() if s["metadata"]["name"].endswith("-gateway-headless"))
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    for pool in POOLS:
        svc = next(s for s in services.values() if component(s) == pool)
        assert svc["spec"]["clusterIP"] == "None"
        assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "metrics"}


# ---------------------------------------------------------------------------------------------------------
# autoscaling


@pytest.mark.parametrize(
    ("values", "actuate"),
    [
        ("full-values.yaml", True),
        ("hpa-values.yaml", False),
        ("keda-values.yaml", False),
        ("minimal-values.yaml", None),
    ],
)
def test_autoscaler_role_is_exactly_what_the_scaler_calls(values: str, actuate: bool | None) -> None:
    docs = render((values,))
    roles, bindings = objects(docs, "Role"), objects(docs, "RoleBinding")
    if actuate is None:
        assert not roles and not bindings and "autoscaler" not in deployments(docs)
        return
    (role,) = roles.values()
    (binding,) = bindings.values()
    assert role["rules"] == rbac_rules(actuate)
    assert objects(docs, "ClusterRole") == {} and objects(docs, "ClusterRoleBinding") == {}
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    spec = pod_spec(deployments(docs)["autoscaler"])
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert spec["automountServiceAccountToken"] is True
    for comp, dep in deployments(docs).items():
        if comp != "autoscaler":
            assert pod_spec(dep)["automountServiceAccountToken"] is False, comp
    c = spec["containers"][0]
    assert ("--actuate" if actuate else "--no-actuate") in c["args"]
    assert arg(c, "--scaler") == "kubernetes" and arg(c, "--namespace") == NAMESPACE
    deps = deployments(docs)
    assert arg(c, "--prefill-deployment") == deps["prefill"]["metadata"]["name"]
    assert arg(c, "--decode-deployment") == deps["decode"]["metadata"]["name"]
    # The scrape URLs name this release's Services and ports.
    services = objects(docs, "Service")
    host, port = metrics_url(arg(c, "--gateway-metrics"))
    assert services[host]["spec"]["clusterIP"] == "None" and component(services[host]) == "gateway"
    gateway_ports = pod_spec(deps["gateway"])["containers"][0]["ports"]
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in gateway_ports  # no key there
    host, port = metrics_url(arg(c, "--scheduler-metrics"))
    assert component(services[host]) == "scheduler"
    assert {"name": "metrics", "port": port, "targetPort": "metrics", "protocol": "TCP"} in services[host][
        "spec"
    ]["ports"]
    assert arg(c, "--metrics-port") == str(
        next(p["port"] for p in services[role["metadata"]["name"]]["spec"]["ports"] if p["name"] == "metrics")
    )


def metrics_url(url: str | None) -> tuple[str, int]:
    found = re.fullmatch(r"http://([^:/]+):(\d+)/metrics", url or "")
    assert found, url
    return found[1], int(found[2])


def test_hpa_follows_the_desired_replicas_metric() -> None:
    docs = render(("hpa-values.yaml",))
    hpas = {component(h): h["spec"] for h in docs if h["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == set(POOLS)
    # minPrefill 0 in the values: an HPA cannot go below 1.
    assert (hpas["prefill"]["minReplicas"], hpas["prefill"]["maxReplicas"]) == (1, 6)
    assert (hpas["decode"]["minReplicas"], hpas["decode"]["maxReplicas"]) == (2, 12)
    for pool, spec in hpas.items():
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "baton_autoscaler_desired_replicas"
        assert metric["external"]["metric"]["selector"]["matchLabels"]["pool"] == pool
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


def test_keda_scaled_objects_query_the_desired_replicas() -> None:
    docs = render(("keda-values.yaml",))
    scaled = {component(d): d["spec"] for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == set(POOLS) and not objects(docs, "HorizontalPodAutoscaler")
    assert (scaled["prefill"]["minReplicaCount"], scaled["prefill"]["maxReplicaCount"]) == (0, 4)
    for pool, spec in scaled.items():
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert meta["threshold"] == "1" and meta["ignoreNullValues"] == "false"
        assert meta["serverAddress"] == "http://prometheus.monitoring.svc:9090"
        assert f'pool="{pool}"' in meta["query"] and f'namespace="{NAMESPACE}"' in meta["query"]
        assert meta["query"].startswith("max(baton_autoscaler_desired_replicas{")
        assert trigger["authenticationRef"] == {"name": "prometheus-auth"}
        assert spec["fallback"] == {"failureThreshold": 3, "replicas": 2}


# ---------------------------------------------------------------------------------------------------------
# monitoring, network policy, model, toggles


def test_service_monitor_scrapes_every_metrics_port_once() -> None:
    docs = render(("full-values.yaml",))
    (sm,) = objects(docs, "ServiceMonitor").values()
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    scraped = {
        component(s)
        for s in objects(docs, "Service").values()
        if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        and "metrics" in {p["name"] for p in s["spec"]["ports"]}
    }
    assert scraped == {"gateway", "scheduler", "prefill", "decode", "autoscaler"}
    gateways = [s for s in objects(docs, "Service").values() if component(s) == "gateway"]
    assert sum("metrics" in {p["name"] for p in s["spec"]["ports"]} for s in gateways) == 1


def test_service_monitor_needs_the_crd() -> None:
    assert not objects(render(("full-values.yaml",), api_versions=()), "ServiceMonitor")
    assert not objects(render(("full-values.yaml",), ("serviceMonitor.enabled=false",)), "ServiceMonitor")


def peers_of(rule: Doc) -> set[str]:
    """The components a rule's `from` names ("workers" for the worker pools, "prometheus", "*" for all)."""
    if "from" not in rule:
        return {"*"}
    found = set()
    for peer in rule["from"]:
        pod = peer.get("podSelector", {})
        if "namespaceSelector" in peer:
            found.add("prometheus")
        elif pod.get("matchExpressions"):
            assert pod["matchExpressions"][0]["values"] == ["prefill", "decode"]
            found.add("workers")
        else:
            found.add(pod.get("matchLabels", {}).get("app.kubernetes.io/component", "?"))
    return found


def rule_ports(rule: Doc) -> set[Any]:
    return {p["port"] for p in rule.get("ports", [])} or {"*"}


def test_network_policies_limit_who_reaches_what() -> None:
    docs = render(("minimal-values.yaml",), ("autoscaling.mode=baton",))
    policies = {component(p): p["spec"] for p in objects(docs, "NetworkPolicy").values()}
    assert set(policies) == {"gateway", "scheduler", "prefill", "decode", "redis", "autoscaler"}
    reach = {
        comp: {frozenset(peers_of(r)): rule_ports(r) for r in spec["ingress"]}
        for comp, spec in policies.items()
    }
    for pool in POOLS:
        assert reach[pool] == {
            frozenset({"gateway", "scheduler"}): {"grpc"},
            frozenset({"workers"}): {"*"},
            frozenset({"prometheus"}): {"metrics"},
        }
    assert reach["redis"] == {frozenset({"scheduler", "workers"}): {"redis"}}
    assert reach["scheduler"][frozenset({"gateway", "workers"})] == {"grpc"}
    assert reach["scheduler"][frozenset({"prometheus", "autoscaler"})] == {"metrics"}
    assert reach["gateway"] == {
        frozenset({"*"}): {"http", "grpc"},
        frozenset({"prometheus", "autoscaler"}): {"metrics"},  # the port without a key: scrapes only
    }
    assert reach["autoscaler"] == {frozenset({"prometheus"}): {"metrics"}}
    # Restricted, the gateway still answers the scrapes.
    full = {component(p): p["spec"] for p in objects(render(("full-values.yaml",)), "NetworkPolicy").values()}
    rules = {frozenset(peers_of(r)): rule_ports(r) for r in full["gateway"]["ingress"]}
    assert rules[frozenset({"prometheus", "autoscaler"})] == {"metrics"}
    assert not objects(render(("minimal-values.yaml",), ("networkPolicy.enabled=false",)), "NetworkPolicy")


def test_model_is_fetched_once_into_the_volume_and_read_only_after() -> None:
    docs = render(("full-values.yaml",))
    (pvc,) = [d for d in objects(docs, "PersistentVolumeClaim").values() if component(d) == "model"]
    assert (
        pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        and pvc["spec"]["resources"]["requests"]["storage"] == "200Gi"
    )
    for comp in ("gateway", *POOLS):
        spec = pod_spec(deployments(docs)[comp])
        (fetch,) = spec["initContainers"]
        assert fetch["args"] == [
            "fetch-model",
            "hf://meta-llama/Llama-3.1-8B-Instruct@main",
            "/models/llama-3.1-8b-instruct",
        ]
        main = spec["containers"][0]
        assert arg(main, "--model") == "/models/llama-3.1-8b-instruct"
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    existing = render(("rdma-values.yaml",))
    assert not objects(existing, "PersistentVolumeClaim")
    assert "initContainers" not in pod_spec(deployments(existing)["decode"])


def test_toggles_remove_their_objects() -> None:
    base = render(("minimal-values.yaml",))
    kinds = {d["kind"] for d in base}
    assert {"PodDisruptionBudget", "NetworkPolicy", "Secret", "ServiceAccount"} <= kinds
    off = render(
        ("minimal-values.yaml",),
        (
            "gateway.pdb.enabled=false",
            "scheduler.pdb.enabled=false",
            "prefill.pdb.enabled=false",
            "decode.pdb.enabled=false",
        ),
    )
    assert not objects(off, "PodDisruptionBudget")
    shared = render(("minimal-values.yaml",), ("serviceAccount.perComponent=false",))
    (sa,) = objects(shared, "ServiceAccount")
    assert {pod_spec(d)["serviceAccountName"] for d in deployments(shared).values()} == {sa}
    none = render(("minimal-values.yaml",), ("serviceAccount.create=false", "serviceAccount.name=ops"))
    assert not objects(none, "ServiceAccount")
    assert {pod_spec(d)["serviceAccountName"] for d in deployments(none).values()} == {"ops"}


def test_security_keys_by_default_and_tls_and_key_files_from_secrets() -> None:
    """By default the gateway requires API keys (the scheduler keeps no default tenant) and serves its
    metrics on a port of its own; with a TLS Secret every Baton container gets it as --tls-dir (read-only,
    mode 0400) and the clients check the configured name; the keys file reaches only the scheduler."""
    plain = {comp: c for comp, c in baton_containers(render(("minimal-values.yaml",)))}
    assert "--require-api-key" in plain["gateway"]["args"] and arg(plain["gateway"], "--metrics-port")
    assert arg(plain["scheduler"], "--default-tenant") == ""
    assert all(arg(c, "--tls-dir") is None for c in plain.values())
    docs = render(("full-values.yaml",))
    secured = dict(baton_containers(docs))
    assert {"gateway", "scheduler", "prefill", "decode"} <= set(secured)
    deps = deployments(docs)
    for comp in ("gateway", "scheduler", "prefill", "decode"):
        c = secured[comp]
        assert (
            arg(c, "--tls-dir") == "/etc/baton/tls" and arg(c, "--tls-server-name") == "baton.inference.svc"
        )
        assert {"name": "tls", "mountPath": "/etc/baton/tls", "readOnly": True} in c["volumeMounts"]
        volumes = {v["name"]: v for v in pod_spec(deps[comp])["volumes"]}
        assert volumes["tls"]["secret"] == {"secretName": "baton-tls", "defaultMode": 0o400}
        assert (arg(c, "--api-keys-file") is not None) == (comp == "scheduler")
    assert arg(secured["scheduler"], "--api-keys-file") == "/etc/baton/api-keys/api-keys"
    keys = {v["name"]: v for v in pod_spec(deps["scheduler"])["volumes"]}["api-keys"]
    assert keys["secret"]["secretName"] == "baton-api-keys"
    off = dict(baton_containers(render(("minimal-values.yaml",), ("security.requireApiKey=false",))))
    assert (
        "--require-api-key" not in off["gateway"]["args"]
        and arg(off["scheduler"], "--default-tenant") is None
    )
