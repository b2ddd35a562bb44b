"""Proto ↔ Python at the service edge: lossless round trips, defaults for absent fields, and clear
errors for malformed messages."""

from __future__ import annotations

import sys

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from baton.v1 import common_pb2
from core.errors import CapacityExceeded, InvalidRequest, KVIncompatible, KVTransferFailed, ServingError
from core.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle, KVLayout
from rpc.convert import handle_from_pb, handle_to_pb, layout_to_pb, sampling_from_pb, sampling_to_pb
from rpc.errors import as_serving_error, grpc_code

pytestmark = pytest.mark.unit


@given(
    max_tokens=st.integers(1, 4096),
    temperature=st.sampled_from([0.0, 0.5, 1.3]),
    top_k=st.integers(-1, 50),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
)
def test_sampling_params_round_trip(
    max_tokens: int, temperature: float, top_k: int, seed: int | None, stop: list[str], logprobs: int | None
) -> None:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop),
        logprobs=logprobs,
        stop_token_ids=(7, 9),
    )
    assert sampling_from_pb(sampling_to_pb(params)) == params


def test_absent_fields_take_the_defaults_and_bad_values_are_invalid_argument() -> None:
    assert sampling_from_pb(common_pb2.SamplingParams()) == SamplingParams()
    with pytest.raises(InvalidRequest, match="top_p"):
        sampling_from_pb(common_pb2.SamplingParams(top_p=0.0))


def test_kv_handle_round_trip_and_incomplete_handles_are_rejected() -> None:
    handle = KVHandle("127.0.0.1:5000", "lease", (3, 4, 9), 40, 16, "abc", 1.5e9)
    assert handle_from_pb(handle_to_pb(handle)) == handle
    with pytest.raises(InvalidRequest, match="KV handle"):
        handle_from_pb(common_pb2.KVHandle(source="x", lease_id="l"))
    layout = KVLayout("digest", "float32", 16, 2, 2, 64)
    assert layout_to_pb(layout).block_size == 16


def test_errors_map_to_their_grpc_codes_and_unknown_ones_are_generic() -> None:
    assert grpc_code(InvalidRequest("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_code(CapacityExceeded("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_code(KVTransferFailed("x")) == grpc.StatusCode.UNAVAILABLE
    assert grpc_code(KVIncompatible("x")) == grpc.StatusCode.FAILED_PRECONDITION
    err = as_serving_error(ZeroDivisionError("secret detail"))
    assert type(err) is ServingError and err.message == "internal error"


def test_the_edge_modules_do_not_import_torch() -> None:
    import subprocess

    code = "import sys, rpc.convert, rpc.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
