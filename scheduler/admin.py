"""Operator commands: `baton models` (versions, rollout weights, shadow traffic — through a scheduler)
and `baton tenants` (tenants and API keys — straight in Redis, where the scheduler reads them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import grpc

from baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from rpc.errors import from_rpc_error

# A shadowed candidate is flagged when its next-token distributions part from the primary's by more
# than a faithful twin's do. On the default model an int8 twin agrees with fp32 on 95% of teacher-forced
# positions at a mean KL of 0.006 nats and bf16 on 97% at 0.001 (docs/BENCHMARKS.md, Engine); a broken
# build lands far outside both (tests/integration/test_rollout.py).
DEFAULT_MIN_TOP1 = 0.9
DEFAULT_MAX_KL = 0.05


def add_models_parser(sub: Any) -> None:
    p = sub.add_parser("models", help="list model versions, set rollout weights and shadow traffic")
    p.add_argument("--scheduler", default="127.0.0.1:50061", help="a scheduler's host:port")
    cmds = p.add_subparsers(dest="models_command", required=True)
    ls = cmds.add_parser(
        "list",
        help="versions with their weights and healthy workers, and how shadowed "
        "candidates compare with the versions they shadow",
    )
    ls.add_argument("model", nargs="?", default="")
    ls.add_argument(
        "--min-top1",
        type=float,
        default=DEFAULT_MIN_TOP1,
        help="flag a candidate whose top-1 agreement is below this (default: %(default)s)",
    )
    ls.add_argument(
        "--max-kl",
        type=float,
        default=DEFAULT_MAX_KL,
        help="flag a candidate whose mean KL is above this, in nats (default: %(default)s)",
    )
    ls.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    ls.set_defaults(func=_run_models)
    st = cmds.add_parser("set", help="set rollout weights, e.g. `baton models set m v1=0.9 v2=0.1`")
    st.add_argument("model")
    st.add_argument("weights", nargs="*", help="VERSION=WEIGHT (versions not named keep theirs)")
    st.add_argument("--shadow", default=None, help="shadow version ('' clears it)")
    st.add_argument("--shadow-share", type=float, default=None, help="share of requests mirrored, 0..1")
    st.set_defaults(func=_run_models)


def _parse_weights(items: list[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in items:
        version, sep, value = item.partition("=")
        if not sep or not version:
            raise SystemExit(f"baton models set: expected VERSION=WEIGHT, got {item!r}")
        try:
            weights[version] = float(value)
        except ValueError:
            raise SystemExit(f"baton models set: weight of {version} is not a number: {value!r}") from None
    return weights


def _run_models(args: argparse.Namespace) -> int:
    return asyncio.run(_models(args))


async def _models(args: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(args.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            if args.models_command == "list":
                reply = await stub.ListModelVersions(
                    scheduler_pb2.ListModelVersionsRequest(model=args.model), timeout=10
                )
                versions = list(reply.versions)
                shadow = dict(reply.shadow)
                share = dict(reply.shadow_share)
                comparisons = list(reply.comparisons)
            else:
                req = scheduler_pb2.SetRolloutRequest(model=args.model, weights=_parse_weights(args.weights))
                if args.shadow is not None:
                    req.shadow_version = args.shadow
                if args.shadow_share is not None:
                    req.shadow_share = args.shadow_share
                versions = list((await stub.SetRollout(req, timeout=10)).versions)
                shadow, share, comparisons = {}, {}, []
        except grpc.aio.AioRpcError as e:
            print(f"baton models: {from_rpc_error(e, args.scheduler).message}", file=sys.stderr)
            return 2
    min_top1 = getattr(args, "min_top1", DEFAULT_MIN_TOP1)
    max_kl = getattr(args, "max_kl", DEFAULT_MAX_KL)
    if getattr(args, "json", False):
        print(
            json.dumps(
                {
                    "versions": [
                        {
                            "model": v.model,
                            "version": v.version,
                            "weight": v.weight,
                            "workers": v.num_workers,
                            "max_model_len": v.max_model_len,
                        }
                        for v in versions
                    ],
                    "shadow": {m: {"version": v, "share": share.get(m, 0.0)} for m, v in shadow.items()},
                    "comparisons": [
                        {**_comparison(c), "flagged": flagged(c, min_top1, max_kl)} for c in comparisons
                    ],
                },
                sort_keys=True,
            )
        )
        return 0
    print(f"{'model':<28} {'version':<18} {'weight':>7} {'workers':>8} {'context':>8}")
    for v in versions:
        print(f"{v.model:<28} {v.version:<18} {v.weight:>7.3f} {v.num_workers:>8} {v.max_model_len:>8}")
    for model, version in shadow.items():
        print(f"shadow: {model} -> {version} ({share.get(model, 0.0):.1%} of requests)")
    if comparisons:
        print(
            f"\n{'candidate':<18} {'vs version':<18} {'requests':>8} {'identical':>9} {'greedy':>7} {'top-1':>7} "
            f"{'KL':>8} {'TTFT ms':>15} {'ITL ms':>13}  verdict"
        )
    for c in comparisons:
        verdict = flagged(c, min_top1, max_kl)
        print(
            f"{c.shadow_version:<18} {c.primary_version:<18} {c.requests:>8} {c.identical:>9} "
            f"{c.greedy_agreement:>7.3f} {c.top1_agreement:>7.3f} {c.mean_kl:>8.4f} "
            f"{c.shadow_ttft_ms:>7.1f}/{c.primary_ttft_ms:<7.1f} {c.shadow_itl_ms:>6.1f}/{c.primary_itl_ms:<6.1f}  "
            f"{'FLAGGED: ' + verdict if verdict else 'ok'}"
        )
    return 0


def _comparison(c: scheduler_pb2.ShadowComparison) -> dict[str, Any]:
    return {f.name: getattr(c, f.name) for f in c.DESCRIPTOR.fields}


def flagged(c: scheduler_pb2.ShadowComparison, min_top1: float, max_kl: float) -> str:
    """Why a shadowed candidate should not be promoted ("" when its figures are within bounds)."""
    reasons = []
    if c.positions and c.top1_agreement < min_top1:
        reasons.append(f"top-1 agreement {c.top1_agreement:.3f} < {min_top1}")
    if c.positions and c.mean_kl > max_kl:
        reasons.append(f"mean KL {c.mean_kl:.4f} > {max_kl}")
    return "; ".join(reasons)


def add_tenants_parser(sub: Any) -> None:
    p = sub.add_parser("tenants", help="add tenants and API keys (in the cluster's Redis)")
    p.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="the cluster's Redis: redis://[USER:PASSWORD@]HOST:PORT/DB, rediss://... (TLS) or "
        "redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB] (docs/SECURITY.md)",
    )
    cmds = p.add_subparsers(dest="tenants_command", required=True)
    add = cmds.add_parser("add", help="create or replace a tenant")
    add.add_argument("name")
    for flag, kind in (
        ("requests-per-s", float),
        ("tokens-per-s", float),
        ("burst-s", float),
        ("max-concurrent", int),
        ("max-kv-blocks", int),
        ("max-queue-depth", int),
        ("weight", float),
    ):
        add.add_argument(f"--{flag}", type=kind, default=None)
    add.add_argument("--share-prefix-cache", action="store_true")
    add.set_defaults(func=_run_tenants)
    key = cmds.add_parser("add-key", help="map an API key to a tenant")
    key.add_argument("key")
    key.add_argument("tenant")
    key.set_defaults(func=_run_tenants)
    ls = cmds.add_parser("list", help="tenants and their limits")
    ls.set_defaults(func=_run_tenants)


def _run_tenants(args: argparse.Namespace) -> int:
    return asyncio.run(_tenants(args))


async def _tenants(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from rpc.redis_url import BadRedisUrl, async_client, redact
    from scheduler.tenants import TenantConfig, TenantDirectory

    try:
        client = async_client(args.redis_url)
    except BadRedisUrl as e:
        print(f"baton tenants: {e}", file=sys.stderr)
        return 2
    directory = TenantDirectory(client)
    try:
        if args.tenants_command == "add":
            limits = {
                k: v
                for k, v in vars(args).items()
                if v is not None and k in TenantConfig.__dataclass_fields__ and k != "name"
            }
            await directory.add_tenant(TenantConfig(args.name, **limits))
        elif args.tenants_command == "add-key":
            await directory.add_api_key(args.key, args.tenant)
        for tenant in await directory.list_tenants():
            print(json.dumps(json.loads(tenant.to_json()), sort_keys=True))
    except ValueError as e:
        print(f"baton tenants: {e}", file=sys.stderr)
        return 2
    except RedisError as e:  # a wrong password, an unreachable Redis: said, not a traceback
        print(
            f"baton tenants: cannot use Redis at {redact(args.redis_url)}: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 2
    finally:
        await client.aclose()
    return 0
