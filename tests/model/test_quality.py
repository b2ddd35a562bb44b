"""bf16 and int8 against fp32 on the real default model, teacher-forced: the same tokens fed to each
version, their next-token predictions compared position by position (engine.quality)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.linear import Int8Linear, PackedLinear
from engine.llm import LLM
from engine.quality import Agreement, default_prompts, evaluate, sample_texts

pytestmark = [pytest.mark.model, pytest.mark.slow]

REFERENCE_TEXT = Path(__file__).parents[1] / "data" / "reference_text.txt"
NUM_PROMPTS, NUM_POSITIONS = 64, 64


@pytest.fixture(scope="module")
def versions() -> dict[str, LLM]:
    kv = 64 << 20
    return {
        "fp32": LLM(dtype="float32", kv_cache_memory=kv),
        "bf16": LLM(dtype="bfloat16", kv_cache_memory=kv),
        "int8": LLM(dtype="bfloat16", quantization="int8", kv_cache_memory=kv),
    }


@pytest.fixture(scope="module")
def sequences(versions: dict[str, LLM]) -> list[list[int]]:
    """64 texts of 64 tokens after a short prompt, sampled (seeded, T=1) from fp32."""
    return sample_texts(versions["fp32"], default_prompts(NUM_PROMPTS), NUM_POSITIONS)


def agreement(
    versions: dict[str, LLM], name: str, seqs: list[list[int]], num_last: int | None, rows: int | None = None
) -> Agreement:
    return evaluate(versions["fp32"], versions[name], seqs, num_last, rows_per_step=rows)


# The candidate fed in one prefill, or in steps of 16 rows that each attend on their own: a decode step's
# shape, so the decode kernels (the one-call stack, the int8 kernel with its integer form) are judged too.
@pytest.mark.parametrize("rows", [None, 16], ids=["prefill", "decode-steps"])
@pytest.mark.parametrize(("name", "min_agreement"), [("bf16", 0.96), ("int8", 0.935)])
def test_next_token_argmax_agrees_with_fp32(
    versions: dict[str, LLM], sequences: list[list[int]], name: str, min_agreement: float, rows: int | None
) -> None:
    a = agreement(versions, name, sequences, NUM_POSITIONS, rows)  # the predictions of the 64 sampled tokens
    assert a.num_positions == NUM_PROMPTS * NUM_POSITIONS
    assert a.argmax_agreement >= min_agreement, a


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_nll_of_a_reference_text_is_within_2_percent_of_fp32(versions: dict[str, LLM], name: str) -> None:
    text = versions["fp32"].tokenizer.encode(REFERENCE_TEXT.read_text())
    a = agreement(versions, name, [text], None)
    assert a.num_positions > 400
    assert abs(a.nll_ratio - 1) <= 0.02, a


def test_a_broken_candidate_is_caught(versions: dict[str, LLM], sequences: list[list[int]]) -> None:
    """Zeroed scales in one layer's MLP: the figures must say so (they are not vacuous)."""
    model = versions["int8"].engine.runner.model
    down = model.layers[3].mlp.down_proj
    assert isinstance(down, Int8Linear)
    saved = down.scales.clone()
    try:
        down.scales.zero_()
        a = agreement(versions, "int8", sequences[:8], NUM_POSITIONS)
    finally:
        down.scales.copy_(saved)
    assert a.argmax_agreement < 0.9 and a.mean_kl > 0.05, a


def test_int8_is_its_own_model_version_and_a_quarter_of_fp32(versions: dict[str, LLM]) -> None:
    fp32, int8 = versions["fp32"].engine, versions["int8"].engine
    assert int8.model_version != fp32.model_version
    assert versions["bf16"].engine.model_version == fp32.model_version  # same weights, other arithmetic
    assert int8.kv_layout_fields()["model_digest"] == int8.model_version  # no KV handoff across the two

    def linear_bytes(llm: LLM, dtype: torch.dtype | None = None) -> int:
        total = 0
        for m in llm.engine.runner.model.layers.modules():
            if isinstance(m, Int8Linear):
                total += m.qweight.numel() * m.qweight.element_size()
            elif isinstance(m, torch.nn.Linear | PackedLinear):
                w = m.weight if isinstance(m, torch.nn.Linear) else m.packed
                total += w.numel() * w.element_size()
        return total

    assert linear_bytes(versions["int8"]) * 4 == linear_bytes(versions["fp32"])


def test_int8_matmul_matches_its_dequantized_weights() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * 0.05
    layer = Int8Linear(w, None, torch.bfloat16)
    wmax = float(w.abs().max())  # within half a quantization step, plus the bf16 rounding of the scales
    assert (layer.dequantized() - w).abs().max() <= wmax / 254 * 1.01 + wmax * 2**-8
    for rows in (1, 3, 8, 9, 16, 17, 33):  # Baton's kernel up to 16 rows; above, the kernel or bf16 (probed)
        x = torch.randn(rows, 64, generator=g).bfloat16()
        want = torch.nn.functional.linear(x.float(), layer.dequantized().float())
        torch.testing.assert_close(layer(x).float(), want, atol=3e-2, rtol=2e-2)
