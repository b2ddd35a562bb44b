"""`Job`: the gateway's driver-side state of one request, from its route to its last token."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from prometheus_client import Histogram

from core.sampling_params import SamplingParams
from rpc.metrics import NONE
from services.gateway.router import LeaseReport, Route
from services.gateway.shadow import ShadowRun, TopLogprobs
from services.gateway.worker_clients import WorkerClients


@dataclass(slots=True)
class Job:
    """Driver-side state of one request: its prompt and params, where it runs, what the client has
    been sent (what a migration resumes from), and the timings gathered so far."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None  # monotonic
    api_key: str = ""
    siblings: tuple[str, ...] = ()  # an OpenAI call's other choices, charged at this one's placement
    precharged: bool = False  # an OpenAI call's other choice: charged at the first one's placement
    dispatched_at: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0
    cached_tokens: int = 0
    sent_ids: list[int] = field(default_factory=list)  # every token handed to the client's stream
    route: Route | None = None  # the current route; None until the first one
    stage: str = "prefill"  # of the current attempt: prefill | transfer (D pulls the KV) | decode
    worker: str = ""  # the worker the current stage runs on
    failed: list[str] = field(default_factory=list)  # workers this request left behind
    lease: LeaseReport | None = None  # a KV lease on P that D has not yet taken
    retries: int = 0
    kv_retries: int = 0
    migrations: int = 0
    shadow: ShadowRun | None = None  # the request mirrored to a shadow version, if the route named one
    client_logprobs: int | None = None  # what the client asked for (params ask for more while shadowed)
    prompt_logprobs_sent: bool = False  # the prompt's logprobs reached the client (they come once)
    shadow_top: list[TopLogprobs] = field(default_factory=list)  # the primary's top logprobs per token
    labels: tuple[str, str, str] = ("", NONE, NONE)  # metrics: model, version, tenant (set once placed)
    itl: Histogram | None = None  # metrics.ITL of this request's labels
    last_token_at: float = 0.0  # when the last token was handed to the client's stream
    # Aborts sent to workers after a cancel or failure; the request id stays reserved until they land,
    # so a client that reuses it at once cannot have its new request aborted by the old one's cleanup.
    aborts: list[asyncio.Task[bool]] = field(default_factory=list)

    def abort_on(self, workers: WorkerClients, address: str) -> None:
        self.aborts.append(workers.abort_soon(address, self.request_id))

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
