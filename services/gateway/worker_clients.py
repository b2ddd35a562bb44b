"""`WorkerClients`: the gateway's gRPC channels to its workers, keyed by address, and every call it
makes on them — a request's legs (`prefill`, `decode`, typed: the dispatcher and the shadow path see
no proto) and the calls outside a request's stream (start-up discovery, health probes, aborts)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass

import grpc

from baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from core.errors import ServingError, Unavailable, WorkerLost
from core.outputs import FinishReason
from core.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle
from rpc.convert import FINISH_FROM_PB, handle_from_pb, handle_to_pb, sampling_to_pb
from rpc.errors import from_rpc_error
from rpc.liveness import KEEPALIVE_S, keepalive_options
from rpc.tls import Tls
from rpc.tls import channel as tls_channel
from services.gateway.convert import delta_from_pb
from services.gateway.request_stream import Delta
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


@dataclass(frozen=True, slots=True)
class Leg:
    """What one Prefill or Decode call carries of a request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    timeout_s: float | None = None
    epoch: int = 0  # the registration of the worker called that the scheduler placed it on (0: any)


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A Prefill's answer: the first token and the KV handle to decode from; ``finish_reason`` set when
    that token already ended the request (a handle may still come back: the caller releases it)."""

    first: Delta
    handle: KVHandle | None
    finish_reason: FinishReason | None
    stop_reason: str
    completion_tokens: int
    cached_tokens: int
    prefill_ms: float


@dataclass(frozen=True, slots=True)
class Decoded:
    """The end of a Decode stream."""

    finish_reason: FinishReason
    stop_reason: str
    completion_tokens: int
    cached_tokens: int
    prefill_ms: float  # on this worker (a decode worker that prefilled itself)
    transfer_ms: float
    decode_ms: float


def _finish(code: int) -> FinishReason | None:
    return (
        None if code == common_pb2.FINISH_REASON_UNSPECIFIED else FINISH_FROM_PB.get(code, FinishReason.STOP)
    )


class WorkerClients:
    """One channel per worker address, opened on first use and shared by all requests."""

    def __init__(self, tls: Tls | None = None, keepalive_s: float = KEEPALIVE_S) -> None:
        self._tls = tls
        self._options = (*CHANNEL_OPTIONS, *keepalive_options(keepalive_s))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._background: set[asyncio.Task[bool]] = set()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = tls_channel(address, self._tls, self._options)
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

    async def prefill(self, address: str, leg: Leg) -> Prefilled:
        """Prefill on ``address``; cancelled, the call is cancelled (the worker frees what it holds)."""
        request = worker_pb2.PrefillRequest(
            request_id=leg.request_id,
            prompt_token_ids=leg.prompt_ids,
            sampling=sampling_to_pb(leg.params),
            cache_salt=leg.cache_salt,
            epoch=leg.epoch,
        )
        call = self.stub(address).Prefill(request, timeout=leg.timeout_s)
        try:
            r: worker_pb2.PrefillResponse = await call
        except grpc.aio.AioRpcError as e:
            raise worker_error(e, address) from None
        finally:
            call.cancel()  # a no-op once it has finished; aborts the prefill if we were cancelled
        if not r.first.token_ids:
            raise Unavailable(f"prefill worker {address} returned no first token")
        return Prefilled(
            delta_from_pb(r.first),
            handle_from_pb(r.handle) if r.HasField("handle") else None,
            _finish(r.finish_reason),
            r.stop_reason,
            r.usage.completion_tokens,
            r.usage.cached_tokens,
            r.prefill_ms,
        )

    async def decode(
        self,
        address: str,
        leg: Leg,
        handle: KVHandle | None = None,
        first_token: int | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> AsyncGenerator[Delta | Decoded, None]:
        """Decode on ``address``: a `Delta` per message (possibly empty: the first says the KV has
        landed), then one `Decoded`. With ``handle`` the worker pulls the KV and continues after
        ``first_token``; with ``resume_token_ids`` it recomputes them first (a migration). Closed
        early, the call is cancelled and the worker drops the request."""
        request = worker_pb2.DecodeRequest(
            request_id=leg.request_id,
            prompt_token_ids=leg.prompt_ids,
            sampling=sampling_to_pb(leg.params),
            cache_salt=leg.cache_salt,
            resume_token_ids=list(resume_token_ids),
            epoch=leg.epoch,
        )
        if handle is not None:
            request.handle.CopyFrom(handle_to_pb(handle))
            assert first_token is not None
            request.first_token = first_token
        last: worker_pb2.DecodeResponse | None = None
        call = self.stub(address).Decode(request, timeout=leg.timeout_s)
        try:
            async for msg in call:
                yield delta_from_pb(msg.delta)
                if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    last = msg
        except grpc.aio.AioRpcError as e:
            raise worker_error(e, address) from None
        finally:
            call.cancel()  # a no-op once it has finished; otherwise the worker aborts and frees blocks
        if last is None:
            raise Unavailable(f"decode worker {address} ended the stream without a finish reason")
        yield Decoded(
            _finish(last.finish_reason) or FinishReason.STOP,
            last.stop_reason,
            last.usage.completion_tokens,
            last.usage.cached_tokens,
            last.prefill_ms,
            last.transfer_ms,
            last.decode_ms,
        )

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
