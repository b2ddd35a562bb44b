"""What an engine says about a request as it runs: the one `FinishReason`, a token's `TokenLogprobs`,
and `RequestOutput`, one per step that changed the request.

Outputs are deltas: each carries what that step added (``new_*``), nothing is copied per step; the
final output also carries the whole (``token_ids``, ``text``, ``logprobs``), built once. Every hop
speaks this vocabulary (proto and OpenAI spellings are made at their edges: rpc.convert, the gateway's
OpenAI module), so a cancelled request is `FinishReason.CANCELLED` from the engine to the client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from core.errors import ServingError


class FinishReason(enum.StrEnum):
    """Why a request ended."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    CANCELLED = "cancelled"  # by the client, a deadline, or an error (then the output's ``error`` says which)

    @property
    def completed(self) -> bool:
        """The request ran to its end (stop or length), as opposed to being cancelled."""
        return self is not FinishReason.CANCELLED


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token, from the raw logits. ``rank`` is 1 + the number of strictly more
    likely tokens (1 = most likely); ``top`` holds the ``params.logprobs`` most likely (token id, logprob)
    pairs, best first (empty for ``logprobs=0``)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """One step's news of a request: ``new_*`` is what this step added; once ``finished``, ``token_ids``,
    ``text`` and ``logprobs`` hold the whole output (empty on earlier outputs: nothing is copied per step)."""

    request_id: str
    prompt_token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    num_output_tokens: int = 0  # output tokens so far (resumed ones included)
    new_logprobs: list[TokenLogprobs] | None = None  # of new_token_ids, when asked for
    # On the output with the first sampled token, when asked for: one per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: ServingError | None = None  # set when the request ended because of an error
    # On the request's first output after the event (0.0 on every other output), for metrics:
    queue_s: float = 0.0  # added -> first scheduled (requests that entered the waiting queue)
    transfer_s: float = 0.0  # its KV pull: started -> landed (disaggregated only)
    # The whole output, on the final output only:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
