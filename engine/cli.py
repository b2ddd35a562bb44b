"""`baton generate` (stream one completion to stdout), `baton prepare-model` and `baton fetch-model`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from core.units import parse_bytes
from engine.config import DTYPES, QUANTIZATIONS


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    p.add_argument("prompt", help="the prompt (with --chat: the user message)")
    p.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)"
    )
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
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights, activations and KV cache (default auto: bfloat16 where this CPU runs it faster)",
    )
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="int8: weight-only int8")
    p.set_defaults(func=run_generate)


def add_evaluate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "evaluate", help="compare a candidate precision of a model with the reference, offline"
    )
    p.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="the reference's dtype (default float32)"
    )
    p.add_argument("--candidate-dtype", choices=DTYPES, default="auto")
    p.add_argument("--candidate-quantization", choices=QUANTIZATIONS, default="int8")
    p.add_argument("--prompts", type=int, default=64, help="texts to compare over (default 64)")
    p.add_argument("--tokens", type=int, default=64, help="tokens sampled per text from the reference")
    p.add_argument("--prompts-file", default=None, help="one prompt per line instead of the built-in ones")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    """Teacher-forced comparison (engine.quality) and decode speed of the two versions, side by side."""
    import json
    import time
    from pathlib import Path

    from core.sampling_params import SamplingParams
    from engine.llm import LLM
    from engine.quality import default_prompts, evaluate, sample_texts

    common = {"kv_cache_memory": 256 << 20, "num_threads": args.threads}
    reference = LLM(model=args.model, dtype=args.dtype, **common)
    candidate = LLM(
        model=args.model, dtype=args.candidate_dtype, quantization=args.candidate_quantization, **common
    )
    prompts = (
        Path(args.prompts_file).read_text().splitlines()
        if args.prompts_file
        else default_prompts(args.prompts)
    )
    prompts = [p for p in prompts if p.strip()][: args.prompts]
    texts = sample_texts(reference, prompts, args.tokens)
    a = evaluate(reference, candidate, texts, args.tokens)

    def tok_s(llm: LLM) -> float:  # 16 greedy streams of 64 tokens, after a warm-up
        batch = [t[:16] for t in (texts * 16)[:16]]
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        llm.generate(batch[:2], SamplingParams(max_tokens=4, temperature=0))
        t0 = time.perf_counter()
        llm.generate(batch, params)
        return 16 * 64 / (time.perf_counter() - t0)

    ref_tok_s, cand_tok_s = tok_s(reference), tok_s(candidate)
    cand_dtype = str(candidate.engine.runner.dtype).removeprefix("torch.")
    if args.json:
        print(
            json.dumps(
                {
                    "reference": {
                        "version": reference.engine.model_version,
                        "dtype": args.dtype,
                        "quantization": "none",
                        "tok_s_batch16": ref_tok_s,
                    },
                    "candidate": {
                        "version": candidate.engine.model_version,
                        "dtype": cand_dtype,
                        "quantization": args.candidate_quantization,
                        "tok_s_batch16": cand_tok_s,
                    },
                    "positions": a.num_positions,
                    "argmax_agreement": a.argmax_agreement,
                    "mean_kl": a.mean_kl,
                    "reference_nll": a.ref_nll,
                    "candidate_nll": a.cand_nll,
                }
            )
        )
        return 0
    print(
        f"reference {reference.engine.model_version} ({args.dtype}) vs candidate {candidate.engine.model_version} "
        f"({cand_dtype}, quantization {args.candidate_quantization}) over {a.num_positions} positions:"
    )
    print(
        f"  next-token argmax agreement {a.argmax_agreement:.2%}, mean KL {a.mean_kl:.4f} nats, "
        f"NLL {a.ref_nll:.4f} -> {a.cand_nll:.4f} ({a.nll_ratio - 1:+.2%})"
    )
    print(f"  decode, 16 streams: {ref_tok_s:.0f} -> {cand_tok_s:.0f} tok/s")
    return 0


def add_prepare_model_parser(sub: Any) -> None:
    p = sub.add_parser("prepare-model", help="dequantize the embedded default model into the cache")
    p.set_defaults(func=run_prepare_model)


def add_fetch_model_parser(sub: Any) -> None:
    """`baton fetch-model URI DEST`, what the chart's init container runs to fill the cache volume."""
    p = sub.add_parser(
        "fetch-model",
        help="fetch a model into a directory (hf://org/repo[@revision], an http(s) .tar/.tar.gz/.zip "
        "archive, or a local directory), atomically; prints the directory",
        description="Fetches a model into DEST atomically (via DEST.partial-*); a second run with the same "
        "URI does nothing. hf:// reads HF_ENDPOINT (default https://huggingface.co) and HF_TOKEN.",
    )
    p.add_argument(
        "uri", help="hf://org/repo[@revision], https://…/model.tar.gz (.tar, .tgz, .zip), or a path"
    )
    p.add_argument("dest", help="the model directory to create, inside the volume (e.g. /models/NAME)")
    p.add_argument(
        "--force", action="store_true", help="replace what DEST holds (another model, or this one)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=60.0, help="seconds to wait for a server, per connect and per read"
    )
    p.add_argument(
        "--retries", type=int, default=3, help="further tries of a broken transfer, resuming where it stopped"
    )
    p.set_defaults(func=run_fetch_model)


def run_fetch_model(args: argparse.Namespace) -> int:
    """Exit 0 with the model directory on stdout (fetched or already there); 1 with a one-line reason."""
    from pathlib import Path

    from engine.fetch import FetchError, config_from_env, fetch_model

    try:
        config = config_from_env(timeout_s=args.timeout_s, retries=args.retries)
        fetch_model(args.uri, Path(args.dest), config, force=args.force)
    except (FetchError, OSError) as e:  # OSError: local trouble (permissions, a full disk)
        print(f"baton fetch-model: error: {e}", file=sys.stderr)
        return 1
    print(Path(args.dest).absolute())
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from core.sampling_params import SamplingParams
    from engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        dtype=args.dtype,
        quantization=args.quantization,
    )
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
