"""`loadgen run` (benchmark a serving endpoint) and `loadgen compare` (results side by side).

Bad flags, unreadable or malformed files and unreachable targets end with one line on stderr,
``loadgen: error: ...``, and exit status 2, never a traceback. docs/LOADGEN.md documents every flag.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from loadgen.flags import DEFAULT_NUM_REQUESTS, EXIT_USAGE, build_parser, check_run_args
from loadgen.record import RequestRecord
from loadgen.results import RunInfo, build_result
from loadgen.workload import LoadgenError, WorkloadConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "compare":
            return _compare(args)
        check_run_args(args)
        return _run(args)
    except LoadgenError as e:
        print(f"loadgen: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from loadgen.report import format_table, write_json
    from loadgen.runner import RunPlan, run_load
    from loadgen.targets import TargetConfig, make_target
    from loadgen.workload import Workload, load_tokenizer

    target = make_target(
        TargetConfig(
            url=args.target,
            model=args.model,
            endpoint=args.endpoint,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            stream_usage=not args.no_stream_usage,
            api_key=args.api_key,
            request_timeout=args.request_timeout,
            connect_timeout=args.connect_timeout,
            session_requests=args.session_requests,
            extra_body=args.extra_body,
        )
    )
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    workload = Workload(
        WorkloadConfig(
            dataset=args.dataset,
            dataset_path=args.dataset_path,
            input_len=args.input_len,
            output_len=args.output_len,
            prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len,
            long_share=args.long_share,
            long_input_len=args.long_input_len,
            long_output_len=args.long_output_len,
            tenants=tuple(args.tenant),
            api_key=args.api_key,
            max_total_len=args.max_total_len,
            seed=args.seed,
        ),
        tokenizer,
        target.accepts_token_ids,
    )
    warmup_requests, warmup_seconds = args.warmup
    plan = RunPlan(
        arrival=args.arrival,
        rate=args.rate,
        burstiness=args.burstiness or 1.0,
        concurrency=args.concurrency,
        duration=args.duration,
        num_requests=args.num_requests or (None if args.duration else DEFAULT_NUM_REQUESTS),
        warmup_requests=warmup_requests,
        warmup_seconds=warmup_seconds,
        seed=args.seed,
        progress=not args.no_progress,
    )
    date = datetime.now().strftime("%Y%m%d-%H%M%S")

    async def go() -> tuple[str, list[RequestRecord]]:
        try:
            model_id = await target.open()
            return model_id, await run_load(target, workload, plan)
        finally:
            await target.close()

    model_id, records = asyncio.run(go())
    if tokenizer is not None:  # servers that report no usage: count the text's tokens (vLLM does too)
        for record in records:
            if record.ok and record.output_tokens is None:
                record.output_tokens = len(tokenizer.encode(record.generated_text, add_special_tokens=False))
    info = RunInfo(
        date=date,
        backend=target.backend,
        model_id=model_id,
        tokenizer_id=args.tokenizer,
        request_rate=math.inf if args.arrival == "closed" else args.rate,
        burstiness={"poisson": 1.0, "gamma": plan.burstiness}.get(args.arrival),
        max_concurrency=args.concurrency,
        label=args.label,
        target=args.target,
        endpoint=args.endpoint,
        num_warmup=sum(r.warmup for r in records),
        settings=_settings(args),
    )
    result = build_result(records, info, args.percentiles, args.slo)
    print(format_table(result, args.percentiles))
    if args.result_file is not None:
        write_json(result, args.result_file)
        print(f"result: {args.result_file}")
    if args.plot_dir is not None:
        from loadgen.plots import write_plots

        for path in write_plots(result, args.plot_dir):
            print(f"plot: {path}")
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags as they go into the result's "loadgen" block."""
    keys = (
        "dataset",
        "dataset_path",
        "input_len",
        "output_len",
        "prefix_groups",
        "prefix_len",
        "long_share",
        "long_input_len",
        "long_output_len",
        "max_total_len",
        "arrival",
        "duration",
        "seed",
        "temperature",
        "ignore_eos",
    )
    settings: dict[str, Any] = {
        k: v if v is None or isinstance(v, int | float | str) else str(v)
        for k in keys
        for v in [getattr(args, k)]
    }
    settings["warmup"] = {"requests": args.warmup[0], "seconds": args.warmup[1]}
    settings["tenants"] = [{"name": t.name, "share": t.share} for t in args.tenant]  # keys stay out of files
    return settings


def _compare(args: argparse.Namespace) -> int:
    from loadgen.compare import compare_rows, format_markdown, format_table, plot_compare, run_labels
    from loadgen.report import read_json

    results = [read_json(path) for path in args.files]
    labels = run_labels(args.files, results, args.labels)
    rows = compare_rows(results, args.metrics)
    print(format_table(labels, rows))
    if args.markdown is not None:
        try:
            args.markdown.write_text(format_markdown(labels, rows))
        except OSError as e:
            raise LoadgenError(f"cannot write {str(args.markdown)!r}: {e.strerror or e}") from None
        print(f"markdown: {args.markdown}")
    if args.plot is not None:
        plot_compare(labels, rows, args.plot)
        print(f"plot: {args.plot}")
    return 0
