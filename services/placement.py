"""Where a request runs: the gateway's placement seam. Static for now (worker addresses from the config,
round-robin); the cluster scheduler (issue 5) replaces `StaticPlacer` behind the same `Placer` protocol."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from core.errors import Unavailable


@dataclass(frozen=True, slots=True)
class Placement:
    """The workers of one request: ``prefill`` is None when the decode worker prefills it itself."""

    decode: str
    prefill: str | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class Placer(Protocol):
    """Picks the workers of a request from its prompt length (the scheduler adds load and KV overlap)."""

    def place(self, num_prompt_tokens: int) -> Placement: ...


class StaticPlacer:
    """Round-robin over configured prefill and decode workers.

    A prompt shorter than ``local_prefill_threshold`` tokens, or no prefill worker at all, skips the
    prefill pool: a short prompt costs less to prefill on the decode worker than to ship as KV.
    """

    def __init__(
        self, prefill_workers: Sequence[str], decode_workers: Sequence[str], local_prefill_threshold: int = 0
    ) -> None:
        if not decode_workers:
            raise Unavailable("no decode workers are configured")
        self.prefill_workers = tuple(prefill_workers)
        self.decode_workers = tuple(decode_workers)
        self.local_prefill_threshold = local_prefill_threshold
        self._next_prefill = itertools.cycle(self.prefill_workers)
        self._next_decode = itertools.cycle(self.decode_workers)

    def place(self, num_prompt_tokens: int) -> Placement:
        decode = next(self._next_decode)
        if not self.prefill_workers or num_prompt_tokens < self.local_prefill_threshold:
            return Placement(decode=decode)
        return Placement(decode=decode, prefill=next(self._next_prefill))
