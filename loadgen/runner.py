"""The run itself: sends the workload's requests to a target on an arrival process (open loop) or at a
fixed concurrency (closed loop), with warm-up, and returns every request's record."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from loadgen.arrivals import IssuePlan, arrival_gaps
from loadgen.record import RequestRecord
from loadgen.targets import Target
from loadgen.workload import RequestSpec, Workload


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How and how much to send; the `loadgen run` arrival flags by the same names."""

    arrival: str = "poisson"  # poisson | gamma | constant | closed
    rate: float = math.inf  # requests per second (open loop); inf = all at once
    burstiness: float = 1.0  # gamma shape
    concurrency: int | None = None  # closed loop: the fixed concurrency; open loop: a cap (None = none)
    num_requests: int | None = 100  # measured requests, or None with a duration
    duration: float | None = None  # seconds of measured sending
    warmup_requests: int = 0
    warmup_seconds: float = 0.0
    seed: int = 0
    progress: bool = True


async def run_load(target: Target, workload: Workload, plan: RunPlan) -> list[RequestRecord]:
    """Sends the requests and waits for all of them; the records in send order (warm-up included)."""
    issue = IssuePlan(plan.num_requests, plan.duration, plan.warmup_requests, plan.warmup_seconds)
    # With a known count, every prompt is built before the clock starts (tokenizing takes time).
    specs = [workload.sample(i) for i in range(issue.total)] if issue.total is not None else []
    records: list[RequestRecord] = []
    limit = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    bar = tqdm(
        total=issue.total,
        disable=not plan.progress,
        unit="req",
        desc="loadgen",
        file=sys.stderr,
        dynamic_ncols=True,
    )

    def claim(now: float) -> tuple[RequestSpec, RequestRecord] | None:
        warmup = issue.take(now)
        if warmup is None:
            return None
        index = issue.issued - 1
        spec = specs[index] if index < len(specs) else workload.sample(index)
        record = RequestRecord(spec.index, spec.prompt_len, spec.output_len, spec.tenant, warmup)
        records.append(record)
        return spec, record

    async def send(spec: RequestSpec, record: RequestRecord) -> None:
        if limit is None:
            await target.send(spec, record)
        else:
            async with limit:
                await target.send(spec, record)
        bar.update(1)

    async def closed_loop_client() -> None:
        while (claimed := claim(time.perf_counter())) is not None:
            await send(*claimed)

    try:
        if plan.arrival == "closed":
            await asyncio.gather(*(closed_loop_client() for _ in range(plan.concurrency or 1)))
        else:
            tasks: list[asyncio.Task[None]] = []
            gaps = arrival_gaps(plan.arrival, plan.rate, plan.burstiness, plan.seed)
            due = time.perf_counter()
            while (claimed := claim(due)) is not None:
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.get_running_loop().create_task(send(*claimed)))
                due += next(gaps)
            await asyncio.gather(*tasks)
    finally:
        bar.close()
    return records
