"""`MetricsEndpoint` on a real loopback port: a refresh that does not come back (an engine thread stuck
in a long step, a starved process) must not make the page time out — the scrape answers with the values
read before, and later scrapes wait on the same refresh instead of piling up new ones."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client import CollectorRegistry, Gauge

from rpc.metrics import MetricsEndpoint


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        body: bytes = r.read()
    return body.decode()


def test_a_refresh_that_hangs_leaves_the_scrape_the_values_it_has() -> None:
    async def main() -> None:
        registry = CollectorRegistry()
        gauge = Gauge("baton_test_value", "a value read at scrape time", registry=registry)
        gauge.set(1)
        release = asyncio.Event()
        calls = 0

        async def refresh() -> None:
            nonlocal calls
            calls += 1
            await release.wait()  # as an engine thread that has not reached a step boundary
            gauge.set(2)

        endpoint = MetricsEndpoint(registry, refresh, refresh_wait_s=0.2)
        url = await endpoint.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        try:
            for _ in range(2):
                page = await loop.run_in_executor(None, _scrape, url)
                assert "baton_test_value 1.0" in page
            assert calls == 1  # the second scrape waited on the first one's refresh
            release.set()
            await asyncio.sleep(0)
            page = await loop.run_in_executor(None, _scrape, url)
            assert "baton_test_value 2.0" in page
        finally:
            await endpoint.stop()

    asyncio.run(main())


def test_a_refresh_that_fails_still_gives_a_page() -> None:
    async def main() -> None:
        registry = CollectorRegistry()
        Gauge("baton_test_value", "a value read at scrape time", registry=registry).set(3)

        async def refresh() -> None:
            raise RuntimeError("redis went away")

        endpoint = MetricsEndpoint(registry, refresh)
        url = await endpoint.start("127.0.0.1", 0)
        try:
            page = await asyncio.get_running_loop().run_in_executor(None, _scrape, url)
            assert "baton_test_value 3.0" in page
        finally:
            await endpoint.stop()

    asyncio.run(main())
