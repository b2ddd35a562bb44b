"""loadgen.workload and loadgen.arrivals: lengths within their ranges, shared prefixes really shared,
mixes and tenant shares as asked, ShareGPT parsing and its errors, and arrival processes whose mean rate
is the one asked for (seeded, reproducible)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
from conftest import write_tiny_tokenizer

from engine.tokenizer import Tokenizer
from loadgen.arrivals import IssuePlan, arrival_gaps
from loadgen.workload import LengthSpec, LoadgenError, Tenant, Workload, WorkloadConfig, load_sharegpt

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return Tokenizer.from_dir(path)


# --- lengths, tenants --------------------------------------------------------------------------------


def test_length_spec_parses_fixed_and_ranged_and_rejects_the_rest() -> None:
    assert LengthSpec.parse("128") == LengthSpec(128, 128)
    assert LengthSpec.parse("64:256") == LengthSpec(64, 256) and str(LengthSpec(64, 256)) == "64:256"
    for bad in ("0", "5:3", "x", "1:2:3", "", "-4"):
        with pytest.raises(ValueError, match="expected"):
            LengthSpec.parse(bad)


def test_tenant_parses_name_share_and_key() -> None:
    assert Tenant.parse("quiet:0.1:sk-a:b") == Tenant("quiet", 0.1, "sk-a:b")
    assert Tenant.parse("flood:9") == Tenant("flood", 9.0, "")
    for bad in ("x", "x:0", "x:-1", ":1", "x:abc", "x:inf"):
        with pytest.raises(ValueError):
            Tenant.parse(bad)


# --- random prompts ----------------------------------------------------------------------------------


def test_random_word_prompts_are_within_the_ranges_and_reproducible() -> None:
    config = WorkloadConfig(input_len=LengthSpec(10, 20), output_len=LengthSpec(3, 5), seed=7)
    specs = [Workload(config, None, ids_ok=True).sample(i) for i in range(300)]
    assert all(10 <= s.prompt_len <= 20 and s.prompt_len == len(s.prompt.split()) for s in specs)
    assert all(3 <= s.output_len <= 5 and s.prompt_token_ids is None for s in specs), "no tokenizer: no ids"
    assert {s.prompt_len for s in specs} == set(range(10, 21)) and {s.output_len for s in specs} == {3, 4, 5}
    again = Workload(config, None, ids_ok=True).sample(123)
    assert again == specs[123], "the same seed and index give the same request"
    other = Workload(WorkloadConfig(input_len=LengthSpec(10, 20), seed=8), None, ids_ok=True).sample(123)
    assert other.prompt != specs[123].prompt


def test_token_id_prompts_have_exact_lengths_and_no_special_tokens(tokenizer: Tokenizer) -> None:
    config = WorkloadConfig(input_len=LengthSpec(5, 40), output_len=LengthSpec(8, 8))
    specs = [Workload(config, tokenizer, ids_ok=True).sample(i) for i in range(200)]
    for s in specs:
        assert s.prompt_token_ids is not None and len(s.prompt_token_ids) == s.prompt_len
        assert 5 <= s.prompt_len <= 40 and s.output_len == 8
        assert not set(s.prompt_token_ids) & tokenizer.all_special_ids


def test_shared_prefix_groups_share_their_prefix_in_ids_and_text(tokenizer: Tokenizer) -> None:
    config = WorkloadConfig(input_len=LengthSpec(4, 12), prefix_groups=3, prefix_len=16, seed=1)
    specs = [Workload(config, tokenizer, ids_ok=True).sample(i) for i in range(60)]
    assert {s.group for s in specs} == {0, 1, 2}
    prefixes: dict[int | None, set[tuple[int, ...]]] = {}
    for s in specs:
        assert s.prompt_token_ids is not None and 20 <= s.prompt_len <= 28, "prefix + the drawn suffix"
        prefixes.setdefault(s.group, set()).add(s.prompt_token_ids[:16])
    assert all(len(p) == 1 for p in prefixes.values()), "one prefix per group"
    assert len({next(iter(p)) for p in prefixes.values()}) == 3, "different groups, different prefixes"
    suffixes = {s.prompt_token_ids[16:] for s in specs if s.prompt_token_ids}
    assert len(suffixes) > 50, "the rest of each prompt is its own"

    text_specs = [Workload(config, tokenizer, ids_ok=False).sample(i) for i in range(60)]
    for group in (0, 1, 2):
        prompts = [s.prompt for s in text_specs if s.group == group]
        head = prompts[0][:10]
        assert len(prompts) > 5 and all(p.startswith(head) for p in prompts)
    words = [Workload(config, None, ids_ok=False).sample(i) for i in range(30)]
    by_group = Counter(" ".join(s.prompt.split()[:16]) for s in words)
    assert len(by_group) == 3 and sum(by_group.values()) == 30


def test_text_prompts_re_encode_to_about_the_drawn_length(tokenizer: Tokenizer) -> None:
    config = WorkloadConfig(input_len=LengthSpec(16, 48))
    for i in range(100):
        s = Workload(config, tokenizer, ids_ok=False).sample(i)
        assert s.prompt_token_ids is None
        assert s.prompt_len == len(tokenizer.encode(s.prompt, add_special_tokens=False))
        assert 14 <= s.prompt_len <= 50


def test_long_short_mix_and_tenant_shares_follow_the_configuration() -> None:
    config = WorkloadConfig(
        input_len=LengthSpec(8, 8),
        output_len=LengthSpec(4, 4),
        long_share=0.2,
        long_input_len=LengthSpec(64, 64),
        long_output_len=LengthSpec(32, 32),
        tenants=(Tenant("quiet", 1, "sk-quiet"), Tenant("flood", 3, "")),
        api_key="sk-default",
    )
    workload = Workload(config, None, ids_ok=False)
    specs = [workload.sample(i) for i in range(4000)]
    lengths = Counter((s.prompt_len, s.output_len) for s in specs)
    assert set(lengths) == {(8, 4), (64, 32)}
    assert lengths[(64, 32)] / 4000 == pytest.approx(0.2, abs=0.03)
    tenants = Counter(s.tenant for s in specs)
    assert tenants["quiet"] / 4000 == pytest.approx(0.25, abs=0.03)
    assert {(s.tenant, s.api_key) for s in specs} == {("quiet", "sk-quiet"), ("flood", "sk-default")}


# --- ShareGPT ----------------------------------------------------------------------------------------


def _sharegpt(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_takes_the_first_human_turn_and_the_gpt_turns_length(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    answer = "The quick brown fox jumps over the lazy dog. " * 2
    path = _sharegpt(
        tmp_path,
        [
            {
                "id": "a",
                "conversations": [
                    {"from": "system", "value": "be nice"},
                    {"from": "human", "value": "Hi there"},
                    {"from": "gpt", "value": answer},
                    {"from": "human", "value": "more"},
                ],
            },
            {"id": "no-pair", "conversations": [{"from": "human", "value": "alone"}]},
            {"id": "empty", "conversations": []},
            {"id": "no-conversations"},
            {
                "id": "b",
                "conversations": [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 20}],
            },
        ],
    )
    with_tokens = load_sharegpt(path, tokenizer)
    assert [c.prompt for c in with_tokens] == ["Hi there", "x" * 40]
    assert with_tokens[0].output_len == len(tokenizer.encode(answer, add_special_tokens=False))
    estimated = load_sharegpt(path, None)
    assert (estimated[1].prompt_len, estimated[1].output_len) == (10, 5), "four characters a token"
    assert [c.prompt for c in load_sharegpt(path, None, max_total_len=20)] == ["x" * 40], "2 + 23 tokens > 20"

    specs = [
        Workload(WorkloadConfig(dataset="sharegpt", dataset_path=path), None, ids_ok=True).sample(i)
        for i in range(4)
    ]
    assert {s.prompt for s in specs} == {"Hi there", "x" * 40}
    assert all(s.prompt_token_ids is None for s in specs), "ShareGPT prompts are text"
    forced = WorkloadConfig(dataset="sharegpt", dataset_path=path, output_len=LengthSpec(7, 7))
    assert Workload(forced, None, ids_ok=True).sample(0).output_len == 7


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON"),
        ('{"conversations": []}', "expected a JSON list"),
        ("[1, 2]", "entry 0 is int"),
        ('[{"conversations": [{"from": "gpt", "value": "a"}]}]', "no usable conversation"),
        ("[]", "no usable conversation"),
    ],
)
def test_malformed_sharegpt_files_are_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(LoadgenError, match=message):
        load_sharegpt(path, None)


def test_missing_or_binary_dataset_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(LoadgenError, match="cannot read dataset"):
        load_sharegpt(tmp_path / "nope.json", None)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(LoadgenError, match="not UTF-8"):
        load_sharegpt(binary, None)


# --- arrivals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "burstiness"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0), ("constant", 1.0)]
)
def test_arrival_processes_have_the_asked_mean_rate(kind: str, burstiness: float) -> None:
    gaps = list(islice(arrival_gaps(kind, 20.0, burstiness, seed=3), 20000))
    assert 1 / statistics.fmean(gaps) == pytest.approx(20.0, rel=0.03)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    expected_cv2 = {"poisson": 1.0, "gamma": 1.0 / burstiness, "constant": 0.0}[kind]
    assert cv2 == pytest.approx(expected_cv2, rel=0.1, abs=1e-9), "gamma: burstiness < 1 is burstier"
    assert list(islice(arrival_gaps(kind, 20.0, burstiness, seed=3), 50)) == gaps[:50], "seeded"


def test_an_infinite_rate_sends_at_once_and_bad_parameters_are_refused() -> None:
    assert list(islice(arrival_gaps("poisson", float("inf")), 3)) == [0.0, 0.0, 0.0]
    for args in (("poisson", 0.0), ("gamma", 1.0, 0.0), ("closed", 1.0)):
        with pytest.raises(ValueError):
            next(arrival_gaps(*args))  # type: ignore[arg-type]


def test_issue_plan_counts_warmup_requests_apart() -> None:
    plan = IssuePlan(num_requests=3, warmup_requests=2)
    assert [plan.take(0.0) for _ in range(6)] == [True, True, False, False, False, None]
    assert plan.total == 5


def test_issue_plan_by_duration_and_warmup_seconds() -> None:
    plan = IssuePlan(duration=1.0, warmup_seconds=0.5)
    assert [plan.take(t) for t in (0.0, 0.4, 0.6, 1.0, 1.59, 1.6)] == [True, True, False, False, False, None]
    assert plan.total is None and plan.measured == 3
