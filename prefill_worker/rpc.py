"""The prefill worker's RPC: `Prefill` runs a prompt, pins its KV blocks under a lease (see
`prefill_worker.handoff`) and answers the first token with the `KVHandle` a decode worker pulls from."""

from __future__ import annotations

import time

import grpc

from baton.v1 import common_pb2, worker_pb2
from core.outputs import FinishReason
from prefill_worker.handoff import PrefillHandoff
from rpc.convert import FINISH_TO_PB, delta_to_pb, handle_to_pb
from services.worker.shell import WorkerShell, final_output, outcome


class PrefillRPC:
    """`baton.v1.Worker/Prefill` on one worker's `PrefillHandoff`."""

    def __init__(self, shell: WorkerShell, handoff: PrefillHandoff) -> None:
        self.shell = shell
        self.handoff = handoff

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        shell, handoff = self.shell, self.handoff
        rid, ids, params = shell.parse(
            request.request_id, request.prompt_token_ids, request.sampling, request.epoch
        )
        t0 = time.monotonic()
        await shell.compile_constraint(params)
        stream = shell.open_stream(rid)
        done = ok = False
        error: Exception | None = None
        try:
            await shell.call(lambda e: handoff.begin(rid, ids, params, request.cache_salt))
            out, queue_s = await final_output(stream)
            handle = await shell.call(lambda e: handoff.complete(rid, out))
            done = ok = True
        except Exception as e:  # ends the call with its status (rpc.servicer)
            done, error = True, e
            raise
        finally:
            if done:
                shell.aengine.close_stream(rid)
            else:  # the caller went away mid-prefill: stop it and free its blocks
                shell.aengine.abandon(rid, lambda e: handoff.abort(rid))
            shell.metrics.request_ended("prefill", outcome(ok, error))
        now = time.monotonic()
        shell.metrics.queue.observe(queue_s)
        shell.metrics.prefill.observe(max(0.0, now - t0 - queue_s))
        resp = worker_pb2.PrefillResponse(
            first=delta_to_pb(out.token_ids[:1], out.text, out.logprobs, out.prompt_logprobs),
            usage=common_pb2.Usage(
                prompt_tokens=len(ids), completion_tokens=1, cached_tokens=out.num_cached_tokens
            ),
            prefill_ms=(now - t0) * 1e3,
        )
        if handle is not None:
            resp.handle.CopyFrom(handle_to_pb(handle))
        else:
            resp.finish_reason = FINISH_TO_PB[out.finish_reason or FinishReason.LENGTH]
            resp.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
        return resp
