"""Columns: gather against a plain per-row loop, bitwise row equality, and input conversions."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack

from storage import FieldSpec, SchemaError
from storage.columnar import Column, decode_objects, encode_objects, gather, rows_equal
from storage.convert import to_column, to_torch


def _jagged(rows: list[list[int]]) -> Column:
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    values = np.array([v for r in rows for v in r], np.int64)
    return Column(FieldSpec.jagged(torch.int64), values, offsets)


def _rows(column: Column) -> list[list[int]]:
    assert column.offsets is not None
    o = column.offsets
    return [column.values[o[i] : o[i + 1]].tolist() for i in range(column.n_rows)]


@pytest.mark.parametrize(
    ("n_picks", "max_len"),
    [(1, 6), (5, 6), (40, 6), (300, 6), (300, 200)],  # few runs; many short (vectorized), many long
)
def test_gather_matches_a_per_row_loop(n_picks: int, max_len: int) -> None:
    rng = np.random.default_rng(n_picks)
    chunks = [
        _jagged([list(rng.integers(0, 99, rng.integers(0, max_len))) for _ in range(50)])
        for _ in range(3)
    ]
    chunk_ids = rng.integers(0, 3, n_picks)
    rows = rng.integers(0, 50, n_picks)
    got = gather(chunks, chunk_ids, rows)
    expected = [_rows(chunks[c])[r] for c, r in zip(chunk_ids, rows)]
    assert _rows(got) == expected
    assert got.owned and not np.shares_memory(got.values, chunks[0].values)


def test_gather_of_consecutive_rows_and_dense_columns() -> None:
    dense = [
        Column(FieldSpec.dense(torch.float32, (2,)), np.arange(20, dtype=np.float32).reshape(10, 2))
    ]
    got = gather(dense, np.zeros(4, np.int64), np.array([3, 4, 5, 6]))
    np.testing.assert_array_equal(got.values, dense[0].values[3:7])
    scattered = np.array([9, 0, 5] * 30)  # > 64 runs: the vectorized dense path
    got = gather(dense, np.zeros(90, np.int64), scattered)
    np.testing.assert_array_equal(got.values, dense[0].values[scattered])


def test_rows_equal_is_bitwise() -> None:
    spec = FieldSpec.dense(torch.float32)
    a = Column(spec, np.array([np.nan, 0.0, 1.0], np.float32))
    b = Column(spec, np.array([np.nan, -0.0, 1.0], np.float32))
    # 1. the same NaN is identical content; 2. -0.0 has other bits than 0.0; 3. equal values.
    assert rows_equal(a, b).tolist() == [True, False, True]
    x, y = _jagged([[1, 2], [], [3]]), _jagged([[1, 2], [], [4]])
    assert rows_equal(x, y).tolist() == [True, True, False]
    assert rows_equal(x, _jagged([[1], [2], [3]])).tolist() == [False, False, True]


def test_objects_round_trip_and_compare_by_value() -> None:
    rows = [[{"role": "user", "content": "héllo"}], "text", 3, 2.5, None, True, {"a": [1, {}]}]
    column = encode_objects(rows)
    assert decode_objects(column) == rows
    reordered = encode_objects([{"b": 1, "a": 2}])
    assert rows_equal(encode_objects([{"a": 2, "b": 1}]), reordered).tolist() == [True]


@pytest.mark.parametrize(
    "make",
    [
        lambda rows: torch.nested.nested_tensor_from_jagged(
            torch.cat(rows), torch.tensor([0, 2, 2, 6])
        ),
        lambda rows: rows,
        lambda rows: torch.nested.nested_tensor(rows),
    ],
    ids=["njt", "list", "strided-nested"],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_jagged_inputs_become_values_and_offsets(
    make: Callable[[list[torch.Tensor]], object],
) -> None:
    value = make([torch.arange(2), torch.arange(0), torch.arange(4)])
    column = to_column(value, 3, FieldSpec.jagged(torch.int64), "where")
    assert column.offsets is not None and column.offsets.tolist() == [0, 2, 2, 6]
    assert column.values.tolist() == [0, 1, 0, 1, 2, 3]


def test_njt_views_with_a_start_offset_are_rebased() -> None:
    values = torch.arange(10)
    njt = torch.nested.nested_tensor_from_jagged(values[4:], torch.tensor([0, 3, 6]))
    shifted = torch.nested.nested_tensor_from_jagged(values, torch.tensor([4, 7, 10]))
    for value in (njt, shifted):
        column = to_column(value, 2, None, "where")
        assert _rows(column) == [[4, 5, 6], [7, 8, 9]]


def test_outputs_are_njt_dense_and_non_tensor_stacks() -> None:
    njt = to_torch(_jagged([[1, 2], [], [3]]).copy())
    assert njt.layout == torch.jagged and njt.offsets().diff().tolist() == [2, 0, 1]
    objects = to_torch(encode_objects(["a", {"b": 1}]))
    assert isinstance(objects, NonTensorStack) and objects.tolist() == ["a", {"b": 1}]
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    column = to_column(bf16, 2, None, "where").copy()
    assert torch.equal(to_torch(column), bf16)


@pytest.mark.parametrize(
    ("value", "expected", "message"),
    [
        ([(1, 2)], None, "tuple"),
        ([{1: "a"}], None, "non-str key"),
        ([object()], None, "object"),
        ([torch.zeros(2), "x"], None, "mixing"),
        ([torch.zeros(2, 2)], None, "1-D"),
        ([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], None, "one dtype"),
        ([[1, 2]], FieldSpec.jagged(torch.int64), "list"),
        (torch.tensor(1.0), None, "scalar"),
        (np.zeros(3), None, "unsupported"),
    ],
)
def test_bad_values_name_the_problem(
    value: object, expected: FieldSpec | None, message: str
) -> None:
    with pytest.raises(SchemaError, match=message):
        to_column(value, len(value) if isinstance(value, list) else 1, expected, "here")
