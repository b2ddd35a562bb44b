"""`AutoscaleConfig`, whose fields are the `baton autoscale` flags (`rpc.flags`), and the `PolicyConfig`
nested in it (the SLOs, the pools' bounds, the steps and the stabilisation windows) — the same words as
the chart's ``autoscaler:`` values."""

from __future__ import annotations

from dataclasses import dataclass, field

from rpc.flags import metrics_port_field

SCALERS = ("none", "kubernetes")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """What the reactive policy (`autoscaler.policy`) sizes the prefill and decode pools for."""

    ttft_slo_ms: float = field(default=250.0, metadata={"help": "time to first token p95 target, ms"})
    itl_slo_ms: float = field(default=30.0, metadata={"help": "inter-token latency p95 target, ms"})
    min_prefill: int = field(default=1, metadata={"help": "fewest prefill replicas"})
    max_prefill: int = field(default=8, metadata={"help": "most prefill replicas"})
    min_decode: int = field(default=1, metadata={"help": "fewest decode replicas"})
    max_decode: int = field(default=8, metadata={"help": "most decode replicas"})
    max_step_up: int = field(default=2, metadata={"help": "replicas one decision may add to a pool"})
    max_step_down: int = field(default=1, metadata={"help": "replicas one decision may remove from a pool"})
    scale_up_window_s: float = field(
        default=15.0,
        metadata={"help": "a pool grows only to what every decision of this many seconds asked for"},
    )
    scale_down_window_s: float = field(
        default=120.0,
        metadata={"help": "a pool shrinks only to the most any decision of this many seconds asked for"},
    )
    kv_high: float = field(
        default=0.8, metadata={"help": "decode KV cache usage (0-1) above which the decode pool grows"}
    )
    queue_tokens_high: int = field(
        default=2048,
        metadata={"help": "waiting prompt tokens per prefill replica above which the prefill pool grows"},
    )
    headroom: float = field(
        default=0.7,
        metadata={
            "help": "a pool shrinks only if, with one replica fewer, its projected p95s and KV usage stay "
            "under this share of their targets"
        },
    )

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise ValueError("ttft_slo_ms and itl_slo_ms must be positive")
        for pool in ("prefill", "decode"):
            low, high = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if not 0 <= low <= high or high < 1:
                raise ValueError(f"need 0 <= min_{pool} <= max_{pool} and max_{pool} >= 1, got {low}, {high}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("max_step_up and max_step_down must be at least 1")
        if self.scale_up_window_s < 0 or self.scale_down_window_s < 0:
            raise ValueError("the stabilisation windows must not be negative")
        if not 0 < self.kv_high <= 1 or not 0 < self.headroom <= 1:
            raise ValueError("kv_high and headroom must be in (0, 1]")
        if self.queue_tokens_high < 1:
            raise ValueError("queue_tokens_high must be at least 1")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """`baton autoscale`: where its signals come from, what it scales, and its policy."""

    gateway_metrics: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "the gateways' /metrics URLs, comma-separated; a host name that resolves to several "
            "addresses (a headless Service) is scraped at each"
        },
    )
    scheduler_metrics: str = field(default="", metadata={"help": "a scheduler's /metrics URL"})
    scaler: str = field(
        default="none",
        metadata={
            "choices": SCALERS,
            "help": "what it scales: kubernetes (the pools' Deployments) or none (it only decides and "
            "exports baton_autoscaler_desired_replicas)",
        },
    )
    actuate: bool = field(
        default=True,
        metadata={
            "help": "set the Deployments' replicas; --no-actuate: read them only, for an HPA or KEDA "
            "acting on baton_autoscaler_desired_replicas"
        },
    )
    namespace: str | None = field(
        default=None, metadata={"help": "the Deployments' namespace (default: this pod's, else 'default')"}
    )
    prefill_deployment: str = field(default="", metadata={"help": "the prefill pool's Deployment"})
    decode_deployment: str = field(default="", metadata={"help": "the decode pool's Deployment"})
    kubeconfig: str | None = field(
        default=None, metadata={"help": "kubeconfig file (default: in-cluster, else ~/.kube/config)"}
    )
    interval_s: float = field(default=5.0, metadata={"help": "seconds between two decisions"})
    window_s: float = field(
        default=30.0, metadata={"help": "the p95s and rates a decision reads are over this many seconds"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address of its /metrics endpoint"})
    metrics_port: int | None = metrics_port_field()
    policy: PolicyConfig = PolicyConfig()

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("interval_s and window_s must be positive")
        if self.scaler == "kubernetes" and not (self.prefill_deployment or self.decode_deployment):
            raise ValueError("--scaler kubernetes needs --prefill-deployment and/or --decode-deployment")
