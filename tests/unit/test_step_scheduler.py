"""StepScheduler driven by hand-built model outputs: no model, no torch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import InvalidRequest
from core.kv_cache import KVCacheManager
from core.outputs import FinishReason
from core.request import Request, RequestId, RequestStatus
from core.sampling_params import SamplingParams
from core.step_scheduler import RECENT_WINDOW_S, SchedulerConfig, SchedulerOutput, StepScheduler

pytestmark = pytest.mark.unit

BS = 4


def req(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(RequestId(rid), [base + i for i in range(n_prompt)], params, seed=0)


def fake_token(r: Request) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return (sum(r.all_token_ids) * 31 + r.num_tokens) % 1000


def step(s: StepScheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    assert out.num_tokens <= s.config.max_num_batched_tokens
    assert len(out.scheduled) <= s.config.max_num_seqs
    sampled = {x.request.request_id: fake_token(x.request) for x in out.scheduled if x.samples}
    finished = s.update(out, sampled)
    s.check_integrity()
    return out, finished


def run_all(s: StepScheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished:
            break
        _, finished = step(s)
        for r in finished:
            outputs[r.request_id] = list(r.output_token_ids)
    assert not s.has_unfinished, "requests did not finish"
    assert s.kv.num_free_blocks == s.kv.num_blocks, "blocks leaked"
    return outputs


def make(num_blocks: int = 64, **cfg: int) -> StepScheduler:
    cfg.setdefault("max_num_seqs", 8)
    return StepScheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, BS))


def test_continuous_batching_admits_as_others_finish() -> None:
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i, mt in enumerate([1, 5, 3]):
        s.add_request(req(f"r{i}", 3, max_tokens=mt, base=10 * i))
    out, finished = step(s)  # r0, r1 prefill; r0 finishes at once (max_tokens 1)
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in finished] == ["r0"]
    out, _ = step(s)  # r2 takes the freed seat while r1 decodes
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"r1": 1, "r2": 3}
    outputs = run_all(s)
    assert len(outputs["r1"]) == 5 and len(outputs["r2"]) == 3


def test_chunked_prefill_puts_decodes_first_and_caps_chunks() -> None:
    s = make(max_num_batched_tokens=16, long_prefill_chunk=8)
    s.add_request(req("short", 2, max_tokens=20))
    step(s)
    s.add_request(req("long", 40, max_tokens=2, base=100))
    chunks = []
    while s.requests["long"].num_computed_tokens < 40:
        out, _ = step(s)
        ids = [x.request.request_id for x in out.scheduled]
        assert ids[0] == "short", "the running decode goes first in every step"
        chunks.append(next(x.num_new_tokens for x in out.scheduled if x.request.request_id == "long"))
    assert chunks == [8] * 5


def test_running_decodes_cap_the_prompt_tokens_of_their_step() -> None:
    s = make(max_num_batched_tokens=64, long_prefill_chunk=32, mixed_prefill_tokens=6)
    s.add_request(req("alone", 40, max_tokens=30))
    out, _ = step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [32], "no decodes running: the whole chunk"
    step(s)  # the rest of its prompt; it decodes from here on
    a, b = req("a", 20, max_tokens=30, base=100), req("b", 20, max_tokens=30, base=200)
    s.add_request(a)
    s.add_request(b)
    per_step = []
    while a.num_computed_tokens < 20 or b.num_computed_tokens < 20:
        out = s.schedule()
        assert out.scheduled[0].request.request_id == "alone" and out.scheduled[0].num_new_tokens == 1
        per_step.append(
            sum(
                x.num_new_tokens
                for x in out.scheduled
                if x.request.request_id != "alone"
                and x.request.num_computed_tokens < x.request.num_prompt_tokens
            )
        )
        s.update(out, {x.request.request_id: fake_token(x.request) for x in out.scheduled if x.samples})
    assert sum(per_step) == 40 and max(per_step) == 6, (
        per_step
    )  # beside a decode: at most 6 prompt tokens a step
    with pytest.raises(ValueError, match="must not be negative"):
        SchedulerConfig(mixed_prefill_tokens=-1)


def test_short_prompt_shares_steps_with_a_long_one() -> None:
    s = make(max_num_batched_tokens=16, long_prefill_chunk=10)
    s.add_request(req("long", 100, max_tokens=1))
    s.add_request(req("short", 5, max_tokens=1, base=500))
    out, finished = step(s)
    got = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
    assert got == {"long": 10, "short": 5}, "the long prompt is capped, the short one fits beside it"
    assert [r.request_id for r in finished] == ["short"]
    out, _ = step(s)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"long": 10}


def test_fcfs_long_prompt_is_not_overtaken_forever() -> None:
    s = make(num_blocks=64, max_num_batched_tokens=8, long_prefill_chunk=4)
    s.add_request(req("long", 60, max_tokens=1))
    for i in range(10):
        s.add_request(req(f"s{i}", 2, max_tokens=1, base=1000 + 10 * i))
    progress = []
    for _ in range(5):
        step(s)
        progress.append(s.requests["long"].num_computed_tokens if "long" in s.requests else 60)
    assert progress == sorted(progress) and progress[-1] >= 20, "the long prompt advances every step"


def tenant_req(rid: str, tenant: str, n_prompt: int, max_tokens: int = 1, base: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(RequestId(rid), [base + i for i in range(n_prompt)], params, seed=0, cache_salt=tenant)


def test_a_quiet_tenants_prompt_overtakes_a_flood_at_the_next_step() -> None:
    s = make(num_blocks=128, max_num_batched_tokens=8, long_prefill_chunk=8)
    for i in range(4):
        s.add_request(tenant_req(f"f{i}", "flood", 16, base=100 * i))
    step(s)  # f0's first chunk
    assert s.requests["f0"].num_computed_tokens == 8
    s.add_request(tenant_req("q0", "quiet", 8, base=5000))
    out, finished = step(s)  # quiet was served nothing: it goes before f0's second chunk
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("q0", 8)]
    assert [r.request_id for r in finished] == ["q0"]
    out, _ = step(s)  # then the flood resumes where it was
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("f0", 8)]
    run_all(s)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_heavy_tenants_prompts_are_chunked_and_yield_the_step_to_a_light_prompt() -> None:
    """A prefill worker's view: one prompt at a time, whole, while one tenant is alone; once another
    tenant's prompts were seen here recently, the tenant with more than twice its recent prompt tokens
    is heavy — its prompts go in heavy_prefill_chunk pieces, and a light prompt that arrives mid-way
    runs alone in the next step — until that tenant has not been seen for RECENT_WINDOW_S."""
    clock = Clock()
    s = StepScheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=256, long_prefill_chunk=256, heavy_prefill_chunk=8
        ),
        KVCacheManager(256, BS),
        clock,
    )

    bases = iter(range(10_000, 10**6, 1000))  # no two prompts share a block: no prefix-cache hits

    def prefill_alone(rid: str, tenant: str, n: int) -> list[int]:
        s.add_request(tenant_req(rid, tenant, n, base=next(bases)))
        chunks = []
        while rid in s.requests:
            out, _ = step(s)
            chunks += [x.num_new_tokens for x in out.scheduled if x.request.request_id == rid]
            clock.now += 0.1
        return chunks

    for i in range(5):
        assert prefill_alone(f"f{i}", "flood", 24) == [24]  # alone: never heavy, one step a prompt
    assert prefill_alone("q0", "quiet", 8) == [8]  # quiet: far fewer prompt tokens here
    s.add_request(tenant_req("f5", "flood", 24, base=9000))
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("f5", 8)]  # heavy now
    s.add_request(tenant_req("q1", "quiet", 12, base=7000))  # a light prompt arrives mid-way
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("q1", 12)]  # alone
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("f5", 8)]
    run_all(s)
    clock.now += RECENT_WINDOW_S + 1  # the quiet tenant has not been seen for a while
    assert prefill_alone("f6", "flood", 24) == [24]


def test_no_tenant_is_heavy_unless_asked() -> None:
    clock = Clock()
    s = StepScheduler(SchedulerConfig(max_num_batched_tokens=256), KVCacheManager(256, BS), clock)
    for i in range(4):
        s.add_request(tenant_req(f"f{i}", "flood", 24, base=100 * i))
        run_all(s)
    s.add_request(tenant_req("q", "quiet", 4, base=5000))
    run_all(s)
    s.add_request(tenant_req("f9", "flood", 24, base=9000))
    out, _ = step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [24]
    with pytest.raises(ValueError):
        SchedulerConfig(heavy_prefill_chunk=-1)


def test_tenants_share_prompt_tokens_alike_not_requests() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=8, long_prefill_chunk=8, max_num_seqs=8)
    for i in range(12):  # a sends many small prompts, b a few large ones
        s.add_request(tenant_req(f"a{i}", "a", 4, base=100 * i))
    for i in range(3):
        s.add_request(tenant_req(f"b{i}", "b", 16, base=5000 + 100 * i))
    served = {"a": 0, "b": 0}
    for _ in range(6):  # both stay backlogged through these steps
        out, _ = step(s)
        for x in out.scheduled:
            served[x.request.cache_salt] += x.num_new_tokens
    assert served["a"] == served["b"] == 24


def test_preemption_victim_is_least_work_then_latest_arrival() -> None:
    s = make(num_blocks=8, max_num_batched_tokens=64)
    s.add_request(req("a", 7, max_tokens=20))
    s.add_request(req("b", 3, max_tokens=20, base=50))
    s.add_request(req("c", 3, max_tokens=20, base=80))
    step(s)  # a: 2 blocks, b: 1, c: 1; 4 left minus reserve
    preempted: list[str] = []
    for _ in range(30):
        out, _ = step(s)
        preempted += out.preempted
        if preempted:
            break
    assert preempted, "the cache is too small for all three, so something must be preempted"
    # b and c have computed the same number of tokens (fewer than a); c arrived last.
    assert preempted[0] == "c"
    victim = s.requests["c"]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert not s.kv.block_ids(victim.request_id)
    assert s.waiting[0] is victim


def test_preemption_gives_same_outputs_as_a_large_cache() -> None:
    def outputs(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        s = make(num_blocks=num_blocks, max_num_batched_tokens=32, long_prefill_chunk=8)
        for i in range(6):
            s.add_request(req(f"r{i}", 5 + 3 * i, max_tokens=12, base=7 * i))
        return run_all(s), s.num_preemptions

    big, n_big = outputs(200)
    small, n_small = outputs(12)
    assert n_big == 0 and n_small > 0
    assert small == big


def test_abort_frees_blocks_at_once_and_is_idempotent() -> None:
    s = make()
    s.add_request(req("a", 10, max_tokens=10))
    s.add_request(req("b", 10, max_tokens=10, base=20))
    step(s)
    used = s.kv.num_used_blocks
    r = s.abort(RequestId("a"))
    assert r is not None and r.finish_reason is FinishReason.CANCELLED
    assert s.kv.num_used_blocks < used
    assert s.abort(RequestId("a")) is None
    s.add_request(req("w", 3))
    assert s.abort(RequestId("w")) is not None, "a waiting request can be aborted too"
    s.check_integrity()
    run_all(s)


def test_abort_during_a_step_discards_its_result() -> None:
    s = make()
    s.add_request(req("a", 4, max_tokens=5))
    out = s.schedule()
    s.abort(RequestId("a"))  # e.g. the client cancelled while the forward ran
    assert s.update(out, {RequestId("a"): 1}) == []
    s.check_integrity()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_requests_that_can_never_fit_are_rejected() -> None:
    s = make(num_blocks=4)  # 16 tokens of KV
    with pytest.raises(InvalidRequest, match="exceeds the context"):
        s.add_request(req("big", 14, max_tokens=4))
    with pytest.raises(InvalidRequest, match="at least one token"):
        s.add_request(req("empty", 0))
    s.add_request(req("ok", 4))
    with pytest.raises(InvalidRequest, match="already in use"):
        s.add_request(req("ok", 4))


@given(
    prompts=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10)), min_size=1, max_size=8),
    num_blocks=st.integers(10, 40),
    chunk=st.integers(1, 16),
)
@settings(max_examples=60, deadline=None)
def test_any_workload_finishes_identically_under_memory_pressure(
    prompts: list[tuple[int, int]], num_blocks: int, chunk: int
) -> None:
    def run(blocks: int) -> dict[str, list[int]]:
        s = make(num_blocks=blocks, max_num_batched_tokens=16, max_num_seqs=4, long_prefill_chunk=chunk)
        for i, (n, mt) in enumerate(prompts):
            s.add_request(req(f"r{i}", n, max_tokens=mt, base=3 * i))
        return run_all(s)

    assert run(num_blocks) == run(400)
