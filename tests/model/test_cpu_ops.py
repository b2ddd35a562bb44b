"""Baton's C++ CPU kernels (engine/csrc/cpu_ops.cpp) against their torch references, fp32 and bf16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import cpu_ops

pytestmark = pytest.mark.model

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_ops.kernels_enabled(), "the CPU kernels did not build on this machine (see the log)"


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_activation_match_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    close(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_ref(x, w, 1e-5), dtype)
    res = res.float()  # the residual stream is fp32 in every dtype
    want_res = res + x.float()
    want = cpu_ops.rms_norm_ref(want_res, w, 1e-5).to(dtype)
    got, got_res = cpu_ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert got_res.dtype == torch.float32 and got.dtype == dtype
    torch.testing.assert_close(got_res, want_res)
    close(got, want, dtype)
    gu = torch.randn(5, 2 * 40, generator=g).to(dtype)
    close(cpu_ops.silu_and_mul(gu), cpu_ops.silu_and_mul_ref(gu), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_rotates_strided_views_and_fills_the_slots(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t, h, kvh, d, bs, nb = 6, 4, 2, 16, 4, 8
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(
        dtype
    )  # q, k, v are strided views, as in the model
    cos = torch.randn(32, d // 2, generator=g)
    sin = torch.randn(32, d // 2, generator=g)
    positions = torch.tensor([0, 5, 9, 10, 11, 31])
    blocks, offsets = torch.tensor([3, 1, 2, 2, 2, 7]), torch.tensor([0, 1, 1, 2, 3, 3])
    caches = [torch.zeros(nb, 2, bs, kvh, d, dtype=dtype) for _ in range(2)]  # [NB, K/V, BS, KVH, D]

    def run(fn: object, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = qkv.clone()
        q, k, v = x.split([h * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
        return fn(q, k, v, cos, sin, positions, cache[:, 0], cache[:, 1], blocks, offsets)  # type: ignore[operator]

    def reference(q, k, v, cos, sin, pos, kc, vc, blk, off):  # type: ignore[no-untyped-def]
        c, s = cos[pos].unsqueeze(1).float(), sin[pos].unsqueeze(1).float()
        q2, k2 = cpu_ops.apply_rope(q.float(), c, s).to(dtype), cpu_ops.apply_rope(k.float(), c, s).to(dtype)
        cpu_ops.write_kv(kc, vc, k2, v, blk, off)
        return q2, k2

    q_got, k_got = run(cpu_ops.rope_and_cache, caches[0])
    q_want, k_want = run(reference, caches[1])
    close(q_got, q_want, dtype)
    close(k_got, k_want, dtype)
    close(caches[0], caches[1], dtype)
    assert (
        caches[0][3, 0, 0].abs().sum() > 0 and caches[0][0].abs().sum() == 0
    )  # written where told, only there


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5, 29])
# d 64 and 128 take the AVX-512 span kernel (and, in bf16 on a CPU with AVX512-BF16, its vdpbf16ps
# passes: scores 16 positions at a time, V two rows at a time); d 32 the generic one. Blocks of 16 with
# odd lengths and windows leave partial groups of 16 and odd rows.
@pytest.mark.parametrize(("d", "bs"), [(32, 4), (64, 16), (128, 16)])
def test_varlen_decode_attention_matches_the_padded_reference(
    dtype: torch.dtype, window: int | None, d: int, bs: int
) -> None:
    g = torch.Generator().manual_seed(2)
    h, kvh, nb = 6, 2, 48
    lens = [1, 37, 4, 13, 100, 49]  # one long sequence among short ones
    cache = torch.randn(nb, 2, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()  # blocks scattered over the cache
    tables, at = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[at : at + need])
        at += need
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), h + 1, d, generator=g).to(dtype)[:, :h]  # strided, like a view of qkv
    ctx = torch.tensor(lens)
    got = cpu_ops.paged_decode_attention(q, cache[:, 0], cache[:, 1], table, ctx, d**-0.5, window)
    want = cpu_ops.paged_decode_attention_ref(q, cache[:, 0], cache[:, 1], table, ctx, d**-0.5, window)
    close(got, want, dtype)
    with pytest.raises(RuntimeError, match="context length out of range"):
        cpu_ops.paged_decode_attention(q, cache[:, 0], cache[:, 1], table, ctx + width * bs, d**-0.5, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 11, 16])
@pytest.mark.parametrize(("n", "k"), [(37, 40), (130, 576)])  # 40: a tail shorter than one 16-wide vector
def test_int8_linear_matches_its_dequantized_weights(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    from engine.linear import quantize_int8

    g = torch.Generator().manual_seed(rows * 1000 + n)
    q, scales = quantize_int8(torch.randn(n, k, generator=g))
    scales = scales.to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    want = x.float() @ (q.float() * scales.float().unsqueeze(1)).T  # fp32 products of the very same values
    got = torch.ops.baton.int8_linear(x, q, scales)
    assert got.dtype == dtype and got.shape == (rows, n)
    # fp32 sums of k terms in another order than torch's: a few ulps of the sum's magnitude (~sqrt(k)).
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=tol, rtol=tol)
    strided = torch.randn(rows, 2 * k, generator=g).to(dtype)[:, ::2]  # a non-contiguous x is copied first
    want = strided.float() @ (q.float() * scales.float()[:, None]).T
    torch.testing.assert_close(
        torch.ops.baton.int8_linear(strided, q, scales).float(), want.to(dtype).float(), atol=tol, rtol=tol
    )


def test_int8_linear_refuses_what_it_cannot_multiply() -> None:
    q = torch.zeros(8, 32, dtype=torch.int8)
    s = torch.ones(8)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        torch.ops.baton.int8_linear(torch.zeros(17, 32), q, s)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.baton.int8_linear(torch.zeros(2, 31), q, s)
    with pytest.raises(RuntimeError, match="x's dtype"):
        torch.ops.baton.int8_linear(torch.zeros(2, 32), q, s.bfloat16())
    with pytest.raises(RuntimeError, match="contiguous int8"):
        torch.ops.baton.int8_linear(torch.zeros(2, 32), q.float(), s)


PACKED_INT8 = bool(torch.ops.baton.int8_packed_available()) if cpu_ops.kernels_enabled() else False


@pytest.mark.parametrize(("n", "k"), [(37, 41), (130, 576), (48, 2100)])
def test_int8_pack_round_trips_and_pads_with_zeros(n: int, k: int) -> None:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = torch.ops.baton.int8_pack(q)
    assert packed.shape == (-(-n // 16), -(-k // 2), 16, 2) and packed.dtype == torch.int8
    assert torch.equal(torch.ops.baton.int8_unpack(packed, n, k), q)
    assert int(packed.abs().sum()) == int(q.abs().sum())  # the padding holds zeros only
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.baton.int8_unpack(packed, n + 16, k)


# The packed form (AVX512-VNNI): rows quantized to int16 per row, int32 sums flushed every 512 pairs of K
# (2100 crosses two flushes), N and K not multiples of the block (37, 41: padded channels and a lone column).
# Past 16 rows (a prefill's, on a CPU without AMX) the rows go in tiles of 16 and a remainder.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16, 17, 40, 67])
@pytest.mark.parametrize(("n", "k"), [(37, 41), (130, 576), (48, 2100)])
def test_packed_int8_linear_matches_its_dequantized_weights(rows: int, n: int, k: int) -> None:
    from engine.linear import quantize_int8

    g = torch.Generator().manual_seed(rows * 7 + n)
    q, scales = quantize_int8(torch.randn(n, k, generator=g))
    scales = scales.bfloat16()
    packed = torch.ops.baton.int8_pack(q)
    x = torch.randn(rows, k, generator=g).bfloat16()
    if not PACKED_INT8:  # this CPU has no VNNI: the packed form must refuse, not guess
        with pytest.raises(RuntimeError, match="no packed int8 form"):
            torch.ops.baton.int8_linear(x, packed, scales)
        return
    want = x.float() @ (q.float() * scales.float().unsqueeze(1)).T
    got = torch.ops.baton.int8_linear(x, packed, scales)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # The 15-bit rows cost less than the bf16 output's rounding: within one bf16 step of each sum, plus a
    # quantization step of the row (max|x| / 16383 times the sum of |w|) for sums that nearly cancel.
    step = want.abs() * 2**-8 + x.float().abs().amax(1, keepdim=True) / 16383 * (
        q.float().abs() * scales.float().unsqueeze(1)
    ).sum(1)
    assert ((got.float() - want).abs() <= step).all()
    strided = torch.randn(rows, 2 * k, generator=g).bfloat16()[:, ::2]  # a non-contiguous x is copied first
    want = strided.float() @ (q.float() * scales.float()[:, None]).T
    torch.testing.assert_close(
        torch.ops.baton.int8_linear(strided, packed, scales).float(), want, atol=0.05, rtol=2e-2
    )


def test_packed_int8_linear_keeps_an_outlier_channel_within_a_bf16_rounding() -> None:
    """LLM hidden states have outlier channels: one at 1000x the rest must not drown the others."""
    from engine.linear import quantize_int8

    if not PACKED_INT8:
        assert not torch.ops.baton.int8_packed_available()  # nothing else to compare on this CPU
        return
    g = torch.Generator().manual_seed(5)
    q, scales = quantize_int8(torch.randn(256, 1536, generator=g))
    scales = scales.bfloat16()
    x = torch.randn(4, 1536, generator=g)
    x[:, 7] = 1000.0
    x = x.bfloat16()
    exact = x.float() @ (q.float() * scales.float().unsqueeze(1)).T
    widened = torch.ops.baton.int8_linear(x, q, scales).float()  # the row-major form: fp32-widened weights
    packed = torch.ops.baton.int8_linear(x, torch.ops.baton.int8_pack(q), scales).float()
    step = exact.abs() * 2**-7 + 1e-3 * exact.abs().max()
    assert ((widened - exact).abs() <= step).all()
    assert ((packed - exact).abs() <= step).all()


def test_packed_int8_linear_refuses_what_it_cannot_multiply() -> None:
    packed = torch.ops.baton.int8_pack(torch.zeros(32, 64, dtype=torch.int8))
    s = torch.ones(32).bfloat16()
    x = torch.zeros(2, 64).bfloat16()
    if not PACKED_INT8:
        with pytest.raises(RuntimeError, match="no packed int8 form"):
            torch.ops.baton.int8_linear(x, packed, s)
        return
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.baton.int8_linear(torch.zeros(2, 66).bfloat16(), packed, s)
    with pytest.raises(RuntimeError, match="rows must be >= 1"):
        torch.ops.baton.int8_set_kernel_max_rows(0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.baton.int8_linear(x, packed, torch.ones(50).bfloat16())
    with pytest.raises(RuntimeError, match="bf16 rows"):
        torch.ops.baton.int8_linear(x.float(), packed, s.float())
    with pytest.raises(RuntimeError, match="int8_pack"):
        torch.ops.baton.int8_linear(x, packed.float(), s)


@pytest.mark.parametrize("prefill_rows_to", ["kernel", "bf16"])
def test_an_int8_model_packs_its_weights_where_the_cpu_has_vnni(
    prefill_rows_to: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine import linear
    from engine.linear import Int8Linear

    # Both choices int8_kernel_max_rows makes: a prefill's rows through the kernel, or dequantized for bf16.
    monkeypatch.setattr(
        linear, "int8_kernel_max_rows", lambda: 1 << 30 if prefill_rows_to == "kernel" else 16
    )
    w = torch.randn(96, 64)
    layer = Int8Linear(w, None, torch.bfloat16)
    assert layer.packed == PACKED_INT8
    assert layer.qweight.numel() == w.numel()  # the same bytes, in another order
    assert not Int8Linear(w, None, torch.float32).packed  # fp32 rows take the row-major form
    x = torch.randn(3, 64).bfloat16()
    many = torch.randn(40, 64).bfloat16()  # a prefill
    ref = layer.dequantized()
    torch.testing.assert_close(layer(x).float(), x.float() @ ref.T, atol=0.05, rtol=2e-2)
    torch.testing.assert_close(layer(many).float(), many.float() @ ref.T, atol=0.05, rtol=2e-2)


def test_the_int8_probe_hands_the_kernel_every_row_count_or_a_decode_steps_only() -> None:
    """The choice is one of its two (all rows without AMX), and the decode stack was told the same (its
    setter returns the value it replaces)."""
    from engine.linear import int8_kernel_max_rows

    rows = int8_kernel_max_rows()
    assert rows in (16, 1 << 30)
    if PACKED_INT8:
        assert torch.ops.baton.int8_set_kernel_max_rows(rows) == rows


@pytest.fixture(params=["dot", "amx"])
def bf16_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both ways baton::bf16_linear multiplies: AVX512-BF16 dot products, and AMX tiles where the CPU has
    them (K a multiple of 32). On a CPU without AMX, asking for the tiles must leave the dot products."""
    previous = torch.ops.baton.bf16_set_amx_min_rows(1 if request.param == "amx" else 0)
    yield request.param
    torch.ops.baton.bf16_set_amx_min_rows(previous)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 13, 16, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(37, 40), (96, 576), (48, 2), (37, 64), (1536, 576)])
def test_bf16_dot_linear_matches_fp32_products_of_the_same_values(
    rows: int, n: int, k: int, bf16_path: str
) -> None:
    """baton::bf16_linear sums exact bf16 x bf16 products in fp32: fp32 out equals a float64 reference to
    fp32 rounding; bf16 out (with a bias) is that sum rounded once. Where the CPU has no AVX512-BF16 the
    op must refuse, and the model keeps oneDNN's packed layers (test below). 37: a last block of 5
    channels; K = 64 and 576 take the AMX tiles (whole 32-column chunks), 40 and 2 the dot products."""
    g = torch.Generator().manual_seed(rows * 100 + n)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    packed = torch.ops.baton.bf16_pack(w)
    assert packed.shape == (-(-n // 16), k // 2, 16, 2)
    if not torch.ops.baton.bf16_dot_available():
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            torch.ops.baton.bf16_linear(x, packed, n, None, True)
        return
    want = x.double() @ w.double().T
    got = torch.ops.baton.bf16_linear(x, packed, n, None, True)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    got = torch.ops.baton.bf16_linear(x, packed, n, bias, False)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        # atol as above: a sum near zero, its fp32 error a few ulps of itself, may round to the next bf16.
        got.float(),
        (want + bias.double()).float().bfloat16().float(),
        atol=1e-5,
        rtol=1e-2,
    )
    strided = torch.randn(rows, 2 * k, generator=g).bfloat16()[:, ::2]  # a non-contiguous x is copied first
    torch.testing.assert_close(
        torch.ops.baton.bf16_linear(strided, packed, n, None, True).double(),
        strided.double() @ w.double().T,
        atol=1e-5,
        rtol=1e-5,
    )


def test_bf16_dot_linear_refuses_what_it_cannot_multiply() -> None:
    packed = torch.ops.baton.bf16_pack(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K must be even"):
        torch.ops.baton.bf16_pack(torch.zeros(4, 7, dtype=torch.bfloat16))
    if not torch.ops.baton.bf16_dot_available():
        return  # refused before any check (the test above)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.baton.bf16_linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, 32, None, False)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.baton.bf16_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 33, None, False)
    with pytest.raises(RuntimeError, match="bf16 tensor"):
        torch.ops.baton.bf16_linear(torch.zeros(2, 8), packed, 32, None, False)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.baton.bf16_linear(
            torch.zeros(2, 8, dtype=torch.bfloat16), packed, 32, torch.zeros(32, dtype=torch.bfloat16), False
        )


def test_a_bf16_model_takes_the_dot_kernel_where_the_cpu_has_it() -> None:
    """Every projection and the logits head (fp32 logits) on AVX512-BF16; oneDNN's packed layers elsewhere."""
    from engine.linear import Bf16DotLinear, PackedLinear
    from engine.llm import LLM

    model = LLM(dtype="bfloat16", kv_cache_memory=8 << 20).engine.runner.model
    kinds = {type(m) for m in model.layers.modules() if isinstance(m, Bf16DotLinear | PackedLinear)}
    if torch.ops.baton.bf16_dot_available():
        assert kinds == {Bf16DotLinear}
        assert isinstance(model.lm_head, Bf16DotLinear) and model.lm_head.fp32_out
        h = torch.randn(3, model.config.hidden_size).bfloat16()
        assert model.compute_logits(h).dtype == torch.float32
    else:
        assert kinds == {PackedLinear} and isinstance(model.lm_head, PackedLinear)


def test_the_torch_fallback_serves_when_the_kernels_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 8)
    w = torch.ones(8)
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    assert not cpu_ops.use_kernels(x)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), cpu_ops.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_mistral"])
@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")]
)
def test_the_one_call_decode_stack_matches_the_python_layers(
    family: str, dtype: str, quantization: str, request: pytest.FixtureRequest
) -> None:
    """`baton::decode_layers` (a decode-only step in one C++ call) against the per-layer Python forward,
    on the same decode batch: 5 sequences, contexts 1 to 40 (Mistral's 24-token window included)."""
    from engine.attention import AttentionMetadata
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    path = request.getfixturevalue(family)
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype=dtype, quantization=quantization, kv_cache_memory=8 << 20)
    )
    model, runner = engine.runner.model, engine.runner
    plan = model._decode_plan()
    assert plan is not None
    if dtype == "bfloat16" and quantization == "none" and torch.ops.baton.bf16_dot_available():
        assert plan[0] == 3  # the projections packed for AVX512-BF16 dot products
    g = torch.Generator().manual_seed(3)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=g).to(runner.kv_cache.dtype))
    lens = [1, 7, 16, 25, 40]
    bs = engine.kv.block_size
    tables = [[10 * i + j for j in range(-(-n // bs))] for i, n in enumerate(lens)]
    width = max(len(t) for t in tables)
    positions = torch.tensor([n - 1 for n in lens])
    meta = AttentionMetadata(
        positions=positions,
        slot_blocks=torch.tensor([t[(n - 1) // bs] for t, n in zip(tables, lens, strict=True)]),
        slot_offsets=positions % bs,
        num_decode_tokens=len(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_ctx_lens=torch.tensor(lens),
        prefills=[],
    )
    ids = torch.randint(3, model.config.vocab_size, (len(lens),), generator=g)
    with torch.inference_mode():
        fast = model(ids, meta, runner.kv_layers)
        was = torch.ops.baton.set_side_prefetch(0)  # the next layer's KV not asked for ahead
        try:
            unhinted = model(ids, meta, runner.kv_layers)
        finally:
            torch.ops.baton.set_side_prefetch(was)
        model._plan = None  # the Python layers from here on
        slow = model(ids, meta, runner.kv_layers)
    close(fast, slow, getattr(torch, dtype))
    assert torch.equal(fast, unhinted)  # prefetches never touch values


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")]
)
def test_the_floor_multiplies_what_the_decode_stack_multiplies(
    dtype: str, quantization: str, tiny_llama: Path
) -> None:
    """`baton::project_layers` (the step-floor benchmark's products in one call) runs the decode stack's
    projections: its result is the last layer's down projection of the input given for it."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama), dtype=dtype, quantization=quantization, kv_cache_memory=8 << 20)
    )
    model = engine.runner.model
    plan = model._decode_plan()
    assert plan is not None
    layer = list(model.decoder_layers())[-1]
    mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(5, m.in_features, generator=g).to(getattr(torch, dtype)) for m in mods]
    with torch.inference_mode():
        got = torch.ops.baton.project_layers(xs, plan[1], plan[0])
        want = mods[3](xs[3])
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="4 inputs"):
        torch.ops.baton.project_layers(xs[:3], plan[1], plan[0])


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_mixing_prompt_chunks_with_decodes_run_the_one_call_stack_alike(
    family: str, dtype: str, request: pytest.FixtureRequest
) -> None:
    """Prompt chunks that arrive beside running decodes attend row by row in `baton::decode_layers`
    (engine.model_runner: small chunks only); the tokens and logprobs equal the per-layer Python path's."""
    from core.sampling_params import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner

    path = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    prompts = {"early": list(range(5, 40)), "late-1": list(range(50, 61)), "late-2": list(range(70, 100))}

    def run(one_call: bool) -> tuple[dict[str, list[int]], dict[str, list[float]], int]:
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                dtype=dtype,
                kv_cache_memory=8 << 20,
                long_prefill_chunk=8,
                mixed_prefill_tokens=12,
            )
        )
        if not one_call:
            engine.runner.model._plan = None
        mixed = 0
        prepare = engine.runner._prepare

        def counting(out: object) -> object:
            nonlocal mixed
            got = prepare(out)  # type: ignore[arg-type]
            meta = got[1]
            mixed += bool(meta.prefills and meta.num_decode_tokens and meta.row_block_tables is not None)
            return got

        engine.runner._prepare = counting  # type: ignore[method-assign]
        assert isinstance(engine.runner, ModelRunner)
        tokens: dict[str, list[int]] = {k: [] for k in prompts}
        logprobs: dict[str, list[float]] = {k: [] for k in prompts}
        engine.add_request("early", prompts["early"], params)
        for n in range(40):
            if n == 6:  # "early" decodes by now: these prompts are chunked beside it
                engine.add_request("late-1", prompts["late-1"], params)
                engine.add_request("late-2", prompts["late-2"], params)
            for out in engine.step():
                tokens[out.request_id] = list(out.token_ids)
                logprobs[out.request_id] = [lp.logprob for lp in out.logprobs or []]
            if not engine.has_unfinished:
                break
        return tokens, logprobs, mixed

    fast, fast_lp, mixed = run(True)
    slow, slow_lp, _ = run(False)
    assert mixed >= 3  # steps that mixed chunks with decodes went through the one-call stack
    assert all(len(t) == 12 for t in fast.values())
    if dtype == "float32":
        assert fast == slow
    for rid in prompts:
        # bf16 sums in another order may flip a near tie; compare up to the first token that differs.
        same = next((i for i, (a, b) in enumerate(zip(fast[rid], slow[rid], strict=True)) if a != b), 12)
        assert same >= 3, (rid, fast[rid], slow[rid])
        tol = 1e-4 if dtype == "float32" else 0.1
        torch.testing.assert_close(
            torch.tensor(fast_lp[rid][:same]), torch.tensor(slow_lp[rid][:same]), atol=tol, rtol=tol
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_bitmask_kernel_matches_its_reference(dtype: torch.dtype) -> None:
    """Structured outputs' mask: the kernel sets exactly the tokens whose bit is 0 to -inf, in the rows
    asked for and only there, over a vocabulary that does not fill its last 32-bit word."""
    g = torch.Generator().manual_seed(3)
    vocab = 1000  # 31.25 words
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 32), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # a row that allows everything
    rows = [0, 1, 4]
    want, got = logits.clone(), logits.clone()
    cpu_ops.apply_token_bitmask_ref(want, bitmask, rows)
    cpu_ops.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[2, 3, 5]], logits[[2, 3, 5]]) and torch.equal(got[1], logits[1])
    token = 37  # word 1, bit 5
    assert (got[0, token] == float("-inf")) == (not (int(bitmask[0, 1]) >> 5) & 1)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49155])
def test_greedy_argmax_kernel_matches_torch_max(vocab: int) -> None:
    """`baton::argmax_rows` (the greedy sampler's pick) gives `max(dim=-1).indices` exactly: the first of
    tied maxima within a lane and across lanes, the tail past the last 16 columns, a row of -inf, a NaN
    (torch takes it as the maximum) in the vectorised part or in the tail, and rows of a wider tensor."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab + 5, generator=g)[:, 2 : 2 + vocab]  # strided rows
    assert not x.is_contiguous()
    if vocab > 40:
        x[1, 3] = x[1, 35] = 50.0  # tied, the same lane
        x[2, 20] = x[2, 7] = 50.0  # tied, other lanes: the smaller index wins
        x[3, 5] = float("nan")
        x[4, vocab - 1] = float("nan")  # in the tail (or the last full group)
        x[4, 9] = 60.0
    x[5] = float("-inf")
    x[6, vocab - 1] = 99.0  # the maximum in the last column
    x[7] = 0.0  # all tied: index 0
    want = cpu_ops.argmax_rows_ref(x)
    got = cpu_ops.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, want), (got, want)
    assert torch.equal(torch.ops.baton.argmax_rows(x.contiguous()), want)
    assert cpu_ops.argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.baton.argmax_rows(x.to(torch.bfloat16))
