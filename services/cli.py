"""The `baton` command: one entry point, a subcommand per job (generate, prepare-model, worker, gateway, up)."""

from __future__ import annotations

import argparse
import logging
import sys

from core.errors import ServingError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description="Baton LLM inference server")
    parser.add_argument("-v", "--verbose", action="store_true", help="log lifecycle events to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    from engine import cli as engine_cli

    engine_cli.add_generate_parser(sub)
    engine_cli.add_prepare_model_parser(sub)
    engine_cli.add_evaluate_parser(sub)
    engine_cli.add_fetch_model_parser(sub)
    from services import launcher
    from services.gateway import server as gateway
    from services.worker import config as worker_config

    worker_config.add_worker_parser(sub)
    gateway.add_gateway_parser(sub)
    launcher.add_up_parser(sub)
    from scheduler import server as scheduler_server

    scheduler_server.add_scheduler_parser(sub)
    from scheduler import admin

    admin.add_models_parser(sub)
    admin.add_tenants_parser(sub)
    from autoscaler import cli as autoscaler_cli

    autoscaler_cli.add_autoscale_parser(sub)
    _add_health_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except ServingError as e:
        print(f"baton: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _add_health_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "health",
        help="exit 0 if a Baton process answers SERVING to the gRPC health check, else 1 (for container "
        "health checks)",
    )
    p.add_argument("address", help="host:port of its gRPC port")
    p.add_argument("--service", default="", help="the service to ask about (default: the whole server)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    p.add_argument(
        "--tls-dir", default=None, help="ask over mutual TLS with this tls.crt, tls.key and ca.crt"
    )
    p.add_argument("--tls-server-name", default=None, help="the name the server's certificate has")
    p.set_defaults(func=_run_health)


def _run_health(args: argparse.Namespace) -> int:
    from rpc.tls import TlsConfig
    from services.supervisor import health_status

    tls = TlsConfig(args.tls_dir, args.tls_server_name).load()
    status = health_status(args.address, args.service, args.timeout, tls)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
