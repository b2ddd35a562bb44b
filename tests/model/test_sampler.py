"""Tests of `engine.sampler`: greedy, the filters' exact distributions, empirical frequencies of seeded
draws, penalties and min_tokens on hand-made logits, raw logprobs, and bit-identical batch independence."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from core.sampling_params import SamplingParams
from engine.sampler import Sampler, SamplingRow, apply_min_tokens, apply_penalties, draw_seed, filtered_probs

pytestmark = pytest.mark.model

# A known small distribution, most likely first.
PROBS = [0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01]
LOGITS = torch.tensor(PROBS).log()
NUM_DRAWS = 20_000


def make_row(
    params: SamplingParams | None = None,
    *,
    seed: int = 0,
    position: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] | None = None,
    eos: tuple[int, ...] = (),
) -> SamplingRow:
    # range(position) is a cheap Sequence whose length is the position being sampled.
    return SamplingRow(
        params=params or SamplingParams(),
        seed=seed,
        prompt_token_ids=prompt,
        output_token_ids=range(position) if output is None else output,
        eos_token_ids=eos,
    )


def normalized(weights: Sequence[float]) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float64)
    return t / t.sum()


def empirical(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """Frequencies of NUM_DRAWS draws from one row's distribution, one per output position."""
    rows = [make_row(params, seed=1234, position=p) for p in range(NUM_DRAWS)]
    tokens = Sampler()(logits.repeat(NUM_DRAWS, 1), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double() / NUM_DRAWS


# --- greedy ------------------------------------------------------------------------------------------


def test_greedy_is_argmax_also_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(8)]
    out = Sampler()(logits, [make_row(p, seed=i) for i, p in enumerate(params)])
    for i in range(0, 8, 2):
        assert out.token_ids[i] == int(logits[i].argmax())
    assert out.logprobs == [None] * 8


def test_sampler_does_not_modify_logits() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = SamplingParams(
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        repetition_penalty=1.5,
        presence_penalty=1.0,
        min_tokens=2,
        stop_token_ids=[3],
        logprobs=2,
    )
    Sampler()(logits, [make_row(params, output=[1, 2], eos=(0,)) for _ in range(3)])
    assert torch.equal(logits, before)


# --- exact filtered distributions --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), normalized(PROBS)),
        (SamplingParams(temperature=1.0, top_k=3), normalized(PROBS[:3])),
        # mass before the 4th token is 0.65 >= 0.6: the nucleus is the first three.
        (SamplingParams(temperature=1.0, top_p=0.6), normalized(PROBS[:3])),
        # min_p 0.3 * max 0.30 = 0.09: keeps 0.30 .. 0.10.
        (SamplingParams(temperature=1.0, min_p=0.3), normalized(PROBS[:5])),
        # top-k 5 renormalizes (0.345, 0.230, 0.172, 0.138, 0.115); top-p 0.8 keeps 4; min-p 0.45 keeps 3.
        (SamplingParams(temperature=1.0, top_k=5, top_p=0.8), normalized(PROBS[:4])),
        (SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.45), normalized(PROBS[:3])),
    ],
)
def test_filtered_probs_on_a_known_distribution(params: SamplingParams, expected: torch.Tensor) -> None:
    probs = filtered_probs(LOGITS.unsqueeze(0), [params])[0].double()
    expected = torch.cat([expected, torch.zeros(len(PROBS) - expected.numel(), dtype=torch.float64)])
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)


def test_temperature_scales_logits() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2)) * 3
    for temperature in (0.3, 1.0, 2.5):
        probs = filtered_probs(logits, [SamplingParams(temperature=temperature)] * 2)
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_top_k_keeps_ties_with_the_kth_logit() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    probs = filtered_probs(logits, [SamplingParams(top_k=2)])[0]
    assert (probs > 0).tolist() == [True, True, True, False]


def test_top_p_always_keeps_the_top_token() -> None:
    # 5e-324 (found by the HTTP fuzzer) is a valid top_p that rounds to 0 in float32: the top token still.
    for top_p in (0.01, 5e-324):
        probs = filtered_probs(LOGITS.unsqueeze(0), [SamplingParams(top_p=top_p)])[0]
        assert probs.tolist() == [1.0] + [0.0] * (len(PROBS) - 1)


def test_wide_nucleus_beyond_the_candidates_matches_a_full_sort() -> None:
    # A nearly flat distribution over 4096 distinct logits: top-p 0.9 keeps ~3.7k tokens, more than the
    # candidates looked at first, so the row takes the full-sort path; the peaked row does not.
    vocab_size = 4096
    flat = torch.linspace(0.5, 0.0, vocab_size)
    peaked = torch.randn(vocab_size, generator=torch.Generator().manual_seed(3)) * 8
    logits = torch.stack([flat, peaked])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9)]
    probs = filtered_probs(logits, params)
    for i in range(2):
        sorted_probs = torch.softmax(logits[i].double(), dim=-1).sort(descending=True).values
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        assert int((probs[i] > 0).sum()) == int((mass_before < 0.9).sum())
        assert torch.equal(probs[i], filtered_probs(logits[i : i + 1], params[i : i + 1])[0])
    assert int((probs[0] > 0).sum()) > 3000


# --- empirical frequencies of seeded draws -----------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.3),
    ],
    ids=["temperature", "top_k", "top_p", "min_p"],
)
def test_draw_frequencies_match_the_distribution(params: SamplingParams) -> None:
    expected = filtered_probs(LOGITS.unsqueeze(0), [params])[0].double()
    if params.temperature != 1.0:
        torch.testing.assert_close(expected, torch.softmax(LOGITS.double() / params.temperature, -1))
    frequencies = empirical(params)
    assert 0.5 * (frequencies - expected).abs().sum() < 0.02  # total variation distance
    assert frequencies[expected == 0].sum() == 0  # filtered tokens never appear


# --- seeds and batch independence --------------------------------------------------------------------


def test_seeds_and_positions_give_different_draws() -> None:
    vocab_size, n = 50, 200
    logits = torch.zeros(n, vocab_size)

    def draws(seed: int) -> list[int]:
        return Sampler()(logits, [make_row(seed=seed, position=p) for p in range(n)]).token_ids

    a, b = draws(1), draws(2)
    assert a == draws(1)  # a fresh sampler reproduces the same tokens
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 20  # ~n / vocab_size expected
    assert len(set(a)) > 30  # positions of one seed are not all the same draw


def test_draw_seed_spreads_seed_and_position() -> None:
    seeds = {draw_seed(s, p) for s in (0, 1, 2, 2**32, 2**63 - 1) for p in range(100)}
    assert len(seeds) == 500
    assert len({s & 0xFFFFFFFF for s in seeds}) == 500  # the CPU generator uses only the low 32 bits
    assert all(0 <= s < 2**64 for s in seeds)


def _random_rows(rng: random.Random, vocab_size: int, n: int) -> list[SamplingRow]:
    rows = []
    for _ in range(n):
        params = SamplingParams(
            max_tokens=64,
            temperature=rng.choice([0.0, 0.5, 1.0, 1.0, 1.7]),
            top_k=rng.choice([0, -1, 5, 40]),
            top_p=rng.choice([1.0, 0.5, 0.9, 0.99]),
            min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
            repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
            presence_penalty=rng.choice([0.0, 0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, 0.0, -0.3]),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=rng.sample(range(vocab_size), 2),
            ignore_eos=rng.random() < 0.3,
            logprobs=rng.choice([None, 0, 3]),
        )
        rows.append(
            SamplingRow(
                params=params,
                seed=rng.randrange(2**63),
                prompt_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randrange(1, 30))],
                output_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randrange(0, 6))],
                eos_token_ids=(0,),
            )
        )
    return rows


@pytest.mark.parametrize("trial", range(3))
def test_rows_are_bit_identical_alone_and_in_any_batch(trial: int) -> None:
    rng = random.Random(trial)
    vocab_size, n = 2048, 16
    rows = _random_rows(rng, vocab_size, n)
    gen = torch.Generator().manual_seed(trial)
    # Scales from flat (a nucleus wider than the top-p candidates) to peaked.
    logits = (
        torch.randn(n, vocab_size, generator=gen)
        * torch.tensor([0.01, 0.3, 2.0, 6.0]).repeat(n // 4)[:, None]
    )

    sampler = Sampler()
    batch = sampler(logits, rows)
    order = list(range(n))
    rng.shuffle(order)
    shuffled = sampler(logits[order], [rows[i] for i in order])
    processed = apply_penalties(apply_min_tokens(logits, rows), rows)
    sampled = [i for i in range(n) if not rows[i].params.greedy]
    probs = filtered_probs(processed[sampled], [rows[i].params for i in sampled])
    for i in range(n):
        alone = sampler(logits[i : i + 1], [rows[i]])
        assert alone.token_ids[0] == batch.token_ids[i] == shuffled.token_ids[order.index(i)]
        assert alone.logprobs[0] == batch.logprobs[i] == shuffled.logprobs[order.index(i)]
        alone_processed = apply_penalties(apply_min_tokens(logits[i : i + 1], [rows[i]]), [rows[i]])
        assert torch.equal(alone_processed[0], processed[i])
        if i in sampled:
            alone_probs = filtered_probs(alone_processed, [rows[i].params])
            assert torch.equal(alone_probs[0], probs[sampled.index(i)])
    assert len(set(batch.token_ids)) > 1


# --- penalties and min_tokens ------------------------------------------------------------------------

HAND_LOGITS = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # repetition over prompt (0) and output (1, 2): positive / 2, negative * 2.
        (SamplingParams(repetition_penalty=2.0), [1.0, -4.0, 0.5, 0.5, -1.0]),
        # presence / frequency over output only: token 1 seen once, token 2 twice, token 0 only in the prompt.
        (SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2.0, -2.75, 0.0, 0.5, -1.0]),
        (
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            [1.0, -4.75, -0.5, 0.5, -1.0],
        ),
        (SamplingParams(), [2.0, -2.0, 1.0, 0.5, -1.0]),
    ],
)
def test_penalties_on_hand_made_logits(params: SamplingParams, expected: list[float]) -> None:
    plain = make_row(prompt=[0], output=[1, 2, 2])
    penalized = make_row(params, prompt=[0], output=[1, 2, 2])
    logits = HAND_LOGITS.repeat(2, 1)
    out = apply_penalties(logits, [plain, penalized])
    assert out[0].tolist() == HAND_LOGITS[0].tolist()  # a row without penalties is untouched
    assert out[1].tolist() == expected
    assert logits.tolist() == HAND_LOGITS.repeat(2, 1).tolist()


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert Sampler()(HAND_LOGITS, [make_row(params, output=[0])]).token_ids == [2]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_stop_ids_and_eos_until_reached(ignore_eos: bool) -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[3], ignore_eos=ignore_eos)
    logits = torch.zeros(3, 6)
    rows = [make_row(params, position=p, eos=(4,)) for p in range(3)]
    out = apply_min_tokens(logits, rows)
    blocked = {3} if ignore_eos else {3, 4}  # with ignore_eos EOS does not end the request anyway
    for position in (0, 1):
        assert {t for t in range(6) if out[position, t] == float("-inf")} == blocked
    assert torch.equal(out[2], logits[2])


def test_min_tokens_makes_greedy_skip_eos() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])  # EOS (2) is the argmax, the stop id (3) second
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3])
    sampler = Sampler()
    assert sampler(logits, [make_row(params, position=0, eos=(2,))]).token_ids == [1]
    assert sampler(logits, [make_row(params, position=1, eos=(2,))]).token_ids == [2]


# --- logprobs ----------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)) * 2
    top = int(logits[0].argmax())
    rows = [
        # the penalty pushes the raw argmax down, so greedy picks a token of raw rank 2
        make_row(SamplingParams(temperature=0.0, repetition_penalty=100.0, logprobs=5), output=[top]),
        make_row(SamplingParams(temperature=2.0, top_k=10, logprobs=3), seed=7),
        make_row(SamplingParams(temperature=1.0, logprobs=0), seed=8),
        make_row(SamplingParams(temperature=1.0), seed=9),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i, n in ((0, 5), (1, 3), (2, 0)):
        lp = out.logprobs[i]
        assert lp is not None
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(raw[i, token]), abs=1e-6)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        assert len(lp.top) == n
        assert [t for t, _ in lp.top] == raw[i].topk(n).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(raw[i].topk(n).values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
    assert out.logprobs[0] is not None and out.logprobs[0].rank == 2
    assert out.logprobs[0].top[0][0] == top
    assert out.logprobs[3] is None
