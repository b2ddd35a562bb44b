"""`WorkerShell`: what a worker's RPC handlers share, whatever the role — the engine thread, the KV
transport, the config, the metrics, the cancels heard on the bus — and the request checks every
handler makes. The role's own handlers (`prefill_worker.rpc`, `decode_worker.rpc`) are built on it;
`services.worker.server` puts them behind one `baton.v1.Worker` service."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from core.errors import InvalidRequest, RequestAborted, ServingError, WorkerDraining, WorkerFenced
from core.outputs import RequestOutput
from core.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine, OutputStream
from engine.llm_engine import LLMEngine
from engine.structured import COMPILE_TIMEOUT_S
from kv_transfer.transport import KVTransport
from rpc.convert import sampling_from_pb
from rpc.tls import Tls
from services.worker.config import WorkerConfig
from services.worker.membership import RecentCancels
from services.worker.metrics import WorkerMetrics

T = TypeVar("T")


class WorkerShell:
    """One worker process's shared state. Every engine access goes through the engine thread."""

    def __init__(
        self,
        config: WorkerConfig,
        aengine: AsyncEngine,
        transport: KVTransport,
        address: str,
        tls: Tls | None = None,
    ) -> None:
        self.config = config
        self.tls = tls  # this worker's identity on its calls to peers (``--tls-dir``)
        self.aengine = aengine
        self.transport = transport
        self.address = address
        self.model_name = config.served_model_name or aengine.engine.model_dir.name
        self.recent_cancels = RecentCancels()  # filled by the cancellation bus, if this worker listens
        self.draining = False  # SIGTERM came: no new request is taken
        self.fenced_epoch = 0  # the last registration this worker was fenced out of (membership)
        self.metrics = WorkerMetrics(self.model_name, transport.layout.model_digest, config.role, address)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn`` on the engine thread (a ServingError it raises ends the RPC: rpc.servicer)."""
        return await self.aengine.call(fn)

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compiles a request's structured-output constraint in the thread pool, before the request
        reaches the engine thread (which then finds it cached): a compile never stalls the batch. One
        that takes over ``COMPILE_TIMEOUT_S`` is refused (the compile finishes in the background)."""
        if params.structured is None:
            return
        loop = asyncio.get_running_loop()
        compiling = loop.run_in_executor(None, self.aengine.engine.grammars.compile, params.structured)
        try:
            await asyncio.wait_for(compiling, COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise InvalidRequest(
                f"the {params.structured.kind} constraint took over {COMPILE_TIMEOUT_S:.0f} s to compile"
            ) from None

    def open_stream(self, rid: str) -> OutputStream:
        return self.aengine.open_stream(rid)  # an id in use here: InvalidRequest

    def parse(
        self, rid: str, ids: Any, sampling: Any, epoch: int = 0
    ) -> tuple[str, list[int], SamplingParams]:
        """A Prefill's or Decode's id, prompt and sampling, checked; ``epoch``: the registration the
        scheduler placed it on (0: any)."""
        if epoch and epoch <= self.fenced_epoch:  # placed on a life of this worker that was fenced
            raise WorkerFenced(
                f"worker {self.address} was fenced out of registration {epoch} (it missed its "
                "heartbeats); the request goes on on another worker",
                self.address,
            )
        if not rid:
            raise InvalidRequest("request_id is required")
        if not ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        if rid in self.recent_cancels:  # the cancel overtook the request
            raise RequestAborted(f"request {rid} was cancelled before it arrived")
        if self.draining:  # placed here just before the drain began: the caller places it again
            raise WorkerDraining(f"worker {self.address} is shutting down and takes no new request")
        return rid, list(ids), sampling_from_pb(sampling)


async def final_output(stream: OutputStream) -> tuple[RequestOutput, float]:
    """A request's final output, and how long it waited to be scheduled."""
    queue_s = 0.0
    while True:
        out = await stream.get()
        queue_s = queue_s or out.queue_s
        if out.finished:
            return out, queue_s


def outcome(ok: bool, error: BaseException | None) -> str:
    """A call's ``outcome`` label: ok, cancelled (the caller went away), or the gRPC code it ended with."""
    if ok:
        return "ok"
    if error is None:
        return "cancelled"
    return error.grpc_code if isinstance(error, ServingError) else "INTERNAL"
