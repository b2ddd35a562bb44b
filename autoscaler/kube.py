"""`KubernetesScaler`: a `Scaler` over the official ``kubernetes`` client — each pool is a Deployment,
sized through its ``scale`` subresource, its pods watched for readiness.

The RBAC rules below are the only API calls it makes; the chart renders its Role from the same list
(`tests/unit/test_helm_chart.py` checks the two agree, and the scaler's tests check it calls nothing else).

How a pool's `PoolState` is counted from its Deployment and the pods its selector matches:

- ``desired``: the scale subresource's ``spec.replicas``.
- a pod is *live* unless it is terminating (it has a ``deletionTimestamp``) or finished (phase
  ``Succeeded`` or ``Failed``, as an evicted pod stays until it is garbage-collected);
- ``ready``: live pods whose ``Ready`` condition is ``True``;
- ``pending``: live pods not Ready (scheduling, pulling, loading the model), plus the replicas asked for
  that have no pod yet: ``max(0, desired - live)``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import urllib3
from kubernetes import client, watch
from kubernetes import config as kube_config

from autoscaler.config import AutoscaleConfig
from autoscaler.scaling import POOLS, PoolState, ScalerError

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MERGE_PATCH = "application/merge-patch+json"
MAX_BACKOFF_S = 10.0  # the longest a pod watch waits before it tries the API server again
T = TypeVar("T")


def rbac_rules(actuate: bool) -> list[dict[str, Any]]:
    """The Role rules the scaler needs: read (and, when it actuates, patch) the pools' scale
    subresource; list and watch pods for readiness."""
    return [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "verbs": ["get", "patch"] if actuate else ["get"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    ]


def new_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """An API client from ``kubeconfig``, else this pod's service account, else ``$KUBECONFIG`` or
    ``~/.kube/config``.

    urllib3's retries are off: by default it retries a GET that timed out three times, which would
    stretch every ``_request_timeout`` fourfold on a hung API server; the controller retries at its next
    interval instead."""
    configuration = client.Configuration(retries=0)
    # kubernetes.config and kubernetes.watch are not annotated: hence the type: ignores in this module.
    try:
        if kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration, persist_config=False
            )
        else:
            kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (kube_config.ConfigException, OSError) as e:
        raise ScalerError(
            f"no Kubernetes API credentials (--kubeconfig, in-cluster or ~/.kube/config): {e}"
        ) from e
    return client.ApiClient(configuration)


def own_namespace() -> str:
    """This pod's namespace (its service account's), else ``default``."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class _Conflict(ScalerError):
    """A write's resourceVersion precondition failed (409): someone changed the object since we read it."""


class KubernetesScaler:
    """A `Scaler` whose pools are Deployments in one namespace: it reads and patches their ``scale``
    subresource and counts their pods from a watch kept per pool in a background thread, so `state`
    costs one GET. It owns ``api_client`` (`close` closes it).

    Every API call carries ``request_timeout_s``, so a hung API server is a `ScalerError`, never a hang
    (build the client with `new_api_client`, whose urllib3 does not retry behind that bound)."""

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        deployments: Mapping[str, str],
        *,
        actuate: bool = True,
        request_timeout_s: float = 5.0,
        max_conflict_retries: int = 5,
        watch_timeout_s: int = 60,
    ) -> None:
        unknown = set(deployments) - set(POOLS)
        if unknown:
            raise ValueError(f"unknown pools {sorted(unknown)}; pools are {POOLS}")
        if request_timeout_s <= 0 or watch_timeout_s < 1 or max_conflict_retries < 0:
            raise ValueError("need request_timeout_s > 0, watch_timeout_s >= 1 and max_conflict_retries >= 0")
        self.namespace = namespace
        self.deployments = {pool: name for pool, name in deployments.items() if name}
        self.actuate = actuate
        self.request_timeout_s = request_timeout_s
        self.max_conflict_retries = max_conflict_retries
        self.watch_timeout_s = watch_timeout_s
        self._api_client = api_client
        self._apps = client.AppsV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._lock = threading.Lock()
        self._watches: dict[str, _PodWatch] = {}  # pool → the watch of its Deployment's pods
        self._closed = False

    @classmethod
    def from_config(cls, config: AutoscaleConfig) -> KubernetesScaler:
        """The scaler `baton autoscale --scaler kubernetes` runs: credentials from ``config.kubeconfig``
        (else in-cluster, else ~/.kube/config), the namespace from ``config.namespace`` (else this
        pod's, else ``default``)."""
        deployments = {"prefill": config.prefill_deployment, "decode": config.decode_deployment}
        return cls(
            new_api_client(config.kubeconfig),
            config.namespace or own_namespace(),
            deployments,
            actuate=config.actuate,
        )

    def state(self, pool: str) -> PoolState:
        name = self._deployment(pool)
        scale = self._call(pool, name, "get", self._read_scale(name))
        desired = _replicas(scale)
        selector = scale.status.selector if scale.status else None
        if not selector:
            raise ScalerError(
                f"{pool}: the scale of deployment {self.namespace}/{name} has no status.selector"
            )
        live, ready = self._pod_watch(pool, selector).counts(self.request_timeout_s)
        return PoolState(desired=desired, ready=ready, pending=live - ready + max(0, desired - live))

    def scale(self, pool: str, replicas: int) -> None:
        name = self._deployment(pool)
        if not self.actuate:
            raise ScalerError(
                f"{pool}: read-only (--no-actuate): not scaling deployment {self.namespace}/{name} to {replicas}"
            )
        for _ in range(self.max_conflict_retries + 1):
            current = self._call(pool, name, "get", self._read_scale(name))
            before = _replicas(current)
            if before == replicas:
                return
            body: dict[str, Any] = {"spec": {"replicas": replicas}}
            # The resourceVersion read a moment ago is a precondition: if another writer (a person, an
            # HPA, a rollout) changed the Deployment since, the patch fails with 409 instead of undoing it.
            if current.metadata and current.metadata.resource_version:
                body["metadata"] = {"resourceVersion": current.metadata.resource_version}
            try:
                self._call(pool, name, "patch", self._patch_scale(name, body))
            except _Conflict:
                log.info(
                    "scale %s: deployment %s/%s changed while we scaled it; reading it again",
                    pool,
                    self.namespace,
                    name,
                )
                continue
            log.info(
                "scale %s: %d → %d replicas (deployment %s/%s)", pool, before, replicas, self.namespace, name
            )
            return
        raise ScalerError(
            f"{pool}: deployment {self.namespace}/{name} changed under each of {self.max_conflict_retries + 1} "
            "scale attempts (409 Conflict); giving up until the next decision"
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            watches = list(self._watches.values())
            self._watches.clear()
        for pod_watch in watches:
            pod_watch.stop(self.request_timeout_s)
        self._api_client.close()  # type: ignore[no-untyped-call]

    def _deployment(self, pool: str) -> str:
        if self._closed:
            raise ScalerError(f"{pool}: the scaler is closed")
        name = self.deployments.get(pool)
        if name is None:
            raise ScalerError(f"{pool}: not managed: no --{pool}-deployment was given")
        return name

    def _read_scale(self, name: str) -> Callable[[], client.V1Scale]:
        return lambda: self._apps.read_namespaced_deployment_scale(
            name, self.namespace, _request_timeout=self.request_timeout_s
        )

    def _patch_scale(self, name: str, body: dict[str, Any]) -> Callable[[], client.V1Scale]:
        return lambda: self._apps.patch_namespaced_deployment_scale(
            name, self.namespace, body, _content_type=MERGE_PATCH, _request_timeout=self.request_timeout_s
        )

    def _call(self, pool: str, name: str, verb: str, request: Callable[[], T]) -> T:
        """``request()``, its failures as `ScalerError`s that say what to check."""
        target = f"deployment {self.namespace}/{name}"
        try:
            return request()
        except client.ApiException as e:
            if e.status == 404:
                raise ScalerError(
                    f"{pool}: {target} not found (404): is the chart installed in namespace {self.namespace}, "
                    f"and is --{pool}-deployment right?"
                ) from e
            if e.status in (401, 403):
                raise ScalerError(
                    f"{pool}: {verb} on the scale of {target} refused ({e.status} {e.reason}): does the "
                    f"autoscaler's Role grant {verb} on deployments/scale in {self.namespace}, bound to its "
                    "service account?"
                ) from e
            if e.status == 409:
                raise _Conflict(f"{pool}: {target} changed since it was read (409)") from e
            raise ScalerError(f"{pool}: {verb} on the scale of {target} failed: {_describe(e)}") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ScalerError(
                f"{pool}: {verb} on the scale of {target}: no answer from the API server within "
                f"{self.request_timeout_s} s ({type(e).__name__}: {e})"
            ) from e
        except ValueError as e:  # an answer the client's models reject
            raise ScalerError(f"{pool}: {verb} on the scale of {target}: an unreadable answer ({e})") from e

    def _pod_watch(self, pool: str, selector: str) -> _PodWatch:
        with self._lock:
            if self._closed:
                raise ScalerError(f"{pool}: the scaler is closed")
            stale = self._watches.get(pool)
            if stale is not None and stale.selector == selector:
                return stale
            # First use, or the Deployment was replaced by one with another selector.
            fresh = _PodWatch(
                self._core, self.namespace, selector, pool, self.request_timeout_s, self.watch_timeout_s
            )
            self._watches[pool] = fresh
        if stale is not None:
            stale.stop(self.request_timeout_s)
        return fresh


def _replicas(scale: client.V1Scale) -> int:
    """A Scale's ``spec.replicas``, which the API server leaves out when it is 0."""
    return scale.spec.replicas if scale.spec and scale.spec.replicas is not None else 0


def _describe(e: client.ApiException) -> str:
    """An API error's status and, from its Status body, the server's message."""
    try:
        message = json.loads(e.body or "")["message"]
    except (ValueError, KeyError, TypeError):
        message = e.body
    return f"{e.status} {e.reason}: {message}"


class _PodWatch:
    """The live pods matching one label selector, kept current in a daemon thread: list them, then watch
    from the list's resourceVersion; after a watch's normal timeout resume from the last resourceVersion
    seen, after 410 Gone list again, after any other failure back off and retry."""

    def __init__(
        self,
        core: client.CoreV1Api,
        namespace: str,
        selector: str,
        pool: str,
        request_timeout_s: float,
        watch_timeout_s: int,
    ) -> None:
        self.selector = selector
        self._core, self._namespace, self._pool = core, namespace, pool
        self._request_timeout_s, self._watch_timeout_s = request_timeout_s, watch_timeout_s
        self._lock = threading.Lock()
        self._ready: dict[str, bool] = {}  # live pod name → its Ready condition is True
        self._failure = ""  # why the last list or watch failed, for the error if nothing was listed
        self._listed = threading.Event()
        self._stopping = threading.Event()
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, name=f"kube-pods-{pool}", daemon=True)
        self._thread.start()

    def counts(self, wait_s: float) -> tuple[int, int]:
        """(live pods, Ready pods); waits up to ``wait_s`` for the first list."""
        if not self._listed.wait(wait_s):
            raise ScalerError(
                f"{self._pool}: pods matching {self.selector!r} in {self._namespace} not listed within "
                f"{wait_s} s{f' ({self._failure})' if self._failure else ''}"
            )
        with self._lock:
            return len(self._ready), sum(self._ready.values())

    def stop(self, wait_s: float) -> None:
        self._stopping.set()
        deadline = time.monotonic() + wait_s
        # Watch.stop() shuts the open stream's socket, but a stream opened just after it clears the flag:
        # repeat until the thread has seen _stopping.
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._watch.stop()  # type: ignore[no-untyped-call]
            self._thread.join(0.05)

    def _run(self) -> None:
        resource_version: str | None = None
        failures = 0
        while not self._stopping.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list()
                resource_version = self._follow(resource_version)
                failures = 0
            # The thread must outlive any one failure (a dropped connection, a bad response): the pool's
            # counts would silently freeze if it died.
            except Exception as e:
                if self._stopping.is_set():
                    return
                if isinstance(e, client.ApiException) and e.status == 410:
                    log.info(
                        "pods of %s: resourceVersion %s expired (410); listing again",
                        self._pool,
                        resource_version,
                    )
                    resource_version = None
                    continue
                failures += 1
                self._failure = (
                    _describe(e) if isinstance(e, client.ApiException) else f"{type(e).__name__}: {e}"
                )
                log.warning("pods of %s: list or watch failed (%s); retrying", self._pool, self._failure)
                self._stopping.wait(min(MAX_BACKOFF_S, 0.1 * 2**failures))

    def _list(self) -> str:
        pods = self._core.list_namespaced_pod(
            self._namespace, label_selector=self.selector, _request_timeout=self._request_timeout_s
        )
        if pods.metadata is None or not pods.metadata.resource_version:
            raise ValueError("a pod list without a resourceVersion")
        with self._lock:
            self._ready = {
                pod.metadata.name: _is_ready(pod)
                for pod in pods.items
                if pod.metadata and pod.metadata.name and _is_live(pod)
            }
        self._listed.set()
        return pods.metadata.resource_version

    def _follow(self, resource_version: str) -> str:
        """Applies watch events from ``resource_version`` until the server ends the watch; returns the
        last resourceVersion seen."""
        events = self._watch.stream(  # type: ignore[no-untyped-call]
            self._core.list_namespaced_pod,
            self._namespace,
            label_selector=self.selector,
            resource_version=resource_version,
            timeout_seconds=self._watch_timeout_s,
            # the server ends the watch after timeout_seconds; a silent connection past that is dead
            _request_timeout=(self._request_timeout_s, self._watch_timeout_s + self._request_timeout_s),
        )
        for event in events:
            if event["type"] == "ERROR":  # the client raises these itself; in case one gets through
                raw = event["raw_object"]
                raise client.ApiException(status=raw.get("code"), reason=raw.get("message"))
            pod: client.V1Pod = event["object"]
            if pod.metadata is None or pod.metadata.name is None:
                continue
            with self._lock:
                if event["type"] == "DELETED" or not _is_live(pod):
                    self._ready.pop(pod.metadata.name, None)
                else:
                    self._ready[pod.metadata.name] = _is_ready(pod)
            resource_version = pod.metadata.resource_version or resource_version
        return resource_version


def _is_live(pod: client.V1Pod) -> bool:
    terminating = pod.metadata is not None and pod.metadata.deletion_timestamp is not None
    finished = pod.status is not None and pod.status.phase in ("Succeeded", "Failed")
    return not terminating and not finished


def _is_ready(pod: client.V1Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)
