"""A cluster hardened as on a shared cluster: a development CA (`rpc.tls.make_dev_ca`), a real
redis-server, a `baton scheduler` and a prefill and a decode worker (tiny model, tcp KV transport) as
processes with ``--tls-dir`` (mutual TLS on every internal port and channel), and a gateway with TLS on
its HTTP and gRPC ports and ``--require-api-key``.

* **Transport**: the official `openai` client, trusting the CA, with a key streams a completion that
  went prefill → KV transfer → decode; a plaintext client, a client without a certificate and one with a
  certificate of another CA are refused by the scheduler and the workers; every listener of the cluster's
  processes is on 127.0.0.1, none on all interfaces.
* **Authentication**: without a valid key every HTTP route but ``GET /health`` answers 401 with an
  OpenAI error body — for path tricks (``//v1``, ``/v1/../``, case changes), an odd Host header, a
  near-miss key, a case-flipped key — and every gRPC method but health answers UNAUTHENTICATED; the
  metrics port serves without a key.
* **KV transfer port**: a connection without the source's credential, with a wrong one, with a read
  outside any lease, an oversized frame or random bytes is dropped and counted; the worker serves on.
* **Limits before work**: each limit answers its status before any placement or engine step, and the
  gateway serves on.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import Cluster, GatewayThread, Scrape, add_tenants, eventually, own_database

from baton.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc
from kv_transfer.transport import unpack_metadata
from rpc.tls import Tls, TlsConfig, make_dev_ca
from scheduler.tenants import TenantConfig

pytestmark = pytest.mark.integration

KEY = "sk-alice-" + "7" * 40
PROMPT = "The quick brown fox jumps over the lazy dog, " * 6  # over the local-prefill threshold
READ_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dev_ca(tmp_path_factory.mktemp("tls"), ("127.0.0.1", "localhost"))


@pytest.fixture(scope="module")
def secure(
    redis_server: Any, tiny_llama: Path, certs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    redis_url = own_database(redis_server.url, 11)
    tls = ("--tls-dir", str(certs))
    with Cluster(redis_url, tmp_path_factory.mktemp("security"), *tls) as c:
        c.add_workers(tiny_llama, "prefill", "decode", flags=tls)
        add_tenants(redis_url, [TenantConfig("alice")], {KEY: "alice"})
        c.start_gateway(
            tiny_llama,
            tls=TlsConfig(str(certs)),
            require_api_key=True,
            metrics_port=0,
            local_prefill_threshold=1,
            http_read_timeout_s=READ_TIMEOUT_S,
            max_request_bytes=64 << 10,
        )
        yield c


def gateway(c: Cluster) -> GatewayThread:
    assert c.gateway is not None
    return c.gateway


def https(c: Cluster) -> http.client.HTTPSConnection:
    gw = gateway(c)
    assert gw.tls is not None
    context = ssl.create_default_context(cadata=gw.tls.ca.decode())
    return http.client.HTTPSConnection("127.0.0.1", gw.server.http_port, context=context, timeout=30)


def call(
    c: Cluster, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request sent as written: the path is not normalized on the way (http.client sends it raw)."""
    conn = https(c)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.headers), resp.read()
    finally:
        conn.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- transport --------------------------------------------------------------------------------------


def test_the_openai_client_streams_a_disaggregated_completion_over_tls_with_a_key(secure: Cluster) -> None:
    import openai

    gw = gateway(secure)
    assert gw.tls is not None and gw.url.startswith("https://")
    context = ssl.create_default_context(cadata=gw.tls.ca.decode())
    with openai.DefaultHttpxClient(verify=context) as http:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, http_client=http, max_retries=0)
        stream = client.chat.completions.create(
            model=gw.model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text
        anonymous = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=NEAR_MISS, http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
    prefill = secure.workers[0]
    assert prefill.role == "prefill"
    eventually(lambda: leases_ended(prefill) >= 1, 10, "the prompt went through the prefill worker")


def leases_ended(worker: Any) -> float:
    return sum(
        Scrape(worker_metrics_url(worker)).value("baton_worker_leases_ended_total", outcome=o)
        for o in ("released", "expired", "aborted")
    )


def worker_metrics_url(worker: Any) -> str:
    match = re.search(r"metrics on (http://\S+)", worker.log_path.read_text())
    assert match, "the worker printed no metrics URL"
    return match.group(1)


def test_a_plaintext_client_of_the_gateway_gets_no_answer(secure: Cluster) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", gateway(secure).server.http_port, timeout=10)
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        conn.request("GET", "/health")
        conn.getresponse().read()
    conn.close()


def test_internal_ports_refuse_plaintext_and_clients_without_the_cluster_certificate(
    secure: Cluster, tmp_path: Path
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    certs = secure.scheduler.tls
    assert certs is not None
    stranger = Tls.load(make_dev_ca(tmp_path / "other-ca"))  # a valid certificate of another CA
    check = health_pb2.HealthCheckRequest()
    for process in (secure.scheduler, *secure.workers):
        address = process.address
        refused = {
            "plaintext": grpc.insecure_channel(address),
            "no client certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(certs.ca)),
            "another CA's certificate": grpc.secure_channel(
                address, grpc.ssl_channel_credentials(certs.ca, stranger.key, stranger.cert)
            ),
        }
        for what, channel in refused.items():
            with channel, pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(channel).Check(check, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (process.name, what)
        with process.channel() as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(check, timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, process.name


def _listeners(pid: int) -> list[str]:
    """The local addresses (hex ip:port, as /proc/net/tcp writes them) of the TCP sockets ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.append(fields[1])
    return found


def test_every_internal_listener_is_on_the_configured_address_not_all_interfaces(secure: Cluster) -> None:
    # 127.0.0.1 as /proc/net/tcp writes it, and the same as an IPv4-mapped IPv6 address in tcp6
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    for process in (secure.scheduler, *secure.workers):
        listeners = _listeners(process.proc.pid)
        # gRPC, metrics, and on workers the KV transfer port: at least two each, all on loopback.
        assert len(listeners) >= 2, (process.name, listeners)
        assert all(a.split(":")[0] in loopback for a in listeners), (process.name, listeners)


# --- authentication ---------------------------------------------------------------------------------

NEAR_MISS = KEY[:-1] + "8"
NO_KEY: list[tuple[str, str, str, dict[str, str]]] = [
    # (what, method, path, headers)
    ("no key", "GET", "/v1/models", {}),
    ("no key, POST", "POST", "/v1/chat/completions", {}),
    ("no key, completions", "POST", "/v1/completions", {}),
    ("no key, metrics on the API port", "GET", "/metrics", {}),
    ("no key, unknown route", "GET", "/v1/nothing", {}),
    ("double slash", "GET", "//v1/models", {}),
    ("dot segment", "GET", "/v1/../v1/models", {}),
    ("health then dot-dot", "GET", "/health/../v1/models", {}),
    ("dot", "GET", "/./v1/models", {}),
    ("encoded slash", "GET", "/v1%2Fmodels", {}),
    ("upper case", "GET", "/V1/MODELS", {}),
    ("health in upper case", "GET", "/HEALTH", {}),
    ("health with a trailing slash", "GET", "/health/", {}),
    ("health by POST", "POST", "/health", {}),
    ("odd Host header", "GET", "/v1/models", {"Host": "localhost:1"}),
    ("Host of the health route", "GET", "/v1/models", {"Host": "127.0.0.1/health"}),
    ("near-miss key", "GET", "/v1/models", bearer(NEAR_MISS)),
    ("case-flipped key", "GET", "/v1/models", bearer(KEY.swapcase())),
    ("key with a suffix", "GET", "/v1/models", bearer(KEY + "x")),
    ("key prefix", "GET", "/v1/models", bearer(KEY[:10])),
    ("empty bearer", "GET", "/v1/models", {"Authorization": "Bearer "}),
    ("basic scheme", "GET", "/v1/models", {"Authorization": f"Basic {KEY}"}),
    ("near-miss x-api-key", "GET", "/v1/models", {"x-api-key": NEAR_MISS}),
    (
        "another tenant's digest as the key",
        "GET",
        "/v1/models",
        bearer(hashlib.sha256(KEY.encode()).hexdigest()),
    ),
]


@pytest.mark.parametrize("case", NO_KEY, ids=[c[0] for c in NO_KEY])
def test_every_route_but_health_needs_a_valid_key(
    secure: Cluster, case: tuple[str, str, str, dict[str, str]]
) -> None:
    _, method, path, headers = case
    status, answer, body = call(secure, method, path, headers, b"{}" if method == "POST" else None)
    assert status == 401, (status, body)
    assert answer.get("WWW-Authenticate") == "Bearer"
    error = json.loads(body)["error"]
    assert error["type"] == "authentication_error" and set(error) == {"message", "type", "param", "code"}
    assert KEY not in body.decode() and NEAR_MISS not in body.decode()  # a key is never echoed


def test_health_needs_no_key_and_a_valid_key_opens_every_route(secure: Cluster) -> None:
    assert call(secure, "GET", "/health")[0] == 200
    assert call(secure, "HEAD", "/health")[0] == 200
    for headers in (bearer(KEY), {"Authorization": f"bearer {KEY}"}, {"x-api-key": KEY}):
        status, _, body = call(secure, "GET", "/v1/models", headers)
        assert status == 200, body
    status, _, body = call(secure, "GET", "/metrics", bearer(KEY))
    assert status == 200 and b"baton_gateway_auth_refused_total" in body
    refused = Scrape(gateway(secure).server.metrics_endpoint.url)  # the metrics port: no key needed
    assert refused.value("baton_gateway_auth_refused_total", surface="http", reason="invalid") >= 0
    before = refused.value("baton_gateway_auth_refused_total", surface="http", reason="missing")
    assert call(secure, "GET", "/v1/models")[0] == 401
    after = Scrape(gateway(secure).server.metrics_endpoint.url)
    assert after.value("baton_gateway_auth_refused_total", surface="http", reason="missing") == before + 1


def test_every_grpc_method_but_health_needs_a_valid_key(secure: Cluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    gw = gateway(secure)
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0)
    )
    unary_stream = lambda md: list(gw.stub.Generate(request, timeout=30, metadata=md))  # noqa: E731
    session = lambda md: list(  # noqa: E731
        gw.stub.Session(iter([gateway_pb2.SessionRequest(generate=request)]), timeout=30, metadata=md)
    )
    cancel = lambda md: gw.stub.Cancel(gateway_pb2.CancelRequest(request_id="r"), timeout=30, metadata=md)  # noqa: E731
    reflect = lambda md: list(  # noqa: E731
        reflection_pb2_grpc.ServerReflectionStub(gw.channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30, metadata=md
        )
    )
    for method in (unary_stream, session, cancel, reflect):
        for metadata in ((), (("authorization", f"Bearer {NEAR_MISS}"),), (("x-api-key", KEY.upper()),)):
            with pytest.raises(grpc.RpcError) as info:
                method(metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, metadata)
            assert KEY not in (info.value.details() or "")
    health = health_pb2_grpc.HealthStub(gw.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    tokens = [r for r in unary_stream((("authorization", f"Bearer {KEY}"),)) if r.HasField("delta")]
    assert tokens
    assert reflect((("x-api-key", KEY),))


# --- the KV transfer port ---------------------------------------------------------------------------


def _frame(obj: Any) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("<I", len(data)) + data


def _answered(address: str, payload: bytes) -> bytes:
    """What the KV source sends back before it closes the connection."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:  # closed with our bytes unread: refused all the same
            pass
    return got


def test_the_kv_transfer_port_drops_frames_without_the_credential_or_outside_a_lease(secure: Cluster) -> None:
    prefill = secure.workers[0]
    with prefill.channel() as channel:  # the metadata travels only over the worker's mutual-TLS port
        meta = worker_pb2_grpc.WorkerStub(channel).TransferMetadata(
            worker_pb2.TransferMetadataRequest(), timeout=10
        )
    header, _ = unpack_metadata(meta.metadata)
    assert header.backend == "tcp" and len(header.credential) == 64
    read = {"op": "read", "lease": "no-such-lease", "runs": [[0, 4]]}
    bad = {
        "no credential": _frame(read),
        "a wrong credential": _frame({**read, "credential": "0" * 64}),
        "a read outside any lease": _frame({**read, "credential": header.credential}),
        "a run outside the cache": _frame({**read, "runs": [[-1, 10**9]], "credential": header.credential}),
        "a forged release without it": _frame({"op": "notify", "kind": "release", "lease": "x"}),
        "an unknown op": _frame({"op": "write", "lease": "x", "credential": header.credential}),
        "an oversized frame": struct.pack("<I", 2**31) + b"{",
        "random bytes": os.urandom(512),
        "a truncated frame": struct.pack("<I", 100) + b'{"op": "re',
    }
    before = Scrape(worker_metrics_url(prefill)).value("baton_worker_kv_transfer_refused_total")
    for what, payload in bad.items():
        assert _answered(header.address, payload) == b"", what  # no block's byte left the source
    after = Scrape(worker_metrics_url(prefill)).value("baton_worker_kv_transfer_refused_total")
    assert after - before >= len(bad) - 1, (before, after)
    print(
        f"kv transfer port: {after - before:.0f} of {len(bad)} bad connections refused and counted, none served"
    )  # the truncated frame is a peer gone, not counted
    # The worker serves on: a disaggregated request after all that.
    test_every_grpc_method_but_health_needs_a_valid_key(secure)
    for worker in secure.workers:
        worker.wait_all_free()


# --- limits before any work -------------------------------------------------------------------------


def _engine_steps(c: Cluster) -> float:
    return sum(Scrape(worker_metrics_url(w)).value("baton_worker_steps_total") for w in c.workers)


LIMITS: list[tuple[str, dict[str, Any], int, str]] = [
    ("n", {"n": 10**6}, 400, "n must be an integer in"),
    ("best_of", {"best_of": 10**6}, 400, "must be an integer in"),
    ("logprobs", {"logprobs": 10**4}, 400, "logprobs"),
    ("max_tokens", {"max_tokens": 10**9}, 400, "over the limit of"),
    ("stop strings", {"stop": ["x"] * 10**4}, 400, "stop strings"),
    ("a long stop string", {"stop": ["x" * 10**4]}, 400, "stop"),
    ("prompts", {"prompt": ["a"] * 10**4}, 400, "prompts per request"),
    ("body size", {"prompt": "x" * (128 << 10)}, 413, "body size"),
]


@pytest.mark.parametrize("case", LIMITS, ids=[c[0] for c in LIMITS])
def test_each_limit_answers_before_any_engine_work(
    secure: Cluster, case: tuple[str, dict[str, Any], int, str]
) -> None:
    _, fields, status, needle = case
    before = _engine_steps(secure)
    body = json.dumps({"prompt": "a", "max_tokens": 2, **fields}).encode()
    got, _, answer = call(
        secure, "POST", "/v1/completions", {**bearer(KEY), "Content-Type": "application/json"}, body
    )
    assert got == status, answer[:300]
    assert needle in json.loads(answer)["error"]["message"]
    assert _engine_steps(secure) == before  # refused at the gateway: nothing reached a worker
    assert call(secure, "GET", "/health")[0] == 200


def test_oversized_headers_are_refused_and_the_gateway_serves_on(secure: Cluster) -> None:
    many = {f"x-h{i}": "v" for i in range(10_000)}
    for headers in (many, {"x-big": "v" * (100 << 10)}):
        try:
            status, _, _ = call(secure, "GET", "/health", headers)
            assert 400 <= status < 500
        except (ConnectionError, http.client.HTTPException):
            pass  # the server closed the connection without reading on: refused too
    assert call(secure, "GET", "/v1/models", bearer(KEY))[0] == 200


def test_a_client_that_trickles_its_headers_or_body_is_cut_off(secure: Cluster) -> None:
    gw = gateway(secure)
    assert gw.tls is not None
    context = ssl.create_default_context(cadata=gw.tls.ca.decode())
    # Slowloris: a header byte a second, never finished. The connection is closed at the deadline.
    with socket.create_connection(("127.0.0.1", gw.server.http_port), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            closed = False
            while time.monotonic() - start < READ_TIMEOUT_S + 10:
                try:
                    sock.sendall(b"X")
                    sock.settimeout(1.0)
                    if sock.recv(1024) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except (ConnectionError, ssl.SSLError, OSError):
                    closed = True
                    break
            assert closed, "a connection that never finished its headers was kept open"
            assert time.monotonic() - start < READ_TIMEOUT_S + 10
    # A body that never arrives: 408 with an OpenAI error body.
    conn = https(secure)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {**bearer(KEY), "Content-Type": "application/json", "Content-Length": "1000"}.items():
        conn.putheader(name, value)
    conn.endheaders(b'{"prompt": ')
    resp = conn.getresponse()
    assert resp.status == 408 and json.loads(resp.read())["error"]["message"].startswith("the request body")
    conn.close()
    assert call(secure, "GET", "/health")[0] == 200
