"""The one place where ServingError meets gRPC status codes (both directions). Torch-free."""

from __future__ import annotations

import logging

import grpc

from core.errors import (
    CapacityExceeded,
    InvalidRequest,
    KVIncompatible,
    KVTransferFailed,
    ModelNotFound,
    RequestAborted,
    ServingError,
    Unavailable,
)

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED, seconds


def grpc_code(error: ServingError) -> grpc.StatusCode:
    return grpc.StatusCode[error.grpc_code]


def as_serving_error(exc: BaseException) -> ServingError:
    """Unknown exceptions become a generic INTERNAL error; the traceback goes to the log."""
    if isinstance(exc, ServingError):
        return exc
    log.error("internal error", exc_info=exc)
    return ServingError("internal error")


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends an RPC with the status of ``exc`` (raises, as ``context.abort`` does)."""
    err = as_serving_error(exc)
    if isinstance(err, CapacityExceeded):
        context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{err.retry_after_s:g}"),))
    await context.abort(grpc_code(err), err.message)


_FROM_CODE: dict[grpc.StatusCode, type[ServingError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.CANCELLED: RequestAborted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: KVIncompatible,
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestAborted,
}


def from_rpc_error(e: grpc.aio.AioRpcError | grpc.RpcError, peer: str = "") -> ServingError:
    """A downstream call's failure as a ServingError for the caller (the gateway)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else "") or str(code)
    where = f" ({peer})" if peer else ""
    cls = _FROM_CODE.get(code)
    if code == grpc.StatusCode.UNAVAILABLE and "KV" in details:
        return KVTransferFailed(details)
    if cls is CapacityExceeded:
        return CapacityExceeded(details, retry_after_s=1.0)
    if cls is None:
        return Unavailable(f"worker error{where}: {details}")
    return cls(details)
