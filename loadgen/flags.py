"""The flags of `loadgen run` and `loadgen compare` (docs/LOADGEN.md documents each): the parser, its
value checks, and the checks across flags. A bad value is ``loadgen: error: ...`` and exit status 2."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from loadgen.arrivals import ARRIVALS
from loadgen.results import DEFAULT_PERCENTILES, parse_percentiles, parse_slo
from loadgen.workload import LengthSpec, LoadgenError, Tenant

EXIT_USAGE = 2
DEFAULT_NUM_REQUESTS = 100


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser that raises ValueError with a message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise ValueError(f"expected a number > 0 ('inf' allowed where it makes sense), got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _finite_positive(text: str) -> float:
    value = _positive_float(text)
    if math.isinf(value):
        raise ValueError(f"expected a finite number > 0, got {text!r}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise ValueError(f"expected a share in [0, 1], got {text!r}")
    return value


def _warmup(text: str) -> tuple[int, float]:
    """``N`` requests or ``Ss`` seconds → (requests, seconds)."""
    if text.endswith("s"):
        seconds = float(text[:-1]) if text[:-1].replace(".", "", 1).isdigit() else -1.0
        if seconds < 0:
            raise ValueError(f"expected N (requests) or SECONDSs (e.g. 5s), got {text!r}")
        return 0, seconds
    return _non_negative_int(text), 0.0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="loadgen",
        description="Benchmark an LLM serving endpoint (Baton gRPC or any "
        "OpenAI-compatible HTTP server) with vLLM's metric definitions. See docs/LOADGEN.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,compare}")
    _add_run_parser(sub)
    cmp = sub.add_parser("compare", help="compare result files side by side (ratios vs the first)")
    cmp.add_argument("files", nargs="+", type=Path, help="result JSON files of `loadgen run`")
    cmp.add_argument(
        "--metrics",
        metavar="FIELD,...",
        type=_names,
        default=None,
        help="comma-separated result fields (default: throughputs and latency means and tails)",
    )
    cmp.add_argument(
        "--labels",
        metavar="NAME,...",
        type=_names,
        default=None,
        help="comma-separated names for the files (default: each result's label, else its name)",
    )
    cmp.add_argument(
        "--markdown",
        metavar="FILE",
        type=Path,
        default=None,
        help="also write the table as markdown to this file",
    )
    cmp.add_argument(
        "--plot", metavar="FILE", type=Path, default=None, help="also write a bar chart PNG to this file"
    )
    return parser


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    run = sub.add_parser("run", help="send a workload to a target and measure it")
    _add_target_flags(run.add_argument_group("target"))
    _add_workload_flags(run.add_argument_group("workload"))
    _add_arrival_flags(run.add_argument_group("arrivals"))
    _add_result_flags(run.add_argument_group("results"))


def _add_target_flags(t: argparse._ArgumentGroup) -> None:
    t.add_argument(
        "--target",
        metavar="URL",
        required=True,
        help="grpc://HOST:PORT (Baton Session) or http(s)://HOST:PORT (OpenAI-compatible)",
    )
    t.add_argument(
        "--model",
        metavar="NAME",
        default=None,
        help="model name to request (default: the first one the server lists)",
    )
    t.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="HTTP: /v1/completions or /v1/chat/completions; gRPC: prompt or chat messages",
    )
    t.add_argument(
        "--api-key",
        metavar="KEY",
        default="",
        help="sent as 'authorization: Bearer KEY' by requests of no tenant",
    )
    t.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="HF model dir, .gguf or 'default' (Baton's default model): exact token lengths",
    )
    t.add_argument("--temperature", metavar="T", type=float, default=0.0)
    t.add_argument("--ignore-eos", action="store_true", help="force every output to its full length")
    t.add_argument(
        "--extra-body",
        metavar="JSON",
        type=_typed(_json_object),
        default={},
        help="HTTP: a JSON object merged into every request body, for a server's own fields "
        "(e.g. '{\"min_tokens\": 64}' for llama.cpp)",
    )
    t.add_argument(
        "--no-stream-usage",
        action="store_true",
        help="HTTP: do not send stream_options.include_usage (for servers that reject it)",
    )
    t.add_argument(
        "--request-timeout",
        metavar="S",
        type=_typed(_finite_positive),
        default=600.0,
        help="seconds per request",
    )
    t.add_argument(
        "--connect-timeout",
        metavar="S",
        type=_typed(_finite_positive),
        default=10.0,
        help="seconds for the target's first answer",
    )
    t.add_argument(
        "--session-requests",
        metavar="N",
        type=_typed(_positive_int),
        default=32,
        help="gRPC: requests in flight per Session stream before another is opened",
    )


def _add_workload_flags(w: argparse._ArgumentGroup) -> None:
    length = _typed(LengthSpec.parse)
    w.add_argument("--dataset", choices=("random", "sharegpt"), default="random")
    w.add_argument(
        "--dataset-path", metavar="FILE", type=Path, default=None, help="ShareGPT-format JSON file"
    )
    w.add_argument(
        "--input-len",
        metavar="N|LO:HI",
        type=length,
        default=LengthSpec(128, 128),
        help="prompt tokens: N or LO:HI",
    )
    w.add_argument(
        "--output-len",
        metavar="N|LO:HI",
        type=length,
        default=None,
        help="output tokens (max_tokens): N or LO:HI (default 128; ShareGPT: the gpt turn's)",
    )
    w.add_argument(
        "--prefix-groups",
        metavar="N",
        type=_typed(_non_negative_int),
        default=0,
        help="requests fall into this many groups, each sharing a prefix",
    )
    w.add_argument(
        "--prefix-len",
        metavar="N",
        type=_typed(_non_negative_int),
        default=0,
        help="tokens of each group's shared prefix (before the --input-len tokens)",
    )
    w.add_argument(
        "--long-share", metavar="F", type=_typed(_share), default=0.0, help="share of requests that are long"
    )
    w.add_argument("--long-input-len", metavar="N|LO:HI", type=length, default=LengthSpec(2048, 2048))
    w.add_argument("--long-output-len", metavar="N|LO:HI", type=length, default=LengthSpec(256, 256))
    w.add_argument(
        "--tenant",
        metavar="NAME:SHARE[:KEY]",
        type=_typed(Tenant.parse),
        action="append",
        default=[],
        help="repeatable: a tenant's share of the requests and its API key",
    )
    w.add_argument(
        "--max-total-len",
        metavar="N",
        type=_typed(_positive_int),
        default=None,
        help="ShareGPT: skip conversations whose prompt + output tokens exceed this",
    )


def _add_arrival_flags(a: argparse._ArgumentGroup) -> None:
    a.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    a.add_argument(
        "--rate",
        metavar="R",
        type=_typed(_positive_float),
        default=math.inf,
        help="requests per second for poisson/gamma/constant (default inf: all at once)",
    )
    a.add_argument(
        "--burstiness",
        metavar="B",
        type=_typed(_finite_positive),
        default=None,
        help="gamma shape (vLLM's burstiness; 1 = Poisson)",
    )
    a.add_argument(
        "--concurrency",
        metavar="N",
        type=_typed(_positive_int),
        default=None,
        help="closed loop: clients sending back to back; open loop: a cap on requests in flight",
    )
    stop = a.add_mutually_exclusive_group()
    stop.add_argument(
        "--num-requests",
        metavar="N",
        type=_typed(_positive_int),
        default=None,
        help=f"measured requests (default {DEFAULT_NUM_REQUESTS})",
    )
    stop.add_argument(
        "--duration",
        metavar="S",
        type=_typed(_finite_positive),
        default=None,
        help="seconds of measured sending (in-flight requests then finish)",
    )
    a.add_argument(
        "--warmup",
        metavar="N|Ss",
        type=_typed(_warmup),
        default=(0, 0.0),
        help="N requests or Ss seconds sent first and left out of the results",
    )
    a.add_argument("--seed", metavar="N", type=int, default=0)


def _add_result_flags(r: argparse._ArgumentGroup) -> None:
    r.add_argument(
        "--percentiles",
        metavar="P,P,...",
        type=_typed(parse_percentiles),
        default=DEFAULT_PERCENTILES,
        help="comma-separated, e.g. 50,90,95,99 (the default)",
    )
    r.add_argument(
        "--slo",
        metavar="METRIC:MS,...",
        type=_typed(parse_slo),
        default=None,
        help="goodput SLOs in ms, e.g. ttft:200,itl:50 (ttft, tpot, itl, e2el)",
    )
    r.add_argument(
        "--result-file", metavar="FILE", type=Path, default=None, help="write the result JSON here"
    )
    r.add_argument(
        "--plot-dir",
        metavar="DIR",
        type=Path,
        default=None,
        help="write latency_cdf.png and throughput.png here",
    )
    r.add_argument(
        "--label", metavar="NAME", default=None, help="the run's name in the result and in `loadgen compare`"
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def check_run_args(args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot express; LoadgenError names the conflict."""
    if args.arrival == "closed" and args.concurrency is None:
        raise LoadgenError("--arrival closed needs --concurrency N")
    if args.arrival == "closed" and not math.isinf(args.rate):
        raise LoadgenError("--rate does not apply to --arrival closed (its rate is set by --concurrency)")
    if args.burstiness is not None and args.arrival != "gamma":
        raise LoadgenError("--burstiness applies to --arrival gamma only")
    if args.dataset == "sharegpt" and args.dataset_path is None:
        raise LoadgenError("--dataset sharegpt needs --dataset-path FILE")
    if args.dataset_path is not None and args.dataset != "sharegpt":
        raise LoadgenError("--dataset-path needs --dataset sharegpt")
    if (args.prefix_groups > 0) != (args.prefix_len > 0):
        raise LoadgenError("--prefix-groups and --prefix-len go together (both > 0)")
    if args.dataset == "sharegpt" and (args.prefix_groups or args.long_share):
        raise LoadgenError("--prefix-groups/--prefix-len and --long-share apply to --dataset random only")
