"""The Markdown of the "Disaggregation" section (`benchmarks.disagg_bench`): the latency and throughput
summaries of each configuration's traces, the goals, and the notes that explain the figures."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.report import table
from benchmarks.serving_harness import QUIET_PCT, Trace, percentile, throughput

if TYPE_CHECKING:
    from benchmarks.disagg_bench import DisaggPlan, OfflineResult, SetupResult

GOAL_ITL_RATIO = 0.5  # disaggregated p99 ITL of the short requests <= this x colocated without chunking
GOAL_OVERHEAD_RATIO = 0.85  # gateway output tokens/s >= this x the offline engine's


# ------------------------------------------------------------------ statistics
@dataclass(frozen=True, slots=True)
class Summary:
    """The latencies (ms) and throughput of one configuration's mixed run."""

    itl_ms: tuple[float | None, float | None, float | None]  # short requests: p50, p95, p99 per delta
    short_ttft_ms: tuple[float | None, float | None]  # p50, p95
    long_ttft_ms: tuple[float | None, float | None]  # p50, max
    tok_s: float | None  # every output token / first send to last completion
    num_gaps: int
    num_multi: int  # deltas of the short requests that carried more than one token
    # short ITL p50 for gaps that ended while a long request was decoding (its first token → its
    # completion), and for all other gaps: what one long context in the decode batch costs
    itl_long_decoding_ms: float | None = None
    itl_otherwise_ms: float | None = None

    @classmethod
    def of(cls, traces: Sequence[Trace]) -> Summary:
        shorts = [t for t in traces if t.kind == "short"]
        gaps = [1e3 * g for t in shorts for g in t.gaps_s()]
        sttft = [1e3 * t.ttft_s for t in shorts if t.ttft_s is not None]
        lttft = [1e3 * t.ttft_s for t in traces if t.kind == "long" and t.ttft_s is not None]
        windows = [
            (t.arrivals[0], t.done_at) for t in traces if t.kind == "long" and t.arrivals and t.done_at
        ]
        during: list[float] = []
        otherwise: list[float] = []
        for t in shorts:
            for a, b in zip(t.arrivals, t.arrivals[1:], strict=False):
                (during if any(w0 < b <= w1 for w0, w1 in windows) else otherwise).append(1e3 * (b - a))
        return cls(
            (percentile(gaps, 50), percentile(gaps, 95), percentile(gaps, 99)),
            (percentile(sttft, 50), percentile(sttft, 95)),
            (percentile(lttft, 50), max(lttft) if lttft else None),
            throughput(traces),
            len(gaps),
            sum(n > 1 for t in shorts for n in t.sizes),
            percentile(during, 50),
            percentile(otherwise, 50),
        )


def same_tokens(traces: Sequence[Trace], reference: Sequence[Trace]) -> tuple[int, int]:
    """(requests whose tokens equal the reference's, requests compared)."""
    ref = {t.name: t.token_ids for t in reference}
    both = [t for t in traces if t.name in ref]
    return sum(t.token_ids == ref[t.name] for t in both), len(both)


def summary_line(s: Summary) -> str:
    return (
        f"short ITL p50/p95/p99 {_ms(s.itl_ms[0])}/{_ms(s.itl_ms[1])}/{_ms(s.itl_ms[2])} ms, "
        f"long TTFT p50 {_ms(s.long_ttft_ms[0])} ms, {_num(s.tok_s)} tok/s"
    )


# ------------------------------------------------------------------ the Markdown
def _title(quick: bool) -> str:
    return "## Disaggregation: decode latency under long prompts" + (
        " (quick smoke run: tiny sizes, not representative)" if quick else ""
    )


def render_section(
    plan: DisaggPlan,
    cores: tuple[int, ...],
    results: Sequence[SetupResult],
    offline: OfflineResult,
    header: str,
    quick: bool,
) -> str:
    by_key = {r.setup.key: r for r in results}
    ref = by_key.get("colocated")
    rows = []
    for r in results:
        if r.error:
            rows.append([r.setup.label, "failed", *["—"] * 9, _cell(r.error)])
            continue
        s = Summary.of(r.traces)
        agree = "(reference)" if r is ref else _agreement(r, ref)
        rows.append(
            [
                r.setup.label,
                *map(_ms, s.itl_ms),
                *map(_ms, s.short_ttft_ms),
                *map(_ms, s.long_ttft_ms),
                _num(s.tok_s),
                _num(r.others_cpu_pct),
                agree,
            ]
        )
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join(
        [
            _title(quick),
            "",
            header.rstrip("\n") + "  ",
            f"Load average at the end: {load}.",
            "",
            _setup_text(plan, cores, results),
            "",
            table(
                [
                    "configuration",
                    "short ITL p50 ms",
                    "p95",
                    "p99",
                    "short TTFT p50 ms",
                    "p95",
                    "long TTFT p50 ms",
                    "max",
                    "output tok/s",
                    "other CPU %",
                    "same greedy tokens",
                ],
                rows,
                "lrrrrrrrrrl",
            ),
            _table_notes(results),
            "",
            *_tradeoff_note(by_key, plan),
            _goal_itl(by_key),
            "",
            _overhead_text(plan, by_key.get("chunked"), offline),
            *_noise_note(results, offline),
        ]
    )


def _setup_text(plan: DisaggPlan, cores: tuple[int, ...], results: Sequence[SetupResult]) -> str:
    where = (
        f"cores {', '.join(map(str, cores))}" if len(cores) >= 2 else "one core (fewer than two available)"
    )
    shorts = plan.num_slots * plan.rounds
    lines = [
        f"The default model (SmolLM2-135M-Instruct, in the workers' default dtype: bf16 where this CPU runs it "
        f"faster, which is not batch-invariant, so greedy tokens may differ between configurations; "
        f"docs/ENGINE.md) on {where}. Three configurations, each started "
        "as real processes the way a user starts them, one after another in this run; the gateway and this "
        "benchmark's client float over both cores in every configuration. Every worker has "
        f"`--kv-cache-memory {plan.kv_cache_memory >> 20}MiB`; the gateway places statically.",
        "",
    ]
    for r in results:
        lines.append(f"- **{r.setup.label}**:")
        lines += [f"  - `{c}`" for c in r.setup.commands(plan.kv_cache_memory)]
    arrivals = ", ".join(f"{x:g}" for x in plan.long_arrivals_s)
    lines += [
        "",
        f"Workload, the same for each (seeded random token ids, greedy, EOS ignored): {shorts} short chat-sized "
        f"requests ({plan.short_prompt_lens[0]}–{plan.short_prompt_lens[1]}-token prompts, "
        f"{plan.short_output_lens[0]}–{plan.short_output_lens[1]} output tokens), {plan.num_slots} in flight "
        f"at a time ({plan.num_slots} client slots of {plan.rounds}, each sending its next request when one "
        f"ends), and {len(plan.long_arrivals_s)} long prompts of {plan.long_prompt_len} tokens "
        f"({plan.long_output_len} output tokens) sent {arrivals} s after the first short request. The short "
        f"prompts are below `--local-prefill-threshold {plan.local_prefill_threshold}`, so the disaggregated "
        "gateway prefills them on the decode worker and only the long prompts go through the prefill worker "
        "(KV pulled over NIXL). Before each measurement one short and one "
        f"{plan.local_prefill_threshold + 16}-token request warm the configuration up (untimed).",
        "",
        "The client (`baton.v1.Gateway/Generate`, one grpc.aio channel, prompt token ids) notes when each token "
        "delta arrives. *ITL*: the gap between consecutive deltas of one short request, measured per delta "
        "(a delta normally carries one token; the gateway merges tokens only for a lagging client, counted "
        "below). *TTFT*: request sent → first delta, client-side. *output tok/s*: every output token (short "
        "and long) ÷ first request sent → last completion. *other CPU %*: the share of the machine's CPU "
        "time that processes other than this benchmark's took during the run (the machine is shared; compare "
        "rows with similar values). *same greedy tokens*: requests whose tokens equal the "
        "colocated-without-chunking run's.",
    ]
    return "\n".join(lines)


def _agreement(r: SetupResult, ref: SetupResult | None) -> str:
    if ref is None or ref.error:
        return "—"
    shorts = same_tokens([t for t in r.traces if t.kind == "short"], ref.traces)
    longs = same_tokens([t for t in r.traces if t.kind == "long"], ref.traces)
    return f"{shorts[0]}/{shorts[1]} short, {longs[0]}/{longs[1]} long" + (
        "" if shorts[0] == shorts[1] and longs[0] == longs[1] else " **(differ)**"
    )


def _table_notes(results: Sequence[SetupResult]) -> str:
    done = [(r.setup.key, Summary.of(r.traces)) for r in results if not r.error]
    if not done:
        return ""
    merged = ", ".join(f"{key} {s.num_multi} of {s.num_gaps}" for key, s in done)
    steps = ", ".join(
        f"{key} {_ms(s.itl_long_decoding_ms)} vs {_ms(s.itl_otherwise_ms)} ms" for key, s in done
    )
    slowed = any(
        s.itl_long_decoding_ms and s.itl_otherwise_ms and s.itl_long_decoding_ms >= 1.5 * s.itl_otherwise_ms
        for _, s in done
    )
    why = (
        " One long context in the batch still slows every short request's decode step by 1.5x or more, "
        "wherever it was prefilled, although the decode attention reads each sequence's own context only "
        "(`baton::paged_decode_attention`): the long one's ~2k positions are read once per step, by all "
        "the step's threads, before any sequence's next token."
        if slowed
        else ""
    )
    return (
        f"Short-request deltas that carried more than one token (of all ITL samples): {merged}.\n\n"
        "Short ITL p50 while a long request was decoding in the same batch (from its first token to its "
        f"completion) vs at all other times: {steps}.{why}"
    )


def _tradeoff_note(by_key: dict[str, SetupResult], plan: DisaggPlan) -> list[str]:
    d, c = by_key.get("disagg"), by_key.get("colocated")
    if d is None or c is None or d.error or c.error:
        return []
    dl, cl = Summary.of(d.traces).long_ttft_ms[0], Summary.of(c.traces).long_ttft_ms[0]
    if not dl or not cl:
        return []
    one = d.setup.workers[0].threads
    return [
        f"The price of disaggregation on two cores: the prefill worker prefills each long prompt with "
        f"{one} thread on its own core, where the colocated worker uses {plan.threads}, so the long prompts' "
        f"TTFT (p50) is {dl / cl:.2f}x the colocated one's; the decode core meanwhile never stops for a "
        "prefill.",
        "",
    ]


def _noise_note(results: Sequence[SetupResult], offline: OfflineResult) -> list[str]:
    shares = [r.others_cpu_pct for r in results] + [x for r in results for x in r.burst_others_cpu_pct]
    busiest = max((x for x in [*shares, *offline.others_cpu_pct] if x is not None), default=None)
    if busiest is None or busiest < 2 * QUIET_PCT:
        return []
    return [
        "",
        f"**Caution**: other processes took up to {busiest:.0f}% of the machine's CPU during a measured "
        "phase (see *other CPU %*; the benchmark waited for a quiet moment before each, but the machine is "
        "shared): the rows were not measured under equal conditions, so treat their ratios as indicative "
        "and rerun the section on a quiet machine.",
    ]


def _goal_itl(by_key: dict[str, SetupResult]) -> str:
    def p99(key: str) -> float | None:
        r = by_key.get(key)
        return None if r is None or r.error else Summary.of(r.traces).itl_ms[2]

    d, c, k = p99("disagg"), p99("colocated"), p99("chunked")
    goal = (
        f"Goal: disaggregated p99 ITL of the short requests <= {GOAL_ITL_RATIO}x colocated without chunking: "
    )
    if d is None or not c:
        return goal + "**not measured** (a configuration failed)."
    ratio = d / c
    verdict = "met" if ratio <= GOAL_ITL_RATIO else "not met"
    chunked = f"; chunked prefill alone reaches {k / c:.2f}x" if k else ""
    return goal + f"**{verdict}** ({_ms(d)} ms ÷ {_ms(c)} ms = {ratio:.2f}x{chunked})."


def _overhead_text(plan: DisaggPlan, gateway: SetupResult | None, offline: OfflineResult) -> str:
    goal = f"Serving overhead: output tokens/s through the gateway >= {GOAL_OVERHEAD_RATIO}x the offline engine: "
    intro = (
        f"### Serving overhead\n\n{plan.overhead_requests} short requests (the same sizes, fresh prompts) "
        f"sent at once, {plan.overhead_repeats} burst(s) each way, the fastest counts: through the gateway "
        "to the colocated chunked-prefill worker above (after its mixed run), and through "
        f"`LLM.generate` in a fresh process on the same cores with `--threads {plan.threads}` and the "
        f"same engine flags (`{offline.command}`); between the gateway bursts, bursts of the same shapes "
        "(other token ids) go straight to the worker's `Worker.Decode`, which tells the gateway's share "
        "from the worker's. Output tokens ÷ wall time (served: first request sent → last completion, "
        "client-side).\n\n"
    )
    if gateway is None or gateway.error or not gateway.bursts or offline.error:
        why = offline.error or (gateway.error if gateway else None) or "no gateway bursts"
        return intro + goal + f"**not measured** ({_cell(why)})."
    g = [throughput(b) or 0.0 for b in gateway.bursts]
    w = [throughput(b) or 0.0 for b in gateway.direct_bursts]
    o = [sum(len(x) for x in toks) / s for toks, s in zip(offline.token_ids, offline.walls_s, strict=True)]
    agree = sum(
        t.token_ids == ids
        for b, toks in zip(gateway.bursts, offline.token_ids, strict=True)
        for t, ids in zip(b, toks, strict=True)
    )
    total = sum(len(b) for b in gateway.bursts)
    ratio = max(g) / max(o)
    rows = [
        [
            "gateway `Generate` → colocated worker",
            _runs(g),
            _ratio(max(g), max(o)),
            _others(gateway.burst_others_cpu_pct),
        ],
        [
            "worker `Decode` directly (no gateway)",
            _runs(w),
            _ratio(max(w, default=None), max(o)),
            _others(gateway.direct_others_cpu_pct),
        ],
        ["offline `LLM.generate`", _runs(o), "1.00", _others(offline.others_cpu_pct)],
    ]
    verdict = "met" if ratio >= GOAL_OVERHEAD_RATIO else "not met"
    return (
        intro
        + table(["path", "output tok/s", "x offline", "other CPU %"], rows, "lrrr")
        + f"\nSame greedy tokens through the gateway as offline: {agree}/{total}"
        + ("" if agree == total else " **(differ)**")
        + ".\n\n"
        + goal
        + f"**{verdict}** ({max(g):.1f} ÷ {max(o):.1f} = {ratio:.2f}x)."
    )


def _ratio(x: float | None, ref: float) -> str:
    return "—" if x is None or not ref else f"{x / ref:.2f}"


def _runs(xs: list[float]) -> str:
    if not xs:
        return "—"
    best = max(xs)
    others = [f"{x:.1f}" for x in xs if x != best]
    return f"{best:.1f}" + (f" ({', '.join(others)})" if others else "")


def _others(xs: Sequence[float | None]) -> str:
    return ", ".join(_num(x) for x in xs) or "—"


def _ms(x: float | None) -> str:
    return "—" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")[:300]
