"""`baton generate` (stream one completion to stdout) and `baton prepare-model`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from core.units import parse_bytes
from engine.config import DTYPES, QUANTIZATIONS


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    p.add_argument("prompt", help="the prompt (with --chat: the user message)")
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default="256MiB", help="KV cache budget, e.g. 1GiB")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights, activations and KV cache (default auto: bfloat16 where this CPU runs it faster)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="int8: weight-only int8")
    p.set_defaults(func=run_generate)


def add_prepare_model_parser(sub: Any) -> None:
    p = sub.add_parser("prepare-model", help="dequantize the embedded default model into the cache")
    p.set_defaults(func=run_prepare_model)


def run_generate(args: argparse.Namespace) -> int:
    from core.sampling_params import SamplingParams
    from engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(model=args.model, kv_cache_memory=args.kv_cache_memory, num_threads=args.threads, dtype=args.dtype,
              quantization=args.quantization)
    prompt: str | list[int] = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt = llm.tokenizer.encode_chat(messages)
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_prepare_model(args: argparse.Namespace) -> int:
    from engine.gguf_convert import prepare_default_model

    print(prepare_default_model())
    return 0
