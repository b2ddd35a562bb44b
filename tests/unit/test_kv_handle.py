"""KVLayout compatibility and block-run merging (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.errors import KVIncompatible
from kv_transfer.handle import KVLayout, block_runs

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(
    model_digest="abc", dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64
)


def test_block_bytes_of_the_default_model() -> None:
    assert LAYOUT.block_bytes == 30 * 2 * 16 * 3 * 64 * 4 == 737_280


def test_compatible_layouts_pass_and_differences_are_named() -> None:
    LAYOUT.check_compatible(KVLayout("abc", "float32", 16, 30, 3, 64))
    other = KVLayout(
        model_digest="xyz", dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64
    )
    assert other.compat_hash != LAYOUT.compat_hash
    with pytest.raises(KVIncompatible) as e:
        LAYOUT.check_compatible(other)
    assert "model_digest" in e.value.message and "dtype" in e.value.message
    assert "block_size" not in e.value.message


def test_runs_merge_only_where_both_sides_are_contiguous() -> None:
    assert block_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert block_runs([4, 5, 6], [0, 2, 3]) == [(4, 0, 1), (5, 2, 2)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=30))
def test_runs_cover_the_mapping_exactly(pairs: list[tuple[int, int]]) -> None:
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    expanded = [(s + i, d + i) for s, d, n in block_runs(src, dst) for i in range(n)]
    assert expanded == list(zip(src, dst, strict=True))


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([0, 1], [0], "2 source blocks but 1"),
        ([-1], [0], "source block id"),
        ([8], [0], "source block id"),
        ([0], [-2], "destination block id"),
        ([0], [4], "destination block id"),
    ],
)
def test_pull_block_ids_are_checked_on_both_sides(src: list[int], dst: list[int], match: str) -> None:
    from core.errors import KVTransferFailed
    from kv_transfer.handle import check_block_ids

    with pytest.raises(KVTransferFailed, match=match):
        check_block_ids(src, dst, 8, 4, "peer")
    check_block_ids([0, 7], [0, 3], 8, 4, "peer")  # in range: no error
