"""Structured outputs in the engine (engine.structured, xgrammar): outputs held to a JSON schema, any JSON
object, a regex, a choice and a grammar (EBNF and Lark) on the tiny random model at temperature 1 —
whose unconstrained output is noise, so every valid output is the constraint's doing; the grammar
state carried over a migration (resumed tokens) exactly; a constrained request beside unconstrained
ones leaves theirs unchanged; bad constraints are clear errors. On the default model: 100 seeded
samples of a schema at temperature 1, every one valid."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from core.errors import InvalidRequest
from core.sampling_params import SamplingParams, StructuredOutput
from engine import LLM
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.structured import _pack_bits, vocab_type

pytestmark = pytest.mark.model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), kv_cache_memory=16 << 20, dtype="float32", num_threads=1)


def sampled(structured: StructuredOutput, seed: int, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=structured)


def test_json_schema_outputs_parse_and_validate(llm: LLM) -> None:
    constraint = StructuredOutput("json", json.dumps(SCHEMA))
    outs = llm.generate(["The quick brown fox"] * 20, [sampled(constraint, s) for s in range(20)])
    for o in outs:
        assert o.finish_reason == "stop", o.text  # the grammar ended it (EOS once the object closed)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 10  # sampled, not one forced answer
    free = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=30, temperature=1.0, seed=0))[0]
    with pytest.raises(ValueError):
        json.loads(free.text)  # without the constraint the tiny model writes noise


def test_json_object_regex_choice_and_grammars(llm: LLM) -> None:
    obj = llm.generate(["x"], sampled(StructuredOutput("json_object"), 1, 60))[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert obj.text.startswith("{")
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for seed in range(5):
        out = llm.generate(["x"], sampled(StructuredOutput("regex", pattern), seed, 20))[0]
        assert re.fullmatch(pattern, out.text), out.text
    choices = ["yes", "no", "maybe so"]
    got = {
        llm.generate(["x"], sampled(StructuredOutput("choice", json.dumps(choices)), s, 10))[0].text
        for s in range(12)
    }
    assert got <= set(choices) and len(got) > 1
    ebnf = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/'
    for spec, check in [(ebnf, r"\([0-9](\+[0-9])*\)"), (lark, r"<[a-z]{1,5}>")]:
        out = llm.generate(["x"], sampled(StructuredOutput("grammar", spec), 7, 30))[0]
        assert re.fullmatch(check, out.text), (spec, out.text)


def test_a_constrained_request_leaves_its_batch_alone(llm: LLM) -> None:
    prompts = ["The quick brown fox", "Paris is", "def add(a, b):"]
    plain = [SamplingParams(max_tokens=12, temperature=1.0, seed=50 + i, ignore_eos=True) for i in range(3)]
    alone = llm.generate(prompts, plain)
    constrained = sampled(StructuredOutput("json", json.dumps(SCHEMA)), 3)
    mixed = llm.generate([*prompts, "x"], [*plain, constrained])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[3].text), SCHEMA)


@pytest.mark.parametrize("k", [1, 6])
def test_the_grammar_state_travels_with_a_migrated_request(tiny_llama: Path, k: int) -> None:
    """Another engine given the tokens already sent (a handoff's first token, a migration's) replays
    them through the grammar and samples exactly the rest."""
    prompt = list(range(3, 30))
    params = sampled(StructuredOutput("json", json.dumps(SCHEMA)), 99)
    full = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20))
    full.add_request("r", prompt, params)
    done = [o for _ in range(200) for o in full.step() if o.finished][0]
    jsonschema.validate(json.loads(done.text), SCHEMA)

    other = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20))
    other.add_request("r", prompt, params, resume_token_ids=done.token_ids[:k])
    rest = [o for _ in range(200) for o in other.step()]
    assert [t for o in rest for t in o.new_token_ids] == done.token_ids[k:]
    with pytest.raises(InvalidRequest, match="does not match the request's JSON schema"):
        bad = other.tokenizer.encode("hello")
        other.add_request("r3", prompt, params, resume_token_ids=bad)


@pytest.mark.parametrize(
    "constraint, needle",
    [
        (
            StructuredOutput("json", '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'),
            "JSON schema",
        ),
        (StructuredOutput("json", "{not json"), "cannot be compiled"),
        (StructuredOutput("regex", "(unclosed"), "regex cannot be compiled"),
        (StructuredOutput("grammar", "root ::= undefined_rule"), "grammar cannot be compiled"),
        (StructuredOutput("choice", '"one"'), "choice constraint must be"),
    ],
)
def test_a_bad_constraint_is_a_clear_error(llm: LLM, constraint: StructuredOutput, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        llm.generate(["x"], sampled(constraint, 0))
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].token_ids  # the engine keeps serving


def test_constraint_values_are_checked() -> None:
    with pytest.raises(InvalidRequest, match="kind must be one of"):
        StructuredOutput("yaml", "a: 1")
    with pytest.raises(InvalidRequest, match="over the limit of 65536 bytes"):
        StructuredOutput("regex", "a" * 70000)
    with pytest.raises(InvalidRequest, match="must not be empty"):
        StructuredOutput("regex", "")


def test_bit_packing_and_vocabulary_kinds() -> None:
    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[[0, 31, 32, 69]] = True
    words = _pack_bits(allowed)
    assert words.dtype == torch.int32 and words.tolist() == [1 - 2**31 - 1 + 1, 1, 32]
    assert vocab_type({"decoder": {"type": "ByteLevel"}}) == "BYTE_LEVEL"
    fallback = {"decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}}
    assert vocab_type(fallback) == "BYTE_FALLBACK" and vocab_type({}) == "RAW"


@pytest.mark.slow
def test_default_model_schema_outputs_are_all_valid() -> None:
    """The acceptance figure: 100 seeded samples at temperature 1.0 on the default model, 100% valid."""
    llm = LLM(kv_cache_memory=64 << 20)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},  # digits end
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    }
    constraint = StructuredOutput("json", json.dumps(schema))
    messages = [{"role": "user", "content": "Describe Paris as JSON with city, country and population."}]
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=constraint) for s in range(100)
    ]
    outs = llm.chat([messages] * 100, params)
    valid = 0
    for o in outs:
        assert o.finish_reason == "stop", o.text  # the grammar ended it, within max_tokens
        jsonschema.validate(json.loads(o.text), schema)
        valid += 1
    assert valid == 100
