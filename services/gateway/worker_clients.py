"""`WorkerClients`: the gateway's gRPC channels to its workers, keyed by address, plus the few calls
that are not part of a request's stream (start-up discovery, health probes, fire-and-forget aborts)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import grpc

from baton.v1 import worker_pb2, worker_pb2_grpc
from core.errors import ServingError, Unavailable, WorkerLost
from rpc.errors import from_rpc_error
from services.gateway.router import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


def worker_error(e: grpc.aio.AioRpcError, address: str) -> ServingError:
    """A worker call's failure as the ServingError the client sees: the worker's own error as it raised
    it (rpc.errors); a worker that is unavailable (unreachable, dying, shutting down) as `WorkerLost`,
    which the gateway may retry elsewhere."""
    err = from_rpc_error(e, address)
    if type(err) is Unavailable:
        return WorkerLost(f"worker {address} is unavailable: {err.message}", address)
    return err


class WorkerClients:
    """One channel per worker address, opened on first use and shared by all requests."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._background: set[asyncio.Task[bool]] = set()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def info(self, address: str, timeout_s: float) -> worker_pb2.InfoResponse:
        try:
            response: worker_pb2.InfoResponse = await self.stub(address).Info(
                worker_pb2.InfoRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise worker_error(e, address) from None
        return response

    async def wait_ready(
        self, addresses: Iterable[str], timeout_s: float
    ) -> dict[str, worker_pb2.InfoResponse]:
        """Info of every worker, retrying until each answers; Unavailable naming the silent ones after
        ``timeout_s`` (workers load their model before they serve, so a cluster starts in any order)."""
        pending = list(dict.fromkeys(addresses))
        infos: dict[str, worker_pb2.InfoResponse] = {}
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        last_error: dict[str, str] = {}
        while pending:
            for address in list(pending):
                try:
                    infos[address] = await self.info(address, timeout_s=2.0)
                    pending.remove(address)
                except ServingError as e:
                    last_error[address] = e.message
            if not pending:
                break
            if time.monotonic() >= deadline:
                detail = "; ".join(f"{a}: {last_error.get(a, 'no answer')}" for a in pending)
                raise Unavailable(f"workers did not answer within {timeout_s:g} s: {detail}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        return infos

    async def probe(self, addresses: Iterable[str], timeout_s: float = 1.0) -> dict[str, str | None]:
        """Address -> None if the worker answered Info, else why not."""
        unique = list(dict.fromkeys(addresses))
        results = await asyncio.gather(*(self.info(a, timeout_s) for a in unique), return_exceptions=True)
        return {
            a: None if isinstance(r, worker_pb2.InfoResponse) else str(getattr(r, "message", r))
            for a, r in zip(unique, results, strict=True)
        }

    async def abort(self, address: str, request_id: str) -> bool:
        """Aborts a request (or releases its lease) on one worker; False if it failed or was unknown."""
        try:
            response = await self.stub(address).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            log.warning("abort of %s on %s failed: %s", request_id, address, e.details())
            return False
        return bool(response.found)

    def abort_soon(self, address: str, request_id: str) -> asyncio.Task[bool]:
        """`abort` in the background: callers on a cancellation path must not wait for the worker."""
        task = asyncio.get_running_loop().create_task(self.abort(address, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        await asyncio.gather(*(c.close() for c in self._channels.values()), return_exceptions=True)
        self._channels.clear()
        self._stubs.clear()
