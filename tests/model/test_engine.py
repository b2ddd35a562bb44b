"""The engine end to end on a tiny model: batch invariance, preemption, abort, stops, the offline API."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from core.errors import InvalidRequest, ModelLoadError
from core.outputs import FinishReason
from core.sampling_params import SamplingParams
from decode_worker.pulls import KVPulls
from engine import LLM
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.model


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 380, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_batch_invariance_16_requests(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory=16 << 20)
    batch = random_prompts(16)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(16)]
    together = llm.generate(batch, params)
    for p, sp, out in zip(batch, params, together, strict=True):
        alone = llm.generate([p], sp)[0]
        assert alone.token_ids == out.token_ids
        assert len(out.token_ids) == sp.max_tokens


def test_seeded_sampling_is_batch_independent(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory=16 << 20)
    batch = random_prompts(8, seed=1)
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(8)
    ]
    together = llm.generate(batch, params)
    assert llm.generate([batch[3]], params[3])[0].token_ids == together[3].token_ids
    assert llm.generate(batch[::-1], params[::-1])[4].token_ids == together[3].token_ids


def test_preemption_keeps_greedy_outputs_and_leaks_nothing(tiny_llama: Path) -> None:
    batch = random_prompts(12, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    big = LLM(str(tiny_llama), kv_cache_memory=16 << 20, dtype="float32").generate(batch, params)

    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block_size * kv_heads * head_dim * fp32
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama), kv_cache_memory=16 * block_bytes, max_model_len=256, dtype="float32"
        )
    )
    assert engine.kv.num_blocks == 16, "16 blocks of 16 tokens: far too few for 12 requests at once"
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.scheduler.check_integrity()
    assert engine.scheduler.num_preemptions > 0
    assert [done[f"r{i}"] for i in range(12)] == [o.token_ids for o in big]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "blocks leaked"


def test_abort_frees_blocks_and_reports(tiny_llama: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("keep", [5, 6, 7], params)
    engine.add_request("drop", list(range(3, 40)), params)
    engine.step()
    engine.step()
    assert engine.kv.block_ids("drop")
    assert engine.abort_request("drop")
    assert not engine.kv.block_ids("drop"), "blocks are freed at the step boundary"
    outs = engine.step()
    dropped = [o for o in outs if o.request_id == "drop"]
    assert dropped and dropped[0].finish_reason is FinishReason.CANCELLED
    assert not engine.abort_request("drop"), "abort is idempotent"
    while engine.has_unfinished:
        engine.step()
    engine.scheduler.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_stop_strings_and_stop_tokens(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory=8 << 20)
    prompt = [10, 20, 30, 40]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    text = free_run.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    incl = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )[0]
    assert incl.text == text[: text.index(stop) + len(stop)]
    # Streaming never shows a partial stop string.
    streamed = "".join(
        o.new_text
        for o in llm.stream(
            prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
        )
    )
    assert streamed == out.text
    tok = free_run.token_ids[5]
    by_id = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tok
    assert by_id.token_ids == free_run.token_ids[: free_run.token_ids.index(tok) + 1]
    length = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


def test_min_tokens_blocks_eos(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory=8 << 20)
    prompt = [10, 20, 30, 40]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    eos = free_run.token_ids[2]  # pretend an early greedy token is a stop token
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, min_tokens=6, temperature=0.0, stop_token_ids=[eos])
    )[0]
    assert len(out.token_ids) >= 6
    assert eos not in out.token_ids[:5]


def test_chat_and_stream_api(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory=8 << 20)
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert out.prompt_token_ids == expected
    deltas = list(llm.stream("Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    assert deltas[-1].finished and "".join(d.new_text for d in deltas) == deltas[-1].text
    with pytest.raises(InvalidRequest):
        llm.chat([], SamplingParams())


def test_invalid_requests_are_clear_errors(tiny_llama: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20, max_model_len=128))
    with pytest.raises(InvalidRequest, match="exceeds the context"):
        engine.add_request("long", list(range(3, 120)), SamplingParams(max_tokens=64))
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add_request("bad", [1, 2, 10**9], SamplingParams())
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.add_request("bad2", [1, 2], SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(InvalidRequest):
        SamplingParams(temperature=-1)
    assert not engine.has_unfinished


def _copy_model(src: Path, dst: Path, keep: Callable[[Path], bool]) -> Path:
    """A copy of the model directory ``src`` with only the files ``keep`` accepts."""
    dst.mkdir()
    for f in src.iterdir():
        if keep(f):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_model_load_errors_name_the_problem(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    broken = _copy_model(tiny_llama, tmp_path / "broken", lambda f: f.name != "model.safetensors")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(broken)))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read"):
        LLMEngine(EngineConfig(model=str(broken)))
    with pytest.raises(ModelLoadError, match="max_model_len"):
        LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20, max_model_len=100_000))


def test_dummy_weights_need_only_the_config_and_are_a_version_of_their_own(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """--load-format dummy (benchmarks of a model's shapes without its weights, e.g. on a GPU machine
    that cannot fetch them): no weight file is read, the runs are reproducible, and the version differs
    from the real checkpoint's, so its KV never mixes with the real weights'."""
    bare = _copy_model(tiny_llama, tmp_path / "bare", lambda f: f.suffix != ".safetensors")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(bare)))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = [LLM(model=str(bare), load_format="dummy", kv_cache_memory=8 << 20) for _ in range(2)]
    outs = [llm.generate([[1, 2, 3, 4]], params)[0].token_ids for llm in runs]
    assert outs[0] == outs[1] and len(outs[0]) == 6
    real = LLM(model=str(tiny_llama), kv_cache_memory=8 << 20)
    assert real.generate([[1, 2, 3, 4]], params)[0].token_ids != outs[0]
    versions = {runs[0].engine.model_version, real.engine.model_version}
    assert len(versions) == 2
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="random")


class _StuckPull:
    """A pull whose copy thread is still writing after cancel (a transport-level double: the engine's
    rule is tested here; the real transports' hung and killed sources are in tests/integration)."""

    def __init__(self) -> None:
        self.cancelled = False
        self.stopped = False

    def poll(self) -> bool:
        return False

    def cancel(self) -> None:
        self.cancelled = True

    def settled(self) -> bool:
        return self.stopped


def test_blocks_of_a_cancelled_pull_are_not_reused_until_it_settles(tiny_llama: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20))
    pulls = KVPulls(engine)
    pull = _StuckPull()
    ids = list(range(3, 67))  # 4 blocks
    params = SamplingParams(max_tokens=3, temperature=0.0)
    landed: list[int] = []

    def start(src: list[int], dst: list[int]) -> _StuckPull:
        landed.extend(dst)
        return pull

    assert pulls.add("t", ids, 5, params, list(range(4)), start, timeout_s=0.05) == 4
    total = engine.kv.num_blocks
    pulls.abort("t")
    assert pull.cancelled
    assert pulls.num_draining_blocks == 4 and engine.kv.num_free_blocks == total - 4
    engine.step()  # still writing: the blocks stay out of the pool
    assert pulls.num_draining_blocks == 4
    # the request id is free for a retry at once, and it never gets the draining blocks
    retry = _StuckPull()
    got: list[int] = []
    pulls.add("t", ids, 5, params, list(range(4)), lambda s, d: got.extend(d) or retry)
    assert not set(got) & set(landed)
    pull.stopped = True
    engine.step()
    assert pulls.num_draining_blocks == 0
    pulls.abort("t")
    retry.stopped = True
    engine.step()
    engine.scheduler.check_integrity()
    assert engine.kv.num_free_blocks == total


@pytest.mark.parametrize("k", [1, 5, 11])
def test_a_resumed_request_continues_exactly_where_it_stopped(tiny_llama: Path, k: int) -> None:
    """Migration: another engine gets prompt + the tokens already sent and produces exactly the rest,
    seeded sampling and penalties included, without re-emitting text."""
    prompt = list(range(3, 40))
    params = SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, frequency_penalty=0.5, ignore_eos=True
    )
    full = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20))
    full.add_request("r", prompt, params)
    stream = [o for _ in range(40) for o in full.step()]
    done = stream[-1]
    assert done.finished and len(done.token_ids) == 16
    sent_text = "".join(o.new_text for o in stream if o.num_output_tokens <= k)  # what the client had

    other = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20))
    other.add_request("r", prompt, params, resume_token_ids=done.token_ids[:k])
    new_ids: list[int] = []
    new_text = ""
    finished = None
    for _ in range(40):
        for o in other.step():
            new_ids += o.new_token_ids
            new_text += o.new_text
            finished = o if o.finished else finished
    assert new_ids == done.token_ids[k:]
    assert finished is not None and finished.token_ids == done.token_ids and finished.text == done.text
    assert sent_text + new_text == done.text
    with pytest.raises(InvalidRequest, match="nothing to resume"):
        other.add_request("r2", prompt, params, resume_token_ids=done.token_ids)


def test_the_engine_counts_for_metrics_in_plain_ints(tiny_llama: Path) -> None:
    """Each request's first output says how long it waited to be scheduled; tokens and steps are
    counted; an aborted waiting request leaves nothing behind (see services.worker.metrics.WorkerStats)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20, max_num_seqs=1))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.add_request("gone", [5, 6, 7], params)
    assert engine.abort_request("gone")
    queued: dict[str, list[float]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            queued.setdefault(out.request_id, []).append(out.queue_s)
    assert queued.pop("gone") == [0.0]  # aborted before it was ever scheduled
    for rid, waits in queued.items():
        assert waits[0] > 0 and waits[1:] == [0.0, 0.0], rid  # on the first output only
    assert queued["r0"][0] < queued["r1"][0] < queued["r2"][0], "one at a time: each waited for the last"
    assert engine.num_sampled_tokens == 3 * 3
    assert engine.num_scheduled_tokens == sum(len(p) for p in prompts) + 3 * 2
    assert not engine._queued_at and not engine._queue_seconds
