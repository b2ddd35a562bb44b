"""`RequestStream`: one request's output on its way to one client — token deltas, then a `Finished` or
an error — with bounded buffering, so that a client that does not read fails alone.

The request's driver (in `services.gateway.dispatch`) pushes without ever waiting; the client's frontend
(gRPC Session/Generate, HTTP) iterates. Deltas that pile up while the client is slow are merged into
one; past ``max_buffered_tokens`` the request fails with RESOURCE_EXHAUSTED and its driver is
cancelled, which cancels the worker calls and frees the request's KV blocks. The stream also measures
how long ready output waited for the client to ask for it (``client_wait_s``: a slow reader's cost).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from core.errors import CapacityExceeded, ServingError
from core.outputs import FinishReason


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and its top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class Delta:
    """New output since the previous delta: token ids, their text, and their logprobs if asked for."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With the first token, when asked for: one per prompt token after the first (vLLM's prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] | None = None

    def extend(self, other: Delta) -> None:
        self.token_ids.extend(other.token_ids)
        self.text += other.text
        self.logprobs.extend(other.logprobs)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = other.prompt_logprobs


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache


@dataclass(frozen=True, slots=True)
class Timings:
    """Per-segment times in milliseconds (see common.proto's Timings for each one's bounds)."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a request that ended normally or was cancelled."""

    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stop_reason: str = ""


class RequestStream:
    """The client-facing end of one request: ``async for event in stream`` yields `Delta` and finally
    one `Finished`; a request that failed raises its `ServingError` after its last delta."""

    def __init__(
        self, request_id: str, max_buffered_tokens: int, on_delivered: Callable[[float], object] | None = None
    ) -> None:
        """``on_delivered(client_wait_s)`` is called once the client has taken the last event."""
        self.request_id = request_id
        self.max_buffered_tokens = max_buffered_tokens
        self.accepted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.num_tokens = 0  # tokens pushed so far
        self.cancel_reason: str | None = None
        self.client_wait_s = 0.0  # output was ready and the client had not asked for it yet
        self._on_delivered = on_delivered
        self._pending: Delta | None = None
        self._ready_at = 0.0  # when the oldest undelivered event became ready
        self._end: Finished | ServingError | None = None
        self._end_delivered = False
        self._wake = asyncio.Event()
        # Set at the second token — the prompt's KV is in place on the worker that decodes the request, and
        # in its prefix cache — or at the end, whichever comes first.
        self.decoding = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None

    def attach(self, driver: asyncio.Task[None]) -> None:
        """The task that produces this request's output; `cancel` cancels it."""
        self._driver = driver

    @property
    def driver(self) -> asyncio.Task[None] | None:
        return self._driver

    @property
    def ended(self) -> bool:
        return self._end is not None

    @property
    def finished(self) -> Finished | None:
        """The `Finished` the request ended with (None while running, or if it failed)."""
        return self._end if isinstance(self._end, Finished) else None

    # --- the driver's side ---------------------------------------------------------------------

    def push(self, delta: Delta) -> bool:
        """Buffers ``delta`` for the client; False (and the request fails) when the client lags too far."""
        if self._end is not None:
            return False
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.num_tokens += len(delta.token_ids)
        if self.num_tokens >= 2:
            self.decoding.set()
        if self._pending is None:
            self._pending = Delta(
                list(delta.token_ids), delta.text, list(delta.logprobs), delta.prompt_logprobs
            )
            self._ready_at = time.perf_counter()
        else:
            self._pending.extend(delta)
        if len(self._pending.token_ids) > self.max_buffered_tokens:
            self.cancel("slow_reader")
            self.fail(
                CapacityExceeded(
                    f"request {self.request_id}: the client did not read its stream "
                    f"({len(self._pending.token_ids)} tokens buffered, the limit is {self.max_buffered_tokens}); "
                    "the request was cancelled",
                    retry_after_s=1.0,
                )
            )
            return False
        self._wake.set()
        return True

    def finish(self, finished: Finished) -> None:
        self._end_with(finished)

    def fail(self, error: ServingError) -> None:
        self._end_with(error)

    def _end_with(self, end: Finished | ServingError) -> None:
        if self._end is None:
            self._end = end
            self.decoding.set()
            if self._pending is None:
                self._ready_at = time.perf_counter()
            self._wake.set()

    # --- anyone's side -------------------------------------------------------------------------

    def cancel(self, reason: str) -> bool:
        """Stops the request (its driver cancels the worker calls); False if it had already ended."""
        if self._end is not None or self._driver is None or self._driver.done():
            return False
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self._driver.cancel()
        return True

    # --- the client's side ---------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta | Finished:
        if (self._pending is not None or self._end is not None) and not self._end_delivered:
            # Ready before the client asked: that long, the client kept it waiting.
            now = time.perf_counter()
            self.client_wait_s += now - self._ready_at
            self._ready_at = now  # what is left (the end, after this delta) waits from now
        while True:
            if self._pending is not None:
                delta, self._pending = self._pending, None
                return delta
            if self._end is not None:
                if self._end_delivered:
                    raise StopAsyncIteration
                self._end_delivered = True
                if self._on_delivered is not None:
                    self._on_delivered(self.client_wait_s)
                if isinstance(self._end, ServingError):
                    raise self._end
                return self._end
            self._wake.clear()
            await self._wake.wait()
