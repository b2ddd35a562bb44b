"""`make bench`: runs the benchmark sections and rewrites their parts of docs/BENCHMARKS.md.

    python -m benchmarks.run                      # every section, full sizes (minutes)
    python -m benchmarks.run --sections engine    # one section
    python -m benchmarks.run --quick              # tiny sizes, a smoke test; prints, writes nothing

Progress goes to stderr; a section whose contender fails records the error in its table.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import (
    autoscale_bench,
    disagg_bench,
    engine_bench,
    kv_bench,
    peer_bench,
    scheduler_bench,
    structured_bench,
    tenancy_bench,
)
from benchmarks.report import DEFAULT_PATH, update_section

# name → run(quick, command, threads, log) -> the section's Markdown
SECTIONS: dict[str, Callable[..., str]] = {
    "engine": engine_bench.run_section,
    "kv_transfer": kv_bench.run_section,
    "scheduler": scheduler_bench.run_section,
    "disaggregation": disagg_bench.run_section,
    "tenancy": tenancy_bench.run_section,
    "peers": peer_bench.run_section,
    "autoscaling": autoscale_bench.run_section,
    "structured": structured_bench.run_section,
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default: all = {','.join(SECTIONS)})",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test of the harness")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per benchmark process (default: min(2, available cores))",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the Markdown file to update (default: {DEFAULT_PATH.relative_to(DEFAULT_PATH.parents[1])}; "
        "with --quick the default is to print the sections and write nothing)",
    )
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown or not args.sections:
        p.error(
            f"unknown section(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}"
        )
    if args.out is None and not args.quick:
        args.out = DEFAULT_PATH
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    command = shlex.join(["python", "-m", "benchmarks.run", *raw])
    for name in args.sections:
        log(f"[bench] section {name}{' (quick)' if args.quick else ''}")
        t0 = time.perf_counter()
        body = SECTIONS[name](quick=args.quick, command=command, threads=args.threads, log=log)
        if args.out is not None:
            update_section(name, body, args.out)
            log(f"[bench] section {name} done in {time.perf_counter() - t0:.0f} s; wrote {args.out}")
        else:
            print(body)
            log(f"[bench] section {name} done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
