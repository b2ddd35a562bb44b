"""The "KV transfer" section: how long a decode worker takes to pull one prompt's KV blocks from a
prefill worker, with each backend (nixl, shm, tcp), beside a one-process memcpy of the same bytes and
the prefill that produced them.

Two processes, each pinned to its own core when there are two: the *source* prefills seeded random
prompts with the default model (`PrefillHandoff.prefill`, which pins the blocks under a lease) and
serves its one cache through all three transports; the *puller* holds a cache of the same layout and
pulls exactly that request's blocks (``KVHandle.block_ids``) with ``start_pull`` / ``poll``, several
times per backend, first into adjacent destination blocks (merged into runs by ``block_runs``) and then
into every other block (one descriptor per block). Every pulled block is checked against the source's
digest. The parent only relays messages; torch is imported in the children.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.report import MachineInfo, provenance, table

BACKENDS = ("nixl", "shm", "tcp")
BLOCK_SIZE = 16  # tokens per KV block, the engine's default
POLL_S = 50e-6  # how often the puller polls a pull in flight (an engine polls once per step)
GOAL_MEMCPY_RATIO = 0.3  # NIXL bandwidth >= this x memcpy
GOAL_PREFILL_SHARE = 0.05  # transfer time <= this x prefill time, at GOAL_TOKENS
GOAL_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class KVBenchPlan:
    """Prompt lengths and repetitions of one run."""

    prompt_lens: tuple[int, ...] = (512, 2048, 8000)
    repeats: int = 5  # timed pulls per backend and destination layout (after one untimed, verified pull)
    seed: int = 0
    num_threads: int = 1  # torch intra-op threads of each process

    @property
    def max_blocks(self) -> int:
        return blocks_for(max(self.prompt_lens) + 1)


@dataclass(slots=True)
class PullStats:
    """One backend pulling one request's blocks into one destination layout."""

    backend: str
    per_block: bool  # destination blocks non-adjacent: one descriptor per block
    num_descriptors: int = 0
    times_s: list[float] = field(default_factory=list)
    verified: bool = False  # the pulled bytes equal the source's, after the untimed and the last timed pull
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None


@dataclass(slots=True)
class LengthResult:
    """Everything measured for one prompt length."""

    num_tokens: int
    num_blocks: int
    num_bytes: int
    prefill_s: float
    memcpy_s: list[float]
    pulls: list[PullStats]
    releases: dict[str, int]  # release notifications the source received, per backend

    @property
    def memcpy_median_s(self) -> float:
        return statistics.median(self.memcpy_s)

    def pull(self, backend: str, per_block: bool = False) -> PullStats:
        return next(p for p in self.pulls if p.backend == backend and p.per_block == per_block)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def gb_per_s(num_bytes: int, seconds: float | None) -> float | None:
    return num_bytes / seconds / 1e9 if seconds else None


# ------------------------------------------------------------------ the children (torch lives here)
def _pin(core: int | None, num_threads: int) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(num_threads)


def _engine(num_blocks: int, num_threads: int) -> Any:
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import resolve_model_dir
    from engine.model_config import ModelConfig
    from engine.model_runner import kv_block_bytes

    block_bytes = kv_block_bytes(ModelConfig.from_dir(resolve_model_dir(None)), BLOCK_SIZE, torch.float32)
    return LLMEngine(
        EngineConfig(
            model=None,
            device="cpu",
            dtype="float32",
            block_size=BLOCK_SIZE,
            kv_cache_memory=num_blocks * block_bytes,
            num_threads=num_threads,
        )
    )


def _transports(engine: Any, role: str) -> dict[str, Any]:
    """One transport per backend, none registered yet."""
    from kv_transfer.transport import make_transport
    from prefill_worker.handoff import kv_layout

    layout = kv_layout(engine)
    return {kind: make_transport(kind, f"kvbench-{role}-{kind}-{os.getpid()}", layout) for kind in BACKENDS}


def _register_others(engine: Any, transports: dict[str, Any]) -> None:
    """All backends serve the engine's one cache: shm is registered first, because its ``register``
    moves the cache into /dev/shm (and returns the new tensor); nixl and tcp then register that tensor."""
    for kind in ("nixl", "tcp"):
        transports[kind].register(engine.runner.kv_cache)


def blocks_digest(cache: Any, blocks: Sequence[int]) -> str:
    """A digest of the bytes of ``blocks``, in order (a block of the block-major cache is contiguous)."""
    h = hashlib.blake2b(digest_size=16)
    for b in blocks:
        h.update(cache[b].numpy())
    return h.hexdigest()


def _exit(conn: Any) -> None:
    # A process that used NIXL may segfault at interpreter exit: leave without running finalizers.
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def source_main(conn: Any, core: int | None, num_threads: int, max_blocks: int) -> None:
    """The prefill side: prefills on command and keeps each lease pinned until the parent releases it."""
    from benchmarks.step_profile import random_prompts
    from core.sampling_params import SamplingParams
    from prefill_worker.handoff import PrefillHandoff

    _pin(core, num_threads)
    engine = _engine(max_blocks + 4, num_threads)
    transports = _transports(engine, "src")
    handoff = PrefillHandoff(
        engine, transports["shm"], lease_ttl_s=24 * 3600.0
    )  # registers shm: the cache moves
    _register_others(engine, transports)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    _release(handoff, handoff.prefill("warmup", random_prompts(1, 64, vocab, 12345)[0], params)[1].lease_id)
    conn.send(
        {
            "metadata": {k: t.metadata() for k, t in transports.items()},
            "block_bytes": transports["nixl"].layout.block_bytes,
        }
    )
    releases: Counter[str] = Counter()
    while True:
        if not conn.poll(0.002):  # idle: drain the peers' release notifications (and drive NIXL's progress)
            for kind, t in transports.items():
                releases[kind] += len(t.poll_notifications())
            continue
        cmd, *args = conn.recv()
        try:
            if cmd == "prefill":
                num_tokens, seed = args
                t0 = time.perf_counter()
                _, handle = handoff.prefill(
                    f"p{num_tokens}", random_prompts(1, num_tokens, vocab, seed)[0], params
                )
                prefill_s = time.perf_counter() - t0
                blocks = list(handle.block_ids[: blocks_for(num_tokens)])
                cache = engine.runner.kv_cache
                empty = sum(not bool(cache[b].any()) for b in blocks)
                conn.send(
                    {
                        "lease": handle.lease_id,
                        "blocks": blocks,
                        "prefill_s": prefill_s,
                        "digest": blocks_digest(cache, blocks),
                        "empty_blocks": empty,
                    }
                )
            elif cmd == "release":
                for kind, t in transports.items():
                    releases[kind] += len(t.poll_notifications())
                _release(handoff, args[0])
                conn.send(dict(releases))
                releases.clear()
            elif cmd == "stop":
                for t in transports.values():
                    t.close()
                conn.send("bye")
                _exit(conn)
        except Exception as e:
            traceback.print_exc()
            conn.send({"error": f"{type(e).__name__}: {e}"})


def _release(handoff: Any, lease_id: str) -> None:
    """Frees a lease's blocks directly (``service()`` would free them at the first pull's release)."""
    handoff.leases.pop(lease_id, None)
    handoff.engine.unpin_lease(lease_id)


def puller_main(
    conn: Any, core: int | None, num_threads: int, num_blocks: int, metadata: dict[str, bytes]
) -> None:
    """The decode side: pulls block lists from the source on command, times and verifies them."""
    _pin(core, num_threads)
    engine = _engine(num_blocks, num_threads)
    transports = _transports(engine, "dst")
    engine.runner.kv_cache = transports["shm"].register(engine.runner.kv_cache)
    _register_others(engine, transports)
    peers = {kind: transports[kind].add_peer(metadata[kind]) for kind in BACKENDS}
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "pull":
                backend, src, dst, repeats, digest = args
                conn.send(
                    _pulls(
                        transports[backend], peers[backend], engine.runner.kv_cache, src, dst, repeats, digest
                    )
                )
            elif cmd == "memcpy":
                conn.send(_memcpy(*args))
            elif cmd == "stop":
                for t in transports.values():
                    t.close()
                conn.send("bye")
                _exit(conn)
        except Exception as e:
            traceback.print_exc()
            conn.send({"error": f"{type(e).__name__}: {e}"})


def _pulls(
    transport: Any, peer: str, cache: Any, src: list[int], dst: list[int], repeats: int, digest: str
) -> dict[str, Any]:
    """One untimed pull, then ``repeats`` timed ones; the destination is zeroed before each (untimed)
    and compared with the source's digest after the first and the last."""
    import torch

    index = torch.tensor(dst)
    tag = f"bench-{time.monotonic_ns()}"

    def once(i: int) -> float:
        cache.index_fill_(0, index, 0)
        t0 = time.perf_counter()
        pull = transport.start_pull(peer, src, dst, f"{tag}-{i}")
        deadline = t0 + 120.0
        while not pull.poll():
            if time.perf_counter() > deadline:
                pull.cancel()
                raise TimeoutError("the pull did not finish in 120 s")
            time.sleep(POLL_S)
        return time.perf_counter() - t0

    once(-1)
    verified = blocks_digest(cache, dst) == digest
    times = [once(i) for i in range(repeats)]
    return {"times_s": times, "verified": verified and blocks_digest(cache, dst) == digest}


def _memcpy(num_bytes: int, repeats: int) -> list[float]:
    """``dst.copy_(src)`` between two preallocated tensors of ``num_bytes``, in this one process."""
    import torch

    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    if not torch.equal(src, dst):
        raise RuntimeError("memcpy baseline copied wrong bytes")
    return times[1:]


# ------------------------------------------------------------------ the parent
class _Child:
    """A spawned process spoken to over a pipe; an answer ``{"error": ...}`` raises."""

    def __init__(self, name: str, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=name)
        self.proc.start()
        child.close()

    def recv(self, timeout_s: float) -> Any:
        try:
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"the {self.name} process gave no answer in {timeout_s:.0f} s")
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            self.proc.join(1)
            raise RuntimeError(f"the {self.name} process died (exit code {self.proc.exitcode})") from e
        if isinstance(msg, dict) and "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}")
        return msg

    def call(self, timeout_s: float, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.recv(timeout_s)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call(30, "stop")
            except (RuntimeError, OSError) as e:
                print(f"[kv_transfer] {self.name} did not stop cleanly: {e}", file=sys.stderr)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _cores() -> tuple[int | None, int | None]:
    cores = sorted(os.sched_getaffinity(0))
    return (cores[0], cores[1]) if len(cores) >= 2 else (None, None)


def measure(plan: KVBenchPlan, log: Callable[[str], None]) -> list[LengthResult]:
    """Runs the source and the puller and measures every prompt length of ``plan``."""
    src_core, dst_core = _cores()
    source = _Child("source", source_main, src_core, plan.num_threads, plan.max_blocks)
    puller: _Child | None = None
    try:
        hello = source.recv(600)
        block_bytes: int = hello["block_bytes"]
        puller = _Child(
            "puller", puller_main, dst_core, plan.num_threads, 2 * plan.max_blocks + 2, hello["metadata"]
        )
        puller.recv(600)
        results = []
        for num_tokens in plan.prompt_lens:
            pre = source.call(1800, "prefill", num_tokens, plan.seed + num_tokens)
            if pre["empty_blocks"]:
                raise RuntimeError(
                    f"{pre['empty_blocks']} of the source's blocks are all zeros after the prefill"
                )
            src: list[int] = pre["blocks"]
            n = len(src)
            log(
                f"[kv_transfer] {num_tokens} tokens: prefill {pre['prefill_s']:.2f} s, {n} blocks "
                f"({n * block_bytes / 2**20:.0f} MiB)"
            )
            memcpy = puller.call(600, "memcpy", n * block_bytes, plan.repeats)
            pulls = []
            for backend in BACKENDS:
                for per_block in (False, True):
                    pulls.append(_pull(puller, backend, per_block, src, plan.repeats, pre["digest"]))
                    log(f"[kv_transfer]   {_describe(pulls[-1], n * block_bytes)}")
            releases = source.call(60, "release", pre["lease"])
            results.append(
                LengthResult(num_tokens, n, n * block_bytes, pre["prefill_s"], memcpy, pulls, releases)
            )
        return results
    finally:
        if puller is not None:
            puller.stop()
        source.stop()


def _pull(
    puller: _Child, backend: str, per_block: bool, src: list[int], repeats: int, digest: str
) -> PullStats:
    from kv_transfer.handle import block_runs

    dst = [2 * i for i in range(len(src))] if per_block else list(range(len(src)))
    stats = PullStats(backend, per_block, num_descriptors=len(block_runs(src, dst)))
    try:
        got = puller.call(600, "pull", backend, src, dst, repeats, digest)
    except RuntimeError as e:  # a backend that fails is a row with its error
        stats.error = str(e)
    else:
        stats.times_s, stats.verified = got["times_s"], got["verified"]
    return stats


def _describe(p: PullStats, num_bytes: int) -> str:
    what = f"{p.backend} {'per block' if p.per_block else 'merged'} ({p.num_descriptors} descriptors)"
    if p.error:
        return f"{what}: failed: {p.error}"
    return (
        f"{what}: {1e3 * (p.median_s or 0):.1f} ms, {gb_per_s(num_bytes, p.median_s) or 0:.2f} GB/s, "
        f"verified {p.verified}"
    )


def run_section(
    quick: bool, command: str, threads: int | None = None, log: Callable[[str], None] = print
) -> str:
    """Measures every prompt length and backend; returns the section's Markdown."""
    plan = KVBenchPlan(num_threads=threads or 1)
    if quick:
        plan = KVBenchPlan(prompt_lens=(32, 64), repeats=1, num_threads=plan.num_threads)
    machine = MachineInfo.probe(num_threads=plan.num_threads)
    header = provenance(machine, command)
    t0 = time.perf_counter()
    try:
        results = measure(plan, log)
    except RuntimeError as e:
        log(f"[kv_transfer] failed: {e}")
        return f"{_title(quick)}\n\n{header}\nThe run failed: {_cell(str(e))}\n"
    log(f"[kv_transfer] measured in {time.perf_counter() - t0:.0f} s")
    return render_section(plan, results, header, quick, pinned=_cores()[0] is not None)


# ------------------------------------------------------------------ the Markdown
def _title(quick: bool) -> str:
    return "## KV transfer: prefill → decode on CPU" + (
        " (quick smoke run: tiny sizes, not representative)" if quick else ""
    )


def render_section(
    plan: KVBenchPlan, results: list[LengthResult], header: str, quick: bool, pinned: bool = True
) -> str:
    where = "each pinned to its own core" if pinned else "not pinned (fewer than two cores)"
    return "\n".join(
        [
            _title(quick),
            "",
            header,
            f"Two processes, {where}, each with `torch.set_num_threads({plan.num_threads})`: a *source* that "
            "prefills a prompt of seeded random token ids with the default model (SmolLM2-135M-Instruct, fp32; "
            "`PrefillHandoff.prefill`, which pins the blocks under a lease) and serves its one KV cache through "
            "all three transports, and a *puller* with a cache of the same layout. The puller pulls exactly the "
            f"request's blocks (`KVHandle.block_ids`; {BLOCK_SIZE} tokens and `KVLayout.block_bytes` per block) "
            f"with `start_pull` and polls every {POLL_S * 1e6:.0f} µs until it lands: one untimed pull, then "
            f"{plan.repeats} timed, the median counts. The destination blocks are zeroed before every pull "
            "(untimed) and compared with the source's digest after the first and the last pull (*verified*). "
            "*memcpy*: `dst.copy_(src)` of the same number of bytes between two preallocated tensors in the "
            "puller. *prefill*: the engine steps of the source until the first token, on one core with "
            f"{plan.num_threads} thread(s); more threads shorten the prefill and raise *% of prefill* in "
            "proportion.",
            "",
            table(
                [
                    "prompt tokens",
                    "blocks (MiB)",
                    "prefill s",
                    "path",
                    "descriptors",
                    "median ms",
                    "GB/s",
                    "x memcpy",
                    "% of prefill",
                    "verified",
                ],
                _main_rows(results),
                "rrrlrrrrrl",
            ),
            "### Merged runs against one descriptor per block",
            "",
            "The same blocks pulled into every other block of the puller's cache, so no two are adjacent and "
            "`block_runs` cannot merge them: one descriptor (and, for tcp and shm, one copy call) per block.",
            "",
            table(
                [
                    "prompt tokens",
                    "backend",
                    "merged: descriptors",
                    "GB/s",
                    "per block: descriptors",
                    "GB/s",
                    "per block ÷ merged",
                    "verified",
                ],
                _merge_rows(results),
                "rlrrrrrl",
            ),
            _merge_note(results),
            "",
            _goals(results),
            "",
            _descriptor_note(results),
            "",
            _release_note(results, plan.repeats),
        ]
    )


def _main_rows(results: list[LengthResult]) -> list[list[str]]:
    rows = []
    for r in results:
        memcpy_bw = gb_per_s(r.num_bytes, r.memcpy_median_s)
        rows.append(
            [
                str(r.num_tokens),
                f"{r.num_blocks} ({r.num_bytes / 2**20:.0f})",
                f"{r.prefill_s:.2f}",
                "memcpy (one process)",
                "—",
                f"{1e3 * r.memcpy_median_s:.1f}",
                _num(memcpy_bw),
                "1.00",
                _pct(r.memcpy_median_s, r.prefill_s),
                "yes",
            ]
        )
        for backend in BACKENDS:
            p = r.pull(backend)
            if p.error:
                rows.append(
                    ["", "", "", backend, str(p.num_descriptors), "failed", "—", "—", "—", _cell(p.error)]
                )
                continue
            bw = gb_per_s(r.num_bytes, p.median_s)
            rows.append(
                [
                    "",
                    "",
                    "",
                    backend,
                    str(p.num_descriptors),
                    f"{1e3 * (p.median_s or 0):.1f}",
                    _num(bw),
                    _ratio(bw, memcpy_bw),
                    _pct(p.median_s, r.prefill_s),
                    _yes(p.verified),
                ]
            )
    return rows


def _merge_rows(results: list[LengthResult]) -> list[list[str]]:
    rows = []
    for r in results:
        for backend in BACKENDS:
            merged, single = r.pull(backend), r.pull(backend, per_block=True)
            bw_m, bw_s = gb_per_s(r.num_bytes, merged.median_s), gb_per_s(r.num_bytes, single.median_s)
            rows.append(
                [
                    str(r.num_tokens),
                    backend,
                    str(merged.num_descriptors),
                    _num(bw_m) if not merged.error else "failed",
                    str(single.num_descriptors),
                    _num(bw_s) if not single.error else "failed",
                    _ratio(bw_s, bw_m),
                    _yes(merged.verified and single.verified),
                ]
            )
    return rows


def _merge_note(results: list[LengthResult]) -> str:
    ratios = [
        _safe_div(
            gb_per_s(r.num_bytes, r.pull("nixl", True).median_s),
            gb_per_s(r.num_bytes, r.pull("nixl").median_s),
        )
        for r in results
    ]
    measured = [x for x in ratios if x is not None]
    if not measured:
        return "NIXL failed, so the cost of one descriptor per block was not measured."
    bb = results[0].num_bytes // max(1, results[0].num_blocks)
    lo, hi = min(measured), max(measured)
    verdict = (
        "no measurable cost at this block size (on one host, NIXL's cost per descriptor is small "
        "beside copying a whole block)"
        if lo >= 0.8
        else f"a cost of up to {100 * (1 - lo):.0f}% of the bandwidth, which merging saves"
    )
    return (
        f"With {bb / 2**10:.0f} KiB per block, one NIXL descriptor per block reached {lo:.2f}–{hi:.2f}x "
        f"the merged bandwidth: {verdict}. Descriptors of a few KiB (a per-layer or per-head layout) are "
        "another matter, not measured here."
    )


def _goals(results: list[LengthResult]) -> str:
    ratios = {
        r.num_tokens: _safe_div(
            gb_per_s(r.num_bytes, r.pull("nixl").median_s), gb_per_s(r.num_bytes, r.memcpy_median_s)
        )
        for r in results
    }
    measured = {n: x for n, x in ratios.items() if x is not None}
    if not measured:
        bw = f"NIXL >= {GOAL_MEMCPY_RATIO}x memcpy bandwidth: **not measured** (NIXL failed)."
    else:
        met = [n for n, x in measured.items() if x >= GOAL_MEMCPY_RATIO]
        verdict = (
            "met"
            if len(met) == len(ratios)
            else ("not met" if not met else f"met at {', '.join(map(str, met))} tokens only")
        )
        bw = (
            f"NIXL >= {GOAL_MEMCPY_RATIO}x memcpy bandwidth: **{verdict}** ("
            + ", ".join(f"{x:.2f}x at {n}" for n, x in measured.items())
            + " tokens)."
        )
    at = next((r for r in results if r.num_tokens == GOAL_TOKENS), None)
    if at is None:
        share = (
            f"NIXL transfer <= {GOAL_PREFILL_SHARE:.0%} of the prefill time at {GOAL_TOKENS} tokens: "
            "**not measured**."
        )
    else:
        parts = {b: _safe_div(at.pull(b).median_s, at.prefill_s) for b in BACKENDS}
        nixl = parts["nixl"]
        verdict = "not measured" if nixl is None else ("met" if nixl <= GOAL_PREFILL_SHARE else "not met")
        share = (
            f"NIXL transfer <= {GOAL_PREFILL_SHARE:.0%} of the prefill time at {GOAL_TOKENS} tokens: "
            f"**{verdict}** (" + ", ".join(f"{b} {_pct_of(x)}" for b, x in parts.items()) + ")."
        )
    return f"Goals: {bw} {share}"


def _descriptor_note(results: list[LengthResult]) -> str:
    counts = ", ".join(
        f"{r.num_tokens} tokens: {r.num_blocks} blocks → {r.pull('nixl').num_descriptors}" for r in results
    )
    fragmented = [r.num_tokens for r in results if r.pull("nixl").num_descriptors > 1]
    why = (
        " Where a request takes more than one descriptor, its source blocks were not ascending-adjacent: "
        "a prefill that takes blocks evicted from the prefix cache (here, those of the earlier, released "
        "prompts) gets them tail first, in descending order, and `block_runs` merges only ascending runs."
        if fragmented
        else ""
    )
    return (
        f"Descriptors after `block_runs` merging (source blocks as the prefill allocated them, destination "
        f"blocks adjacent, as a fresh decode cache allocates them): {counts}.{why}"
    )


def _release_note(results: list[LengthResult], repeats: int) -> str:
    expected = 2 * (repeats + 1)  # both destination layouts, the untimed pull included
    got = ", ".join(f"{b} " + "/".join(str(r.releases.get(b, 0)) for r in results) for b in BACKENDS)
    return (
        f"Release notifications the source received per prompt length (expected {expected} per backend "
        f"each): {got}. The source drained them without unpinning, so one lease served every pull."
    )


def _safe_div(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _ratio(x: float | None, ref: float | None) -> str:
    r = _safe_div(x, ref)
    return "—" if r is None else f"{r:.2f}"


def _pct(x: float | None, ref: float | None) -> str:
    return _pct_of(_safe_div(x, ref))


def _pct_of(r: float | None) -> str:
    if r is None:
        return "—"
    return f"{100 * r:.2f}%" if r < 0.01 else f"{100 * r:.1f}%"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**NO**"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")[:300]
