"""The loadgen CLI on bad input — bad flag values, flag conflicts, malformed files, unusable targets —
and `loadgen compare`: one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadgen.cli import main
from loadgen.compare import compare_rows, format_markdown, run_labels

pytestmark = pytest.mark.unit

CLOSED_PORT = "grpc://127.0.0.1:1"  # nothing listens: reached only if the input is fine


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rate", "-1"], "argument --rate: expected a number > 0"),
        (["--rate", "fast"], "argument --rate"),
        (["--input-len", "9:3"], "argument --input-len: expected 1 <= LO <= HI"),
        (["--num-requests", "0"], "argument --num-requests: expected an integer >= 1"),
        (["--num-requests", "3", "--duration", "5"], "not allowed with argument"),
        (["--percentiles", "50,120"], "argument --percentiles: expected percentiles in (0, 100]"),
        (["--slo", "ttft=5"], "argument --slo: expected METRIC:MS"),
        (["--tenant", "a:zero"], "argument --tenant"),
        (["--warmup", "5m"], "argument --warmup"),
        (["--arrival", "bursty"], "argument --arrival: invalid choice"),
        (["--long-share", "1.5"], "argument --long-share: expected a share in [0, 1]"),
        (["--arrival", "closed"], "--arrival closed needs --concurrency N"),
        (["--arrival", "closed", "--concurrency", "2", "--rate", "3"], "--rate does not apply"),
        (["--burstiness", "0.5"], "--burstiness applies to --arrival gamma only"),
        (["--dataset", "sharegpt"], "--dataset sharegpt needs --dataset-path FILE"),
        (["--prefix-groups", "4"], "--prefix-groups and --prefix-len go together"),
        (
            ["--dataset", "sharegpt", "--dataset-path", "x.json", "--long-share", "0.1"],
            "apply to --dataset random only",
        ),
        (["--tokenizer", "/no/such/dir"], "is not a model directory"),
        (["--extra-body", "{min_tokens: 3}"], "argument --extra-body: not JSON"),
        (["--extra-body", "[1, 2]"], "argument --extra-body: expected a JSON object, got list"),
    ],
)
def test_bad_run_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    _fails(capsys, ["run", "--target", CLOSED_PORT, *flags], message)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("ftp://host:1", "expected grpc://HOST:PORT or http(s)://HOST:PORT"),
        ("127.0.0.1:8000", "expected grpc://HOST:PORT"),
        ("grpc://host", "a gRPC target needs a port"),
        ("http://host:99999", "the port is not a number"),
    ],
)
def test_unusable_targets_exit_2(capsys: pytest.CaptureFixture[str], target: str, message: str) -> None:
    _fails(capsys, ["run", "--target", target], message)


def test_a_malformed_workload_file_fails_before_any_request(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "sharegpt.json"
    bad.write_text('[{"conversations": [{"from": "human", "value": "hi"}')
    _fails(
        capsys,
        ["run", "--target", CLOSED_PORT, "--dataset", "sharegpt", "--dataset-path", str(bad)],
        "not JSON",
    )


def test_missing_subcommand_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, [], "the following arguments are required")
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0 and "--input-len" in capsys.readouterr().out


# --- compare ---------------------------------------------------------------------------------------


def _result(path: Path, label: str | None, **fields: Any) -> Path:
    base = {
        "label": label,
        "completed": 10,
        "failed": 0,
        "request_throughput": 2.0,
        "request_goodput": None,
        "output_throughput": 100.0,
        "mean_ttft_ms": 50.0,
        "p99_ttft_ms": 80.0,
        "mean_itl_ms": 10.0,
    }
    path.write_text(json.dumps(base | fields))
    return path


def test_compare_rows_ratios_and_markdown(tmp_path: Path) -> None:
    a = json.loads(_result(tmp_path / "a.json", "baton").read_text())
    b = json.loads(_result(tmp_path / "b.json", None, mean_ttft_ms=100.0, request_throughput=1.0).read_text())
    rows = {row.metric: row for row in compare_rows([a, b])}
    assert "request_goodput" not in rows and "p99_tpot_ms" not in rows, "metrics no file has are left out"
    assert rows["mean_ttft_ms"].values == (50.0, 100.0) and rows["mean_ttft_ms"].ratios == (1.0, 2.0)
    assert rows["request_throughput"].ratios == (1.0, 0.5)
    labels = run_labels([tmp_path / "a.json", tmp_path / "b.json"], [a, b], None)
    assert labels == ["baton", "b"]
    markdown = format_markdown(labels, list(rows.values()))
    assert markdown.startswith("| metric | baton | b |") and "| mean_ttft_ms | 50 | 100 (2.00x) |" in markdown


def test_compare_command_writes_markdown_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _result(tmp_path / "a.json", "baton"), _result(tmp_path / "b.json", "peer", mean_ttft_ms=75.0)
    md, png = tmp_path / "cmp.md", tmp_path / "cmp.png"
    assert (
        main(
            [
                "compare",
                str(a),
                str(b),
                "--metrics",
                "mean_ttft_ms,mean_itl_ms",
                "--markdown",
                str(md),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "mean_ttft_ms" in out and "75 (1.50x)" in out and "output_throughput" not in out
    assert "| mean_ttft_ms | 50 | 75 (1.50x) |" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _result(tmp_path / "a.json", None)
    not_json = tmp_path / "bad.json"
    not_json.write_text("{")
    not_result = tmp_path / "list.json"
    not_result.write_text("[]")
    _fails(capsys, ["compare", str(good), str(not_json)], "is not a JSON result file")
    _fails(capsys, ["compare", str(good), str(not_result)], "is not a benchmark result")
    _fails(capsys, ["compare", str(good), str(tmp_path / "missing.json")], "cannot read")
    _fails(
        capsys,
        ["compare", str(good), "--metrics", "nonsense_ms"],
        "no result file has a numeric 'nonsense_ms'",
    )
    _fails(capsys, ["compare", str(good), str(good), "--labels", "one"], "--labels has 1 names for 2 files")


def test_loadgen_imports_no_torch() -> None:
    """loadgen runs on machines without torch (its tokenizer is `engine.tokenizer`)."""
    code = (
        "import sys, loadgen.cli, loadgen.runner, loadgen.targets, loadgen.plots, loadgen.compare; "
        "from loadgen.workload import load_tokenizer; assert 'torch' not in sys.modules"
    )
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=repo)
