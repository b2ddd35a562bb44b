"""The one error hierarchy of Baton: every error a client can see knows its gRPC code and HTTP status.

`core` must not import grpc, so the gRPC code is kept as its canonical name (``"INVALID_ARGUMENT"``);
`rpc.errors` maps it to the status code of that name, and carries the class itself across the wire.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base of all errors that reach a client; unknown exceptions become INTERNAL with a generic message."""

    grpc_code: str = "INTERNAL"
    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(ServingError):
    """A request field is missing, of the wrong type or out of range."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """prompt tokens + max_tokens do not fit in the model version's context."""


class Unauthenticated(ServingError):
    """The API key is missing, unknown or revoked."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    error_type = "authentication_error"


class DuplicateRequest(ServingError):
    """A first placement of a request id that is already in flight in the cluster (e.g. re-sent by a
    client after its gateway died while the first one ran): refused, never generated twice silently.
    Send it again with a new id."""

    grpc_code = "ALREADY_EXISTS"
    http_status = 409
    error_type = "duplicate_request"


class ModelNotFound(ServingError):
    """The requested model name or version does not exist."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "model_not_found"


class ModelLoadError(ServingError):
    """A model directory or file is missing, malformed or of an unsupported architecture."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 500
    error_type = "model_load_error"


class CapacityExceeded(ServingError):
    """Admission refused: a queue, quota or the KV cache is full. Retry later."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestAborted(ServingError):
    """The request was cancelled by the client or by a deadline."""

    grpc_code = "CANCELLED"
    http_status = 499
    error_type = "cancelled"


class Unavailable(ServingError):
    """A dependency (worker, scheduler, Redis) is unreachable; the request may be retried."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    error_type = "unavailable"


class WorkerLost(Unavailable):
    """A worker could not be reached, died or is shutting down (outside a KV transfer): the request may
    go on on another worker. ``address``: the worker's, where the caller knows it."""

    error_type = "worker_lost"

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(message)
        self.address = address


class SchedulerLost(Unavailable):
    """The connection to the scheduler broke before it answered a call (the replica died or stopped):
    the call may be sent again, to another replica — a Place is idempotent per request id (its quota
    is charged once)."""


class WorkerFenced(WorkerLost):
    """A call meant for an earlier registration of a worker: the registry evicted that one (it missed
    its heartbeats: hung, partitioned) and the worker gave up its work when it came back. The caller
    goes on elsewhere, as for a lost worker."""

    error_type = "worker_fenced"


class WorkerDraining(WorkerLost):
    """A worker is shutting down (SIGTERM, a scale-down, a rolling update) and handed the request back
    unfinished: the caller continues it on another worker, from the tokens it already has."""

    error_type = "worker_draining"


class KVTransferFailed(ServingError):
    """Moving KV blocks between workers failed or timed out; the caller may retry with a new prefill."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    error_type = "kv_transfer_failed"


class KVIncompatible(ServingError):
    """Two workers' KV caches do not match (model version, dtype, block size, layout…): never transfer."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 500
    error_type = "kv_incompatible"


class RoleMismatch(ServingError):
    """A worker was asked for a stage its role does not serve (Prefill on a decode worker): a routing bug."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 500
    error_type = "role_mismatch"
