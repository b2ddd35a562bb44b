"""`Request`: one sequence's state inside a worker's engine — tokens, progress and lifecycle status."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

from core.outputs import FinishReason, TokenLogprobs
from core.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    """Where a request is inside one engine (the cluster-level states live in the scheduler)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class OutputConstraint(Protocol):
    """A request's structured-output state (engine.structured.Constraint): which tokens may come next."""

    @property
    def done(self) -> bool: ...

    def fill(self, bitmask: Any, row: int) -> None: ...

    def accept(self, token_id: int) -> None: ...


@dataclass(slots=True, eq=False)
class Request:
    """A sequence being served: prompt + generated tokens, and how many of them have KV in the cache.

    vLLM-style, prefill and decode are not separate code paths: each step the scheduler lets
    ``num_computed_tokens`` catch up towards ``num_tokens``; a prompt is a request whose gap is large.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str = ""  # first link of the prefix-hash chain: tenant salt + model version
    max_model_len: int = 2**31 - 1
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    num_preemptions: int = 0
    kv_lease_id: str | None = None  # prefill for a handoff: on finish, pin the blocks under this lease
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    constraint: OutputConstraint | None = None  # params.structured's matcher, over the output so far
    # params.prompt_logprobs: one entry per prompt token computed so far (None for the first token)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_token_stop(self) -> FinishReason | None:
        """Token-level stop rules after a new output token: stop ids, EOS, max_tokens, context full."""
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
