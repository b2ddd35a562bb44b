"""When requests are sent: open-loop arrival processes (Poisson, gamma, constant) and the plan that says
which requests are warm-up and when a run stops sending.

Gamma follows vLLM's `--burstiness`: inter-arrival gaps ~ Gamma(shape = burstiness, scale = 1 / (rate ·
burstiness)), so the mean rate is `rate` whatever the burstiness; 1 is Poisson, < 1 burstier, > 1
steadier. A closed loop (fixed concurrency, no arrival process) is driven by the runner.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

ARRIVALS = ("poisson", "gamma", "constant", "closed")


def arrival_gaps(kind: str, rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Seconds between successive sends, forever. An infinite rate sends everything at once."""
    if kind not in ("poisson", "gamma", "constant"):
        raise ValueError(f"no arrival process for {kind!r}")
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if kind == "gamma" and not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    rng = random.Random(f"{seed}:arrivals")
    while True:
        if math.isinf(rate):
            yield 0.0
        elif kind == "constant":
            yield 1.0 / rate
        elif kind == "poisson":
            yield rng.expovariate(rate)
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


@dataclass(slots=True)
class IssuePlan:
    """Which request comes next, whether it is warm-up, and when sending stops.

    Warm-up is the first ``warmup_requests`` requests, or those sent in the first ``warmup_seconds``;
    they run like the others but are left out of the results. Then ``num_requests`` measured requests
    are sent, or as many as start within ``duration`` seconds of the first measured one.
    """

    num_requests: int | None = None
    duration: float | None = None
    warmup_requests: int = 0
    warmup_seconds: float = 0.0
    issued: int = 0
    measured: int = 0
    started_at: float | None = None
    measure_start: float | None = None

    def take(self, now: float) -> bool | None:
        """Claims the next request at time ``now``: True = warm-up, False = measured, None = stop."""
        if self.started_at is None:
            self.started_at = now
        warmup = self.issued < self.warmup_requests or now - self.started_at < self.warmup_seconds
        if not warmup:
            if self.measure_start is None:
                self.measure_start = now
            if self.num_requests is not None and self.measured >= self.num_requests:
                return None
            if self.duration is not None and now - self.measure_start >= self.duration:
                return None
            self.measured += 1
        self.issued += 1
        return warmup

    @property
    def total(self) -> int | None:
        """Requests the run will send, when that is known in advance (for the progress bar)."""
        if self.num_requests is None or self.warmup_seconds > 0:
            return None
        return self.num_requests + self.warmup_requests
