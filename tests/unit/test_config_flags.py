"""One config, one set of defaults: the `baton worker`, `gateway`, `scheduler` and `up` flags are generated
from their frozen dataclasses by `rpc.flags`, parse back to exactly those dataclasses, and `to_argv`
reproduces a config — the way `baton up` starts its children."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from rpc.flags import add_flags, config_from_args, flags, to_argv
from scheduler.config import ClusterSchedulerConfig, SchedulerProcessConfig
from scheduler.server import add_scheduler_parser
from services import launcher
from services.gateway.server import GatewayConfig, add_gateway_parser
from services.worker.config import HEAVY_PREFILL_CHUNK, WORKER_ENGINE, WorkerConfig, add_worker_parser

pytestmark = pytest.mark.unit

COMMANDS: dict[str, type[Any]] = {
    "worker": WorkerConfig,
    "gateway": GatewayConfig,
    "scheduler": SchedulerProcessConfig,
    "up": launcher.UpConfig,
}

# Every flag each command had before its flags were generated, with its default then (the README, the
# docs, the Helm chart, the benchmarks and the tests use them). None may go or change its default.
LEGACY = {
    "worker": {
        "--role": "both",
        "--model": None,
        "--served-model-name": None,
        "--host": "127.0.0.1",
        "--port": 0,
        "--kv-transport": "auto",
        "--kv-cache-memory": 256 << 20,
        "--dtype": "auto",
        "--quantization": "none",
        "--block-size": 16,
        "--max-num-seqs": 64,
        "--max-num-batched-tokens": 2048,
        "--long-prefill-chunk": 512,
        "--mixed-prefill-tokens": None,
        "--heavy-prefill-chunk": None,
        "--threads": None,
        "--lease-ttl-s": 30.0,
        "--transfer-timeout-s": 10.0,
        "--max-pending-outputs": 256,
        "--scheduler": None,
        "--redis-url": None,
        "--metrics-port": 0,
    },
    "gateway": {
        "--model": None,
        "--served-model-name": None,
        "--host": "127.0.0.1",
        "--grpc-port": 50051,
        "--http-port": 8000,
        "--scheduler": None,
        "--scheduler-timeout": 30.0,
        "--prefill-workers": (),
        "--decode-workers": (),
        "--local-prefill-threshold": 32,
        "--max-prompt-tokens": None,
        "--max-output-tokens": 4096,
        "--max-request-bytes": 4 << 20,
        "--max-streams-per-connection": 128,
        "--max-session-requests": 64,
        "--max-buffered-tokens": 1024,
        "--tokenizer-threads": 2,
        "--max-migrations": 2,
        "--max-shadow-requests": 16,
        "--metrics-max-tenants": 32,
        "--shadow-timeout": 120.0,
        "--startup-timeout": 120.0,
    },
    "scheduler": {
        "--redis-url": "redis://127.0.0.1:6379/0",
        "--host": "127.0.0.1",
        "--port": 50061,
        "--prefix": "baton:",
        "--heartbeat-timeout-s": 3.0,
        "--lease-ttl-s": 30.0,
        "--queue-timeout-s": 10.0,
        "--default-tenant": "default",
        "--accept-any-key": False,
        "--local-prefill-threshold": 32,
        "--max-prefill-queue": 1,
        "--max-decode-queue": 8,
        "--burst-credit-tokens": 512.0,
        "--local-when-prefill-full": False,
        "--light-local-max-tokens": 0,
        "--metrics-port": 0,
        "--metrics-max-tenants": 32,
    },
    "up": {
        "--model": None,
        "--host": "127.0.0.1",
        "--grpc-port": 50051,
        "--http-port": 8000,
        "--colocated": False,
        "--static": False,
        "--kv-transport": "auto",
        "--kv-cache-memory": 256 << 20,
        "--dtype": "auto",
        "--quantization": "none",
        "--ready-timeout": 300.0,
        "--log-dir": None,
    },
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton")
    sub = p.add_subparsers(dest="command", required=True)
    add_worker_parser(sub)
    add_gateway_parser(sub)
    add_scheduler_parser(sub)
    launcher.add_up_parser(sub)
    return p


def parse(command: str, *argv: str) -> Any:
    args = parser().parse_args([command, *argv])
    return config_from_args(COMMANDS[command], args, args.parser)


def actions(command: str) -> dict[str, argparse.Action]:
    sub = parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return {o: a for a in sub._actions for o in a.option_strings}


def leaf_paths(cls: type[Any], path: tuple[str, ...] = ()) -> list[str]:
    """Every field of ``cls`` and its nested dataclasses, as dotted paths."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaf_paths(hints[f.name], (*path, f.name))
        else:
            out.append(".".join((*path, f.name)))
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_has_a_flag_and_every_old_flag_its_old_default(command: str) -> None:
    dests = {a.dest for a in actions(command).values()}
    expected = set(leaf_paths(COMMANDS[command]))
    if command == "worker":  # set from the worker's own, role-dependent heavy_prefill_chunk
        expected.remove("engine.heavy_prefill_chunk")
    assert expected <= dests, sorted(expected - dests)
    found = actions(command)
    for option, default in LEGACY[command].items():
        assert option in found, f"baton {command} lost {option}"
        assert found[option].default == default, (command, option)


def test_engine_flags_cover_every_engine_field_and_parse_to_its_defaults() -> None:
    p = argparse.ArgumentParser()
    add_flags(p, EngineConfig)
    assert {a.dest for a in p._actions} - {"help"} == {f.name for f in dataclasses.fields(EngineConfig)}
    assert config_from_args(EngineConfig, p.parse_args([])) == EngineConfig()
    assert "--threads" in p._option_string_actions  # num_threads' flag keeps its name


def test_no_arguments_give_exactly_the_dataclass_defaults() -> None:
    assert parse("worker") == WorkerConfig()
    assert parse("worker").engine == replace(WORKER_ENGINE, heavy_prefill_chunk=0)
    assert parse("worker").engine.kv_cache_memory == 256 << 20  # a worker's, not EngineConfig's 1 GiB
    assert parse("scheduler") == SchedulerProcessConfig()
    assert parse("scheduler").scheduler == ClusterSchedulerConfig()
    assert parse("up") == launcher.UpConfig()
    # A gateway needs somewhere to place, so it has no all-default config: its flags' defaults are its fields'.
    args = parser().parse_args(["gateway"])
    assert {f.dest: getattr(args, f.dest) for f in flags(GatewayConfig)} == {
        f.dest: f.default for f in flags(GatewayConfig)
    }
    assert parse("gateway", "--scheduler", "h:1") == GatewayConfig(scheduler="h:1")


def test_heavy_prefill_chunk_defaults_by_role_and_an_explicit_zero_turns_it_off() -> None:
    assert parse("worker", "--role", "prefill").engine.heavy_prefill_chunk == HEAVY_PREFILL_CHUNK
    assert parse("worker", "--role", "decode").engine.heavy_prefill_chunk == 0
    assert parse("worker", "--role", "prefill", "--heavy-prefill-chunk", "0").engine.heavy_prefill_chunk == 0
    assert parse("worker", "--heavy-prefill-chunk", "8").engine.heavy_prefill_chunk == 8
    assert replace(WorkerConfig(role="prefill"), role="decode").engine.heavy_prefill_chunk == 0


def test_flat_keywords_build_the_nested_config() -> None:
    flat = WorkerConfig.flat(role="decode", model="m", dtype="float32", kv_cache_memory=4 << 20, threads=1)
    nested = WorkerConfig(
        role="decode",
        engine=replace(WORKER_ENGINE, model="m", dtype="float32", kv_cache_memory=4 << 20, num_threads=1),
    )
    assert flat == nested and flat.engine.num_threads == 1 and flat.engine.block_size == 16


NON_DEFAULT = [
    WorkerConfig(
        role="prefill",
        served_model_name="tiny",
        port=7001,
        kv_transport="tcp",
        heavy_prefill_chunk=0,
        lease_ttl_s=2.5,
        scheduler="h:1",
        redis_url="redis://h:2/0",
        metrics_port=None,
        engine=replace(
            WORKER_ENGINE,
            model="/m",
            device="cpu",
            dtype="bfloat16",
            quantization="int8",
            block_size=32,
            kv_cache_memory=(3 << 20) + 1,
            mixed_prefill_tokens=0,
            max_model_len=512,
            enable_prefix_caching=False,
            num_threads=3,
            seed=7,
        ),
    ),
    GatewayConfig(
        decode_workers=("a:1", "b:2"),
        prefill_workers=("c:3",),
        max_request_bytes=8 << 20,
        max_prompt_tokens=100,
        scheduler_timeout=1.5,
    ),
    SchedulerProcessConfig(
        ClusterSchedulerConfig(default_tenant=None, accept_any_key=True, port=0, burst_credit_tokens=0.0),
        metrics_port=None,
        metrics_max_tenants=4,
    ),
    launcher.UpConfig(colocated=True, static=True, kv_cache_memory=64 << 20, threads=0, log_dir="/tmp/x"),
]


@pytest.mark.parametrize("config", NON_DEFAULT, ids=lambda c: type(c).__name__)
def test_to_argv_round_trips_a_non_default_config(config: Any) -> None:
    command = next(c for c, cls in COMMANDS.items() if isinstance(config, cls))
    argv = to_argv(config)
    assert parse(command, *argv) == config, argv


def test_to_argv_writes_only_what_differs_from_the_default() -> None:
    assert to_argv(WorkerConfig()) == []
    assert to_argv(WorkerConfig(role="prefill")) == ["--role", "prefill"]  # its heavy chunk is the role's
    assert to_argv(WorkerConfig(engine=replace(WORKER_ENGINE, kv_cache_memory=64 << 20))) == [
        "--kv-cache-memory",
        "64MiB",
    ]
    assert to_argv(SchedulerProcessConfig(metrics_port=None)) == ["--metrics-port", "-1"]
    assert to_argv(ClusterSchedulerConfig(default_tenant=None, local_when_prefill_full=True)) == [
        "--default-tenant",
        "",
        "--local-when-prefill-full",
    ]
    assert to_argv(GatewayConfig(decode_workers=("a:1", "b:2"))) == ["--decode-workers", "a:1,b:2"]


def test_bool_optional_choice_and_byte_size_flags() -> None:
    assert parse("worker", "--no-enable-prefix-caching").engine.enable_prefix_caching is False
    assert parse("scheduler", "--accept-any-key").scheduler.accept_any_key is True
    assert parse("scheduler", "--accept-any-key", "--no-accept-any-key").scheduler.accept_any_key is False
    assert parse("up", "--colocated").colocated is True
    assert parse("worker", "--max-model-len", "256").engine.max_model_len == 256
    assert parse("worker", "--metrics-port", "-1").metrics_port is None
    assert parse("scheduler", "--metrics-port", "-1").metrics_port is None
    assert parse("scheduler", "--default-tenant", "").scheduler.default_tenant is None
    assert parse("worker", "--dtype", "float16", "--quantization", "int8").engine.quantization == "int8"
    assert parse("worker", "--block-size", "64").engine.block_size == 64
    assert parse("worker", "--kv-cache-memory", "1GiB").engine.kv_cache_memory == 1 << 30
    assert parse("up", "--kv-cache-memory", "2e6").kv_cache_memory == 2_000_000
    assert (
        parse("gateway", "--decode-workers", "a:1", "--max-request-bytes", "1MiB").max_request_bytes
        == 1 << 20
    )


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("worker", ["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a size: 'lots'"),
        ("worker", ["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        ("worker", ["--block-size", "7"], "argument --block-size: invalid choice: 7"),
        ("worker", ["--port", "x"], "argument --port: not an int: 'x'"),
        ("worker", ["--lease-ttl-s", "soon"], "argument --lease-ttl-s: not a float: 'soon'"),
        ("worker", ["--kv-cache-memory", "0"], "kv_cache_memory must be positive"),  # the dataclass's check
        ("gateway", ["--decode-workers", "nohostport"], "not a host:port address"),
        ("gateway", [], "needs a scheduler"),
        ("scheduler", ["--accept-any-key=yes"], "--accept-any-key"),
        ("up", ["--threads", "many"], "argument --threads: not an int: 'many'"),
    ],
)
def test_a_bad_value_is_a_usage_error_not_a_traceback(
    command: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse(command, *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"baton {command}: error:" in err and message in err, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_renders(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parser().parse_args([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "(default: " in out


@dataclasses.dataclass(frozen=True)
class Inner:
    port: int = 1


@dataclasses.dataclass(frozen=True)
class Clashing:
    port: int = 2
    inner: Inner = Inner()


@dataclasses.dataclass(frozen=True)
class Prefixed:
    port: int = 2
    inner: Inner = dataclasses.field(default=Inner(), metadata={"prefix": "inner-"})


def test_a_flag_clash_is_an_error_when_the_parser_is_built_and_a_prefix_resolves_it() -> None:
    with pytest.raises(TypeError, match="both be --port"):
        add_flags(argparse.ArgumentParser(), Clashing)
    p = argparse.ArgumentParser()
    add_flags(p, Prefixed)
    config = config_from_args(Prefixed, p.parse_args(["--inner-port", "5"]))
    assert config == Prefixed(inner=Inner(5)) and to_argv(config) == ["--inner-port", "5"]
    assert [f.name for f in flags(Prefixed)] == ["port", "inner-port"]


def test_add_flags_prefix_gives_a_second_set_of_the_same_configs_flags() -> None:
    p = argparse.ArgumentParser()
    add_flags(p, EngineConfig)
    add_flags(p, EngineConfig, prefix="candidate-")
    args = p.parse_args(
        ["--dtype", "float32", "--candidate-quantization", "int8", "--candidate-threads", "2"]
    )
    assert config_from_args(EngineConfig, args) == EngineConfig(dtype="float32")
    candidate = config_from_args(EngineConfig, args, prefix="candidate-")
    assert candidate == EngineConfig(quantization="int8", num_threads=2)
    assert to_argv(candidate, prefix="candidate-") == [
        "--candidate-quantization",
        "int8",
        "--candidate-threads",
        "2",
    ]


def test_a_value_that_looks_like_an_option_survives_the_round_trip() -> None:
    config = SchedulerProcessConfig(
        ClusterSchedulerConfig(prefix="-x:", default_tenant="-t"), metrics_port=None
    )
    argv = to_argv(config)
    assert "--prefix=-x:" in argv and argv[-2:] == ["--metrics-port", "-1"]
    assert parse("scheduler", *argv) == config


def test_the_launcher_starts_its_children_with_the_configs_it_built(tmp_path: Path) -> None:
    up = launcher.UpConfig(
        model="/models/tiny", static=True, kv_transport="tcp", dtype="float32", threads=2, grpc_port=0
    )
    cluster, endpoints, _ = launcher.build_cluster(up, tmp_path)
    children = {c.name: c.argv[c.argv.index("services.cli") + 1 :] for c in cluster.children}
    assert set(children) == {"prefill worker", "decode worker", "gateway"}
    prefill = parse(*children["prefill worker"])
    assert prefill.role == "prefill" and prefill.kv_transport == "tcp" and prefill.scheduler is None
    assert prefill.engine == replace(
        WORKER_ENGINE, model="/models/tiny", dtype="float32", num_threads=2, heavy_prefill_chunk=32
    )
    assert f"{prefill.host}:{prefill.port}" == endpoints["prefill"]
    gateway = parse(*children["gateway"])
    assert gateway.decode_workers == (endpoints["decode"],) and gateway.prefill_workers == (
        endpoints["prefill"],
    )
    assert gateway.model == "/models/tiny" and f"{gateway.host}:{gateway.grpc_port}" == endpoints["grpc"]
