"""The real default model (SmolLM2-135M-Instruct from its GGUF): golden prompts, the CLI, HF agreement."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.sampling_params import SamplingParams
from engine import LLM

pytestmark = [pytest.mark.model, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=64 << 20, dtype="float32")  # fp32: the reference transformers is compared in


def baton(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("baton", path=str(Path(sys.executable).parent)) or "baton"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_capital_of_france(llm: LLM) -> None:
    out = llm.generate("The capital of France is", GREEDY)[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("length", "stop")


def test_chat_answers_paris(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "Which city is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop", "the chat turn ends on <|im_end|>"
    assert "<|im_end|>" not in out.text


def test_greedy_tokens_match_transformers(llm: LLM) -> None:
    import transformers

    prompt = llm.tokenizer.encode("Continuous batching is a technique that")
    ours = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert ours.token_ids == ref


def test_cli_generate_streams_paris() -> None:
    res = baton("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_cli_chat_answers_paris() -> None:
    res = baton("generate", "--chat", "Which city is the capital of France?", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_cli_evaluate_compares_an_int8_twin_with_fp32() -> None:
    import json

    # One thread: with two on a machine whose other core is busy, OpenMP's barriers made this 10x slower
    # (over the 300 s timeout in a fresh-clone CI run); the figures checked here do not depend on speed.
    res = baton("evaluate", "--prompts", "4", "--tokens", "16", "--json", "--threads", "1")
    assert res.returncode == 0, res.stderr
    figures = json.loads(res.stdout)
    assert figures["positions"] == 4 * 16
    assert figures["reference"]["version"] != figures["candidate"]["version"]  # the twin is its own version
    assert figures["candidate"]["quantization"] == "int8"
    assert 0.8 <= figures["argmax_agreement"] <= 1.0 and 0 <= figures["mean_kl"] < 0.1
    assert figures["reference"]["tok_s_batch16"] > 0 and figures["candidate"]["tok_s_batch16"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_cli_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    res = baton("generate", "hello", *args)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr
