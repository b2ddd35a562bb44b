"""guidellm, the vLLM project's load-testing tool, installed from PyPI as its users install it, benchmarks
`baton up` (tiny model) on /v1/chat/completions and on /v1/completions, each with a concurrent profile
(4 streams) and a Poisson one (4 requests/s): every request completes, none errs, and the tokens guidellm
counts — from the usage the server streams back — add up to the increase of the gateway's own counters
of prompt and generated tokens over that run.

Why a tool we did not write: guidellm sends what a benchmark user's client sends (streaming with
``stream_options: {include_usage, continuous_usage_stats}``, ``max_completion_tokens``, ``ignore_eos``,
message content as a list of text parts, a model name from /v1/models, a /health probe first) and errs on any status or stream it
does not accept, so a field the server rejects or a usage it miscounts shows here as it would to them.
Each run asks for a fixed number of requests of a fixed output length (``ignore_eos``), so every request
must also stream exactly that many tokens.

guidellm lives in a venv of its own ($BATON_GUIDELLM, else .venv-guidellm/bin/guidellm); where it is
missing, deploy/peers/install-guidellm.sh installs it (once, about a minute): the test never skips. It
reads the tiny model's tokenizer from its directory, never from a model hub.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT, BatonUp, Scrape, start_baton_up

pytestmark = pytest.mark.e2e

INSTALL = ROOT / "deploy" / "peers" / "install-guidellm.sh"
REQUESTS = 16  # per run: each run is bounded by count, never by time
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 16
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
PROFILES = {"concurrent": "kind=concurrent,streams=4", "poisson": "kind=poisson,rate=4"}
COUNTERS = ("baton_gateway_prompt_tokens_total", "baton_gateway_generation_tokens_total")


@pytest.fixture(scope="module")
def guidellm() -> Path:
    """The guidellm binary; installed by deploy/peers/install-guidellm.sh into its venv if missing."""
    binary = Path(os.environ.get("BATON_GUIDELLM") or ROOT / ".venv-guidellm" / "bin" / "guidellm")
    if not binary.is_file():
        venv = binary.parent.parent
        out = subprocess.run(
            [str(INSTALL), str(venv)], cwd=ROOT, capture_output=True, text=True, timeout=1800
        )
        assert out.returncode == 0, f"{INSTALL} {venv} failed:\n{out.stdout}{out.stderr}"
        assert binary.is_file(), f"{INSTALL} {venv} left no {binary}:\n{out.stdout}{out.stderr}"
    return binary


@pytest.fixture(scope="module")
def up(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatonUp]:
    cluster = start_baton_up(
        tmp_path_factory.mktemp("guidellm-up") / "logs",
        *("--model", str(tiny_llama), "--kv-transport", "tcp", "--dtype", "float32"),
    )
    try:
        yield cluster
    finally:
        cluster.shut_down()


def run_guidellm(
    guidellm: Path, up: BatonUp, tokenizer: Path, endpoint: str, profile: str, out_dir: Path
) -> dict[str, Any]:
    """One `guidellm run` of ``REQUESTS`` synthetic requests against ``up``; the one benchmark of its
    JSON report. Fails with everything guidellm printed if it exits non-zero."""
    report = out_dir / "benchmarks.json"
    cmd = [
        str(guidellm),
        "run",
        *("--backend", f"kind=openai_http,target={up.http},request_format={endpoint}"),
        *("--profile", profile),
        *("--constraint", f"kind=max_requests,count={REQUESTS}"),
        *("--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"),
        *("--tokenizer", f"kind=huggingface_auto,model={tokenizer}"),
        *("--output", f"kind=json,path={report}"),
        "--disable-console-interactive",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "HF_HUB_OFFLINE": "1",  # the tokenizer is the model's directory: no hub, no network
        "TRANSFORMERS_OFFLINE": "1",
        # guidellm's default is up to 10 worker processes, each importing torch: on 2 cores, 2 do
        # (each runs many requests at once; the profile, not the process count, sets the load).
        "GUIDELLM__MAX_WORKER_PROCESSES": "2",
        "GUIDELLM__LOGGING__LOG_FILE": str(out_dir / "guidellm.log"),
    }
    out = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-6000:]}{out.stderr}"
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 1, "one profile of one rate or stream count: one benchmark"
    return dict(benchmarks[0])


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_guidellm_benchmark_completes_without_errors_and_counts_the_servers_tokens(
    guidellm: Path, up: BatonUp, tiny_llama: Path, tmp_path: Path, endpoint: str, profile: str
) -> None:
    metrics_url = f"{up.http}/metrics"
    # Nothing else calls this cluster: the tests of the module run one after another, and each run is
    # over (every request ended) when guidellm exits.
    before = Scrape(metrics_url)
    benchmark = run_guidellm(guidellm, up, tiny_llama, endpoint, PROFILES[profile], tmp_path)
    after = Scrape(metrics_url)

    requests = benchmark["requests"]
    errors = [(r["info"]["error"], r["request_args"]) for r in requests["errored"]]
    assert benchmark["metrics"]["request_totals"]["errored"] == 0, f"errored requests: {errors[:3]}"
    assert benchmark["metrics"]["request_totals"]["incomplete"] == 0
    assert benchmark["metrics"]["request_totals"]["successful"] == REQUESTS
    assert benchmark["scheduler_state"]["errored_requests"] == 0
    completed = requests["successful"]
    assert len(completed) == REQUESTS, "the report keeps every request (no sampling)"
    assert benchmark["config"]["strategy"]["type_"] == profile

    # Each request streamed exactly the tokens it asked for (ignore_eos), as the server's usage says.
    assert [r["output_tokens"] for r in completed] == [OUTPUT_TOKENS] * REQUESTS
    assert all(r["prompt_tokens"] > 0 for r in completed)
    prompt = sum(r["prompt_tokens"] for r in completed)
    output = sum(r["output_tokens"] for r in completed)
    counted = {name: after.value(name) - before.value(name) for name in COUNTERS}
    assert counted == {COUNTERS[0]: prompt, COUNTERS[1]: output}, (
        f"guidellm's sums (prompt {prompt}, output {output}) against the gateway's counters"
    )
