"""Proto ↔ Python at the edge of each service (TGI's to_pb / from_pb): proto types stop here and never
reach core/ or engine/. Torch-free, so the gateway can import it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from baton.v1 import common_pb2 as pb
from core.errors import InvalidRequest
from core.outputs import FinishReason
from core.sampling_params import SamplingParams, StructuredOutput
from kv_transfer.handle import KVHandle, KVLayout

_OPTIONAL_SCALARS = (
    "max_tokens",
    "min_tokens",
    "prompt_logprobs",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "logprobs",
    "skip_special_tokens",
)

FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
FINISH_FROM_PB = {**{v: k for k, v in FINISH_TO_PB.items()}, pb.FINISH_REASON_ERROR: FinishReason.CANCELLED}


def sampling_from_pb(msg: pb.SamplingParams, **overrides: Any) -> SamplingParams:
    """Absent fields take SamplingParams' defaults; validation errors are InvalidRequest."""
    fields: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)}
    if msg.stop:
        fields["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        fields["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.HasField("structured"):
        fields["structured"] = StructuredOutput(msg.structured.kind, msg.structured.spec)
    fields.update(overrides)
    return SamplingParams(**fields)


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured is not None:
        msg.structured.CopyFrom(pb.StructuredOutput(kind=params.structured.kind, spec=params.structured.spec))
    return msg


def handle_to_pb(handle: KVHandle) -> pb.KVHandle:
    return pb.KVHandle(
        source=handle.source,
        lease_id=handle.lease_id,
        block_ids=list(handle.block_ids),
        num_tokens=handle.num_tokens,
        block_size=handle.block_size,
        compat_hash=handle.compat_hash,
        expires_at=handle.expires_at,
    )


def handle_from_pb(msg: pb.KVHandle) -> KVHandle:
    if not msg.source or not msg.lease_id or not msg.block_ids:
        raise InvalidRequest("a KV handle needs a source, a lease id and block ids")
    return KVHandle(
        source=msg.source,
        lease_id=msg.lease_id,
        block_ids=tuple(msg.block_ids),
        num_tokens=msg.num_tokens,
        block_size=msg.block_size,
        compat_hash=msg.compat_hash,
        expires_at=msg.expires_at,
    )


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        model_digest=layout.model_digest,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layout=layout.layout,
        baton_version=layout.baton_version,
    )


def delta_to_pb(
    token_ids: Sequence[int],
    text: str,
    logprobs: Sequence[Any] | None = None,
    prompt_logprobs: Sequence[Any] | None = None,
) -> pb.TokenDelta:
    """``logprobs``, ``prompt_logprobs``: core.outputs.TokenLogprobs (or None entries) per token."""
    msg = pb.TokenDelta(token_ids=list(token_ids), text=text)
    for field, entries in ((msg.logprobs, logprobs), (msg.prompt_logprobs, prompt_logprobs)):
        for lp in entries or ():
            if lp is not None:
                field.append(pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=dict(lp.top)))
    return msg
