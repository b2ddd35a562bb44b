"""`baton autoscale`: the control loop as a process of its own — in the Helm chart, a Deployment that
scales the prefill and decode Deployments (``--scaler kubernetes``), or only exports what it would do
(``--no-actuate``, ``--scaler none``) for an HPA or KEDA to act on."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from prometheus_client import start_http_server

from autoscaler.config import AutoscaleConfig
from autoscaler.controller import Autoscaler, AutoscalerMetrics
from autoscaler.policy import ReactivePolicy
from autoscaler.scaling import Scaler
from autoscaler.signals import MetricsSource
from rpc.flags import add_flags, config_from_args

log = logging.getLogger(__name__)


def add_autoscale_parser(sub: Any) -> None:
    p = sub.add_parser(
        "autoscale",
        help="size the prefill and decode pools apart from the cluster's metrics (Kubernetes, or advise only)",
    )
    add_flags(p, AutoscaleConfig)
    p.set_defaults(func=run_autoscale, parser=p)


def build_autoscaler(config: AutoscaleConfig, scaler: Scaler | None) -> Autoscaler:
    """The loop `config` describes, over ``scaler`` (None: decide and export only)."""
    source = MetricsSource(config.gateway_metrics, config.scheduler_metrics, config.window_s)
    return Autoscaler(source, ReactivePolicy(config.policy), scaler, config.actuate, AutoscalerMetrics())


def run_autoscale(args: argparse.Namespace) -> int:
    config = config_from_args(AutoscaleConfig, args, args.parser)
    if not config.gateway_metrics or not config.scheduler_metrics:
        args.parser.error("--gateway-metrics and --scheduler-metrics are both needed: they are its signals")
    scaler: Scaler | None = None
    if config.scaler == "kubernetes":
        from autoscaler.kube import KubernetesScaler

        scaler = KubernetesScaler.from_config(config)
    autoscaler = build_autoscaler(config, scaler)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    server = None
    if config.metrics_port is not None:
        server, _ = start_http_server(config.metrics_port, config.host, autoscaler.metrics.registry)
        print(f"baton autoscale metrics on http://{config.host}:{server.server_port}/metrics", flush=True)
    acting = (
        "scaling" if autoscaler.actuate else "advising only (exporting baton_autoscaler_desired_replicas)"
    )
    print(f"baton autoscale: {acting}; a decision every {config.interval_s:g} s", flush=True)
    try:
        autoscaler.run(config.interval_s, stop)
    finally:
        if scaler is not None:
            scaler.close()
        if server is not None:
            server.shutdown()
    return 0
