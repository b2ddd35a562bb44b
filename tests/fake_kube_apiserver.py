"""A stand-in Kubernetes API server on loopback for the autoscaler's tests: enough of apps/v1 Deployments
(with the ``scale`` subresource) and core/v1 pods (list, watch) that the unmodified ``kubernetes`` client
talks to it over real HTTP, as to a cluster. No kube-apiserver can run on our machines (none on PyPI, npm
or apt — no envtest, kwok, k3s or kind — and no Docker); a real cluster stays an opt-in check.

Faithful where the scaler depends on it: paths, content types and Status bodies (404; 409 Conflict on a
stale ``metadata.resourceVersion`` precondition; 422), one resourceVersion counter for every change,
label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``), and watches as chunked
JSON lines from a resourceVersion, ended by ``timeoutSeconds`` or, after a compaction, by an ERROR event
with a 410 Status. Not modelled: admission, defaulting, controllers (the test adds pods), authorization
(each request's RBAC attributes are recorded instead) and a label change turning MODIFIED into DELETED.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

Obj = dict[str, Any]
TOKEN = "stand-in-token"
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
_DEPLOYMENTS = re.compile(r"/apis/apps/v1/namespaces/([^/]+)/deployments(?:/([^/]+)(/scale)?)?")
_PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods")
_RESOURCE_PATH = re.compile(r"/apis?/(?:([^/]+)/)?v1/namespaces/[^/]+/([^/]+)(?:/([^/]+)(?:/([^/]+))?)?")
_REQUIREMENT = re.compile(
    r"\s*(?:!\s*(?P<absent>[\w./-]+)|(?P<key>[\w./-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[\w.-]*)"
    r"|\s+(?P<set_op>in|notin)\s*\((?P<values>[^)]*)\))?)\s*"
)


class _Reply(Exception):
    """Ends a request with ``args``: the status code and the body."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the server received it (query values are the last of each name)."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any  # the JSON body, None when empty

    def rbac(self) -> tuple[str, str, str]:
        """(apiGroup, resource, verb) as the API server's authorizer sees this request."""
        match = _RESOURCE_PATH.fullmatch(self.path)
        if match is None:
            return ("", self.path, self.method.lower())
        group, resource, name, sub = match.groups()
        read = "get" if name else ("watch" if self.query.get("watch") in ("1", "true") else "list")
        verb = {"GET": read, "POST": "create", "PATCH": "patch"}.get(self.method, self.method.lower())
        return (group or "", f"{resource}/{sub}" if sub else resource, verb)


def error(code: int, reason: str, message: str, **details: str) -> _Reply:
    """An error response: its code and the metav1 Status body every error carries."""
    body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    return _Reply(code, body | {"message": message, "reason": reason, "details": details, "code": code})


def _deployment_error(code: int, reason: str, message: str, name: str) -> _Reply:
    return error(code, reason, message, name=name, group="apps", kind="deployments")


def parse_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A label selector in the query syntax (``app=x,tier!=db,env in (a,b),gpu,!spot``) as a predicate."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for part in re.split(r",(?![^()]*\))", text) if text.strip() else []:
        m = _REQUIREMENT.fullmatch(part)
        if m is None:
            raise error(400, "BadRequest", f"unable to parse requirement: {part!r}")
        key, op = m["key"] or m["absent"], m["op"] or m["set_op"]
        if op is None:  # ``key`` exists, ``!key`` does not
            tests.append(lambda labels, k=key, absent=bool(m["absent"]): (k in labels) != absent)
            continue
        values = {m["value"]} if m["op"] else {v.strip() for v in m["values"].split(",")}
        # ``!=`` and ``notin`` also match a pod without the label, as on a real server
        tests.append(lambda labels, k=key, vs=values, neg=op in ("!=", "notin"): (labels.get(k) in vs) != neg)
    return lambda labels: all(test(labels) for test in tests)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FakeKubeApiServer:
    """The stand-in API server: start it (or use it as a context manager), point the client at
    `write_kubeconfig`, arrange pods and faults with the helpers, and read `requests`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rv = 0  # the last resourceVersion given out (one counter for every object, as etcd has)
        self._deployments: dict[tuple[str, str], Obj] = {}
        self._pods: dict[tuple[str, str], Obj] = {}
        self._events: list[tuple[int, str, Obj]] = []  # (resourceVersion, ADDED|MODIFIED|DELETED, pod)
        self._compacted_rv = 0  # a watch from an older resourceVersion gets 410 Gone
        self._expiry = 0  # bumped by expire_watches: every open watch ends with a 410
        self._conflicts = 0  # scale PATCHes still to meet a concurrent write
        self._faults: list[tuple[str, float, int]] = []  # (path substring, hang seconds, error code or 0)
        self._requests: list[Request] = []
        self._stopping = threading.Event()
        handler = type("Handler", (_Handler,), {"api": self})
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(0.05,), name="fake-kube-apiserver", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self) -> FakeKubeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()  # open watches end now
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> FakeKubeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig (JSON is YAML) whose current context is this server, with a bearer token."""
        context = {"cluster": "stand-in", "user": "tester", "namespace": namespace}
        doc: Obj = {"apiVersion": "v1", "kind": "Config", "current-context": "stand-in"}
        doc["clusters"] = [{"name": "stand-in", "cluster": {"server": self.url}}]
        doc["contexts"] = [{"name": "stand-in", "context": context}]
        doc["users"] = [{"name": "tester", "user": {"token": TOKEN}}]
        path.write_text(json.dumps(doc))
        return path

    # --- what the test reads and arranges ---

    @property
    def requests(self) -> list[Request]:
        with self._cond:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._cond:
            self._requests.clear()

    def replicas(self, namespace: str, name: str) -> int:
        with self._cond:
            return int(self._deployments[namespace, name]["spec"]["replicas"])

    def add_pod(
        self, namespace: str, name: str, labels: dict[str, str], ready: bool = False, phase: str = "Running"
    ) -> None:
        meta = {"name": name, "namespace": namespace, "labels": labels, "uid": str(uuid.uuid4())}
        pod: Obj = {"apiVersion": "v1", "kind": "Pod", "metadata": meta | {"creationTimestamp": _now()}}
        pod["spec"] = {"containers": [{"name": "worker", "image": "baton"}]}
        pod["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
        self._write_pod(namespace, name, pod, "ADDED")

    def set_pod_ready(self, namespace: str, name: str, ready: bool = True) -> None:
        with self._cond:
            pod = copy.deepcopy(self._pods[namespace, name])
            pod["status"]["conditions"] = [{"type": "Ready", "status": str(ready)}]
            self._write_pod(namespace, name, pod, "MODIFIED")

    def terminate_pod(self, namespace: str, name: str) -> None:
        """A graceful delete begins: the pod stays, with a deletionTimestamp, until `delete_pod`."""
        with self._cond:
            pod = copy.deepcopy(self._pods[namespace, name])
            pod["metadata"] |= {"deletionTimestamp": _now(), "deletionGracePeriodSeconds": 30}
            self._write_pod(namespace, name, pod, "MODIFIED")

    def delete_pod(self, namespace: str, name: str) -> None:
        with self._cond:
            self._write_pod(namespace, name, copy.deepcopy(self._pods[namespace, name]), "DELETED")

    def conflict_next_patches(self, count: int = 1) -> None:
        """Another writer changes the Deployment just before each of the next ``count`` scale PATCHes, so
        their resourceVersion precondition (read a moment earlier) is stale: 409 Conflict."""
        with self._cond:
            self._conflicts += count

    def hang_next(self, seconds: float, match: str = "", times: int = 1) -> None:
        """The next ``times`` requests whose method and path (``"PATCH /apis/..."``) contain ``match`` get no
        answer for ``seconds``."""
        with self._cond:
            self._faults += [(match, seconds, 0)] * times

    def fail_next(self, code: int, match: str = "", times: int = 1) -> None:
        """The next ``times`` requests whose method and path contain ``match`` get this error (403, 500...)."""
        with self._cond:
            self._faults += [(match, 0.0, code)] * times

    def clear_faults(self) -> None:
        with self._cond:
            self._faults.clear()

    def expire_watches(self) -> None:
        """History up to now is compacted: open watches end with an ERROR event carrying 410 Gone, and a
        watch from an older resourceVersion gets the same; a fresh list gives one that works."""
        with self._cond:
            self._rv += 1  # some other object changed, and the history before it was compacted away
            self._compacted_rv, self._expiry = self._rv, self._expiry + 1
            self._cond.notify_all()

    # --- the API ---

    def record(self, request: Request) -> None:
        """Logs a request, then applies the first fault that matches it: a hang (after which a slow server
        still answers) or an error."""
        with self._cond:
            self._requests.append(request)
            fault = next((f for f in self._faults if f[0] in f"{request.method} {request.path}"), None)
            if fault is not None:
                self._faults.remove(fault)
        if fault is not None:
            self._stopping.wait(fault[1])
            if fault[2]:
                reason = HTTPStatus(fault[2]).phrase.replace(" ", "")
                raise error(fault[2], reason, f"{request.method} {request.path}: {reason} (injected)")

    def route(self, request: Request) -> tuple[int, Obj]:
        """The status code and body that answer a (non-watch) request."""
        method, path, query = request.method, request.path, request.query
        if (m := _DEPLOYMENTS.fullmatch(path)) is not None:
            namespace, name, scale = m.groups()
            with self._cond:
                if name is None and method == "POST":
                    return 201, self._create_deployment(namespace, request.body)
                deployment = self._deployment(namespace, name)
                if scale and method == "PATCH":
                    return 200, self._patch_scale(deployment, request.content_type, request.body)
                if method == "GET":
                    return 200, self._scale_of(deployment) if scale else self._deployment_view(deployment)
        if (m := _PODS.fullmatch(path)) is not None and method == "GET":
            matches = parse_selector(query.get("labelSelector", ""))
            with self._cond:
                items = [copy.deepcopy(p) for (ns, _), p in sorted(self._pods.items()) if ns == m[1]]
                pods = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)}}
                return 200, pods | {"items": [p for p in items if matches(p["metadata"]["labels"])]}
        raise error(404, "NotFound", f"the server could not find the requested resource {path}")

    def watch_pods(self, namespace: str, query: dict[str, str]) -> Iterator[Obj]:
        """The matching pods' events after ``resourceVersion``, until ``timeoutSeconds`` pass, an expiry or
        the server stops."""
        matches = parse_selector(query.get("labelSelector", ""))
        deadline = time.monotonic() + float(query.get("timeoutSeconds", "1800"))
        with self._cond:
            expiry, since = self._expiry, int(query.get("resourceVersion") or self._rv)
            gone = since < self._compacted_rv
            # Without a resourceVersion a watch starts with the current pods, as ADDED events.
            current = [] if query.get("resourceVersion") else sorted(self._pods.items())
            events = [(since, "ADDED", copy.deepcopy(pod)) for _, pod in current]
        while True:
            for _, kind, pod in events:
                if pod["metadata"]["namespace"] == namespace and matches(pod["metadata"]["labels"]):
                    yield {"type": kind, "object": pod}
            left = deadline - time.monotonic()
            if gone or self._stopping.is_set() or left <= 0:
                break
            with self._cond:
                self._cond.wait_for(
                    lambda rv=since: self._rv > rv or self._expiry != expiry or self._stopping.is_set(), left
                )
                events = [e for e in self._events if e[0] > since]
                since, gone = self._rv, self._expiry != expiry
        if gone:
            yield {
                "type": "ERROR",
                "object": error(410, "Expired", f"too old resource version: {since}").args[1],
            }

    def _write_pod(self, namespace: str, name: str, pod: Obj, kind: str) -> None:
        with self._cond:
            self._rv += 1
            pod["metadata"]["resourceVersion"] = str(self._rv)
            if kind == "DELETED":
                del self._pods[namespace, name]
            else:
                self._pods[namespace, name] = pod
            self._events.append((self._rv, kind, copy.deepcopy(pod)))
            self._cond.notify_all()

    def _deployment(self, namespace: str, name: str) -> Obj:
        deployment = self._deployments.get((namespace, name))
        if deployment is None:
            raise _deployment_error(404, "NotFound", f'deployments.apps "{name}" not found', name)
        return deployment

    def _create_deployment(self, namespace: str, body: Any) -> Obj:
        name = str(body["metadata"]["name"])
        if (namespace, name) in self._deployments:
            message = f'deployments.apps "{name}" already exists'
            raise _deployment_error(409, "AlreadyExists", message, name)
        self._rv += 1
        deployment = copy.deepcopy(body)
        deployment["metadata"] |= {"namespace": namespace, "uid": str(uuid.uuid4()), "generation": 1}
        deployment["metadata"] |= {"resourceVersion": str(self._rv), "creationTimestamp": _now()}
        deployment["spec"].setdefault("replicas", 1)
        self._deployments[namespace, name] = deployment
        return self._deployment_view(deployment)

    def _live_pods(self, deployment: Obj) -> list[Obj]:
        wanted = deployment["spec"]["selector"]["matchLabels"].items()
        pods = [p for (ns, _), p in self._pods.items() if ns == deployment["metadata"]["namespace"]]
        return [
            p
            for p in pods
            if wanted <= p["metadata"]["labels"].items() and "deletionTimestamp" not in p["metadata"]
        ]

    def _deployment_view(self, deployment: Obj) -> Obj:
        view = copy.deepcopy(deployment) | {"apiVersion": "apps/v1", "kind": "Deployment"}
        return view | {"status": {"replicas": len(self._live_pods(deployment))}}

    def _scale_of(self, deployment: Obj) -> Obj:
        """The autoscaling/v1 Scale: the Deployment's metadata, and its selector in the query syntax."""
        labels = sorted(deployment["spec"]["selector"]["matchLabels"].items())
        meta = {k: deployment["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion")}
        scale: Obj = {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": meta}
        scale["spec"] = {"replicas": deployment["spec"]["replicas"]}
        selector = ",".join(f"{k}={v}" for k, v in labels)
        return scale | {"status": {"replicas": len(self._live_pods(deployment)), "selector": selector}}

    def _patch_scale(self, deployment: Obj, content_type: str, body: Any) -> Obj:
        name = deployment["metadata"]["name"]
        if content_type not in PATCH_TYPES:
            message = f"the body of the request was in an unknown format - accepted media types include: {PATCH_TYPES}"
            raise error(415, "UnsupportedMediaType", message)
        if self._conflicts > 0:  # the concurrent write: a new resourceVersion, nothing else changed
            self._conflicts -= 1
            self._rv += 1
            deployment["metadata"]["resourceVersion"] = str(self._rv)
        precondition = ((body or {}).get("metadata") or {}).get("resourceVersion")
        if precondition is not None and precondition != deployment["metadata"]["resourceVersion"]:
            message = (
                f'Operation cannot be fulfilled on deployments.apps "{name}": the object has been modified'
            )
            raise _deployment_error(
                409, "Conflict", message + "; please apply your changes to the latest version", name
            )
        replicas = ((body or {}).get("spec") or {}).get("replicas", deployment["spec"]["replicas"])
        if type(replicas) is not int or replicas < 0:
            message = f'Scale.autoscaling "{name}" is invalid: spec.replicas: Invalid value: {replicas}: must be >= 0'
            raise error(422, "Invalid", message, name=name, group="autoscaling", kind="Scale")
        if replicas != deployment["spec"]["replicas"]:  # a no-op patch changes nothing, as on a real server
            self._rv += 1
            deployment["spec"]["replicas"] = replicas
            deployment["metadata"]["resourceVersion"] = str(self._rv)
            deployment["metadata"]["generation"] += 1
        return self._scale_of(deployment)


class _Handler(BaseHTTPRequestHandler):
    """Speaks HTTP/1.1 (keep-alive, chunked watch streams) for the `FakeKubeApiServer` in ``api``."""

    api: FakeKubeApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # the request log is the test's record
        pass

    def _serve(self) -> None:
        method, url = self.command, urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                raise error(401, "Unauthorized", "Unauthorized")
            try:
                body = json.loads(raw) if raw else None
            except ValueError as e:
                raise error(400, "BadRequest", f"invalid JSON: {e}") from None
            request = Request(method, url.path, query, content_type, body)
            self.api.record(request)
            if request.rbac() == ("", "pods", "watch"):
                namespace = url.path.split("/")[4]
                self._stream(self.api.watch_pods(namespace, query))
                return
            self._send(*self.api.route(request))
        except _Reply as reply:
            self._send(*reply.args)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout); nobody to answer
            self.close_connection = True

    do_GET = do_POST = do_PATCH = _serve

    def _send(self, code: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterable[Obj]) -> None:
        """A watch response: one JSON event a line, each in its own chunk, sent as it happens."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.write(b"0\r\n\r\n")
