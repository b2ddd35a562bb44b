"""The decode worker's RPC: `Decode` pulls a request's KV blocks from the prefill worker named in its
handle (fetching that peer's transfer metadata over gRPC once; see `decode_worker.handoff`), or
prefills locally, then streams tokens until the request ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import grpc

from baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from core.errors import InvalidRequest, KVIncompatible, KVTransferFailed, ServingError
from decode_worker.handoff import DecodeHandoff
from rpc.convert import FINISH_TO_PB, delta_to_pb, handle_from_pb, sampling_from_pb
from rpc.tls import channel
from services.worker.shell import WorkerShell, outcome

METADATA_TIMEOUT_S = 5.0


class DecodeRPC:
    """`baton.v1.Worker/Decode` on one worker's `DecodeHandoff`, and the peers it pulls from."""

    def __init__(self, shell: WorkerShell, handoff: DecodeHandoff) -> None:
        self.shell = shell
        self.handoff = handoff
        self._peers: dict[str, asyncio.Future[None]] = {}  # source address → metadata fetched

    async def decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[worker_pb2.DecodeResponse, None]:
        shell, handoff = self.shell, self.handoff
        rid, ids, params = shell.parse(
            request.request_id, request.prompt_token_ids, request.sampling, request.epoch
        )
        t0 = time.monotonic()
        await shell.compile_constraint(params)
        stream = shell.open_stream(rid)
        finished = ok = False
        error: Exception | None = None
        pulled = request.HasField("handle")
        peer = request.handle.source if pulled else ""
        num_bytes = 0
        try:
            try:
                if pulled:
                    num_bytes = await self._start_pull(rid, ids, request)
                else:
                    resume = list(request.resume_token_ids)
                    await shell.call(
                        lambda e: e.add_request(
                            rid, ids, params, cache_salt=request.cache_salt, resume_token_ids=resume
                        )
                    )
            except ServingError:
                # Refused before it entered the engine (e.g. the prefill worker's metadata could not be
                # fetched): nothing to abort, and its id is free at once, so the gateway's retry of the
                # same request here is not refused as a reuse.
                finished = True
                raise
            t_first: float | None = None
            queue_s = transfer_s = 0.0
            while not finished:
                try:
                    out = await stream.get()
                except ServingError:
                    finished = True  # the engine already ended it (slow reader)
                    raise
                if out.error is not None:
                    finished = True
                    if isinstance(out.error, KVTransferFailed) and pulled:
                        self._peers.pop(peer, None)  # refetch its metadata next time
                        shell.metrics.transfer_failed(peer)
                    raise out.error
                if out.transfer_s:  # the pull landed
                    transfer_s = out.transfer_s
                    shell.metrics.transfer_landed(peer, transfer_s, num_bytes)
                queue_s = queue_s or out.queue_s
                n_new = len(out.new_token_ids)
                msg = worker_pb2.DecodeResponse(
                    delta=delta_to_pb(out.new_token_ids, out.new_text, out.new_logprobs, out.prompt_logprobs)
                )
                now = time.monotonic()
                if t_first is None and n_new:
                    t_first = now
                    if not pulled:  # prefilled here
                        shell.metrics.queue.observe(queue_s)
                        shell.metrics.prefill.observe(max(0.0, now - t0 - queue_s))
                if out.finish_reason is not None:
                    finished, ok = True, out.finish_reason.completed
                    msg.finish_reason = FINISH_TO_PB[out.finish_reason]
                    msg.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=len(ids),
                            completion_tokens=out.num_output_tokens,
                            cached_tokens=out.num_cached_tokens,
                        )
                    )
                    msg.transfer_ms = transfer_s * 1e3
                    msg.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
                    if not pulled and t_first is not None:
                        msg.prefill_ms = (t_first - t0) * 1e3
                    msg.decode_ms = (now - (t_first or now)) * 1e3
                    if ok:
                        shell.metrics.decode.observe(now - (t_first or now))
                yield msg
        except Exception as e:  # ends the call with its status (rpc.servicer)
            error = e
            raise
        finally:
            if finished:
                shell.aengine.close_stream(rid)
            else:  # cancelled, deadline passed or the client went away
                shell.aengine.abandon(rid, lambda e: handoff.abort(rid))
            shell.aengine.post(lambda e: handoff.forget(rid))
            shell.metrics.request_ended("decode", outcome(ok, error))

    async def _start_pull(self, rid: str, ids: list[int], request: worker_pb2.DecodeRequest) -> int:
        """Starts pulling the handle's blocks; returns the bytes it pulls (the blocks not cached here)."""
        shell, handoff = self.shell, self.handoff
        handle = handle_from_pb(request.handle) if request.handle.lease_id else None
        if handle is None or not request.HasField("first_token"):
            raise InvalidRequest("a handoff needs a complete KV handle and the first token")
        params = sampling_from_pb(request.sampling)
        timeout = request.transfer_timeout_s or shell.config.transfer_timeout_s
        try:
            await self._ensure_peer(handle.source)
            num_blocks = await shell.aengine.call(
                lambda e: handoff.start(
                    rid,
                    ids,
                    request.first_token,
                    handle,
                    params,
                    timeout_s=timeout,
                    cache_salt=request.cache_salt,
                )
            )
        except (KVTransferFailed, KVIncompatible):
            shell.metrics.transfer_failed(handle.source)
            raise
        return num_blocks * shell.transport.layout.block_bytes

    async def _ensure_peer(self, source: str) -> None:
        """Fetches a prefill worker's transfer metadata once (concurrent requests share the fetch)."""
        fut = self._peers.get(source)
        if fut is None:
            fut = self._peers[source] = asyncio.ensure_future(self._fetch_peer(source))
        try:
            await asyncio.shield(fut)
        except BaseException:
            if self._peers.get(source) is fut and fut.done():
                del self._peers[source]
            raise

    async def _fetch_peer(self, source: str) -> None:
        try:
            async with channel(source, self.shell.tls) as peer:
                meta = await worker_pb2_grpc.WorkerStub(peer).TransferMetadata(
                    worker_pb2.TransferMetadataRequest(), timeout=METADATA_TIMEOUT_S
                )
        except grpc.aio.AioRpcError as e:
            raise KVTransferFailed(f"cannot fetch KV transfer metadata from {source}: {e.details()}") from e
        await self.shell.aengine.call(lambda e: self.handoff.add_peer(meta.metadata))
