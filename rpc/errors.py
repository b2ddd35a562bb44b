"""The one map between `ServingError` and gRPC status, both directions, for every server and client.

A server ends a call with its error's gRPC code and message, plus trailing metadata that says which
error it was (``baton-error-type``: the class's wire name, e.g. ``kv_transfer_failed``) and, for a
refusal, when to retry (``retry-after``, seconds). A client reads the type back from the metadata —
never from the message text — and gets the same class with the same message. A status without the
type (grpc's own: a connection that failed, a deadline the client set, a peer that is not Baton) maps
by its code alone, to the base error of that code (UNAVAILABLE → `Unavailable`, …).

Errors inside a multiplexed stream (`baton.v1.RequestError`: the gateway's bidirectional Generate,
the scheduler's Calls) carry the same three facts in the message (`error_to_pb` / `error_from_pb`).

Servers do not call this module's `abort_with` by hand: `rpc.servicer.add_servicer` wraps every
handler, so a handler just raises.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence

import grpc

from baton.v1 import common_pb2
from core.errors import (
    CapacityExceeded,
    DuplicateRequest,
    InvalidRequest,
    ModelNotFound,
    RequestAborted,
    ServingError,
    Unauthenticated,
    Unavailable,
)

log = logging.getLogger(__name__)

ERROR_TYPE_KEY = "baton-error-type"  # trailing metadata: the error's wire name
RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED, seconds

# A status without a type (grpc's own, or a peer that is not Baton): the base error of its code.
# UNAVAILABLE is `Unavailable` itself, which a caller may read as "the peer is gone" (WorkerLost).
_BY_CODE: dict[grpc.StatusCode, type[ServingError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.CANCELLED: RequestAborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestAborted,  # the deadline the caller set (its request's) passed
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def wire_name(cls: type[ServingError]) -> str:
    """An error class's machine-readable name on the wire: ``KVTransferFailed`` → ``kv_transfer_failed``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls.__name__).lower()


def _subclasses(cls: type[ServingError]) -> Iterator[type[ServingError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def error_classes() -> dict[str, type[ServingError]]:
    """Every ServingError class, by wire name (those of core.errors, and any defined since)."""
    return {wire_name(cls): cls for cls in _subclasses(ServingError)}


def grpc_code(error: ServingError) -> grpc.StatusCode:
    return grpc.StatusCode[error.grpc_code]


def as_serving_error(exc: BaseException) -> ServingError:
    """Unknown exceptions become a generic INTERNAL error; the traceback goes to the log."""
    if isinstance(exc, ServingError):
        return exc
    log.error("internal error", exc_info=exc)
    return ServingError("internal error")


def trailing_metadata(error: ServingError) -> tuple[tuple[str, str], ...]:
    """What a server sends after the status: the error's type, and its retry-after for a refusal."""
    meta = [(ERROR_TYPE_KEY, wire_name(type(error)))]
    if isinstance(error, CapacityExceeded):
        meta.append((RETRY_AFTER_KEY, f"{error.retry_after_s:g}"))
    return tuple(meta)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends an RPC with the status of ``exc`` (raises, as ``context.abort`` does)."""
    err = as_serving_error(exc)
    context.set_trailing_metadata(trailing_metadata(err))
    await context.abort(grpc_code(err), err.message)


def _build(cls: type[ServingError], message: str, retry_after_s: float | None) -> ServingError:
    err = cls(message)
    if isinstance(err, CapacityExceeded):
        err.retry_after_s = 1.0 if retry_after_s is None else retry_after_s
    return err


def _retry_after(text: str | None, peer: str) -> float | None:
    if text is None:
        return None
    try:
        return max(0.0, float(text))
    except ValueError:
        log.warning("%s sent a malformed retry-after %r", peer or "a peer", text)
        return None


def decode_status(
    code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, str | bytes]] = (), peer: str = ""
) -> ServingError:
    """A status as the ServingError it carries: a typed status (``baton-error-type``) comes back as the
    same class with the same message; an untyped one as the base error of its code (INTERNAL and
    the codes not listed: `ServingError`)."""
    meta = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in metadata}
    cls = error_classes().get(meta.get(ERROR_TYPE_KEY, ""))
    if cls is None:
        cls = _BY_CODE.get(code, ServingError)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            details = f"no answer before the deadline ({details or 'deadline exceeded'})"
    return _build(cls, details or code.name, _retry_after(meta.get(RETRY_AFTER_KEY), peer))


def from_rpc_error(e: grpc.RpcError, peer: str = "") -> ServingError:
    """A failed call's error, as the server raised it (see `decode_status`)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else ""
    metadata = (e.trailing_metadata() if hasattr(e, "trailing_metadata") else None) or ()
    return decode_status(code, details or "", metadata, peer)


def error_to_pb(error: ServingError) -> common_pb2.RequestError:
    """A request's error inside a multiplexed stream."""
    msg = common_pb2.RequestError(
        code=grpc_code(error).value[0], message=error.message, type=wire_name(type(error))
    )
    if isinstance(error, CapacityExceeded):
        msg.retry_after_s = error.retry_after_s
    return msg


def error_from_pb(msg: common_pb2.RequestError) -> ServingError:
    """The error a `RequestError` carries (see `decode_status`)."""
    cls = error_classes().get(msg.type)
    if cls is None:
        cls = _BY_CODE.get(_BY_NUMBER.get(msg.code, grpc.StatusCode.UNKNOWN), ServingError)
    return _build(cls, msg.message, msg.retry_after_s if msg.HasField("retry_after_s") else None)
