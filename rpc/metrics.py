"""Prometheus plumbing every Baton process shares (docs/METRICS.md).

`BoundedLabel` keeps a label of unbounded values (tenants) to a bounded set; `MetricsEndpoint` serves
``GET /metrics`` on a port of its own, by aiohttp on the process's event loop, after awaiting a refresh
of the values read at scrape time (Redis, an engine thread); `Forward` renders another registry inside
one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series (as vLLM)

# Request latencies (seconds); a request's segments and waits, often far below a step (an empty queue).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SEGMENT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)

DEFAULT_MAX_TENANTS = 32  # tenants with a label value of their own, per process; the rest are "other"
NONE = "none"  # a label whose value is not known (a request refused before it had a tenant)
OTHER = "other"  # the tenants past the bound


class BoundedLabel:
    """Values of a label whose set is unbounded (tenant names): the first ``limit`` distinct values keep
    their own series, every later one is reported as ``other``, so a flood of new tenants cannot blow up
    the number of series. Per process, never forgets (a restart resets it)."""

    __slots__ = ("limit", "_seen")

    def __init__(self, limit: int = DEFAULT_MAX_TENANTS) -> None:
        if limit < 0:
            raise ValueError("the label bound must be at least 0")
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if not value:
            return NONE
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return OTHER


# How long a scrape waits for its refresh (an engine thread between two steps, Redis) before it answers
# with the values read before: a slow step or a starved process must not make the page time out
# (Prometheus gives up after its scrape_timeout, 10 s by default, and marks the target down).
REFRESH_WAIT_S = 2.0


class MetricsEndpoint:
    """``GET /metrics`` of one registry on its own port (0: any free port). ``refresh`` is awaited before
    each scrape, on the event loop: it reads what must be read at scrape time (off the engine thread and
    the request path; a scrape never blocks a request). A refresh that takes longer than
    ``refresh_wait_s`` is left to finish on its own and the scrape shows the values it has."""

    def __init__(
        self,
        registry: CollectorRegistry,
        refresh: Callable[[], Awaitable[None]] | None = None,
        refresh_wait_s: float = REFRESH_WAIT_S,
    ) -> None:
        self.registry = registry
        self.refresh = refresh
        self.refresh_wait_s = refresh_wait_s
        self._pending: asyncio.Future[None] | None = None  # a refresh still running after its scrape answered
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> str:
        """Binds and serves; returns the URL of the metrics page."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.url = f"http://{host}:{int(runner.addresses[0][1])}/metrics"
        log.info("metrics on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.refresh is not None:
            await self._refreshed()
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _refreshed(self) -> None:
        """Awaits a refresh for up to ``refresh_wait_s``; one still running from an earlier scrape is
        awaited instead of starting another (a wedged engine thread does not pile up refreshes)."""
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._refresh_logged())
        try:
            # shielded: a scrape that stops waiting leaves the refresh running, its values for the next
            await asyncio.wait_for(asyncio.shield(self._pending), self.refresh_wait_s)
        except TimeoutError:
            log.warning(
                "metrics refresh still running after %.1f s: this scrape shows earlier values",
                self.refresh_wait_s,
            )

    async def _refresh_logged(self) -> None:
        assert self.refresh is not None
        try:
            await self.refresh()
        except Exception:  # a scrape shows what it has; the failure is in the log
            log.exception("metrics refresh failed")


class Forward(Collector):
    """Another registry's metrics inside this one: a process-wide registry of module-level metrics
    plus per-server collectors, rendered together."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()
