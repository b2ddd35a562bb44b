"""A scheduler replica's configuration: `ClusterSchedulerConfig`, one field per `baton scheduler` flag."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterSchedulerConfig:
    """One scheduler replica. Field names are the `baton scheduler` flags."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    port: int = 50061
    prefix: str = "baton:"
    heartbeat_timeout_s: float = 3.0
    lease_ttl_s: float = 30.0
    queue_timeout_s: float = 10.0  # longest a request waits for decode capacity
    queue_poll_s: float = 0.02
    reap_interval_s: float = 0.5
    default_tenant: str | None = "default"  # requests without an API key; None = keys required
    accept_any_key: bool = False  # unknown keys also go to the default tenant (a local, single-team cluster)
    local_prefill_threshold: int = 32
    max_prefill_queue: int = 1  # see scheduler.placement: admission limits
    max_decode_queue: int = 8
    local_when_prefill_full: bool = False
    light_local_max_tokens: int = 0  # a light tenant's prompt up to this long may prefill on D (0 = never)
    burst_credit_tokens: float = (
        512.0  # fair queue: a light tenant's burst allowance, and the debt bound (scheduler.fairness)
    )
