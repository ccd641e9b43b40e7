"""Conversions at the store's edge: what a stage puts -> `Column`s, and `Column`s -> a TensorDict.

Accepted put values, per field kind:

- dense: a tensor whose first dim is the batch;
- jagged: a `torch.jagged` nested tensor, or a list of 1-D tensors (one per sample);
- object: a list (or tensordict `NonTensorStack`) of JSON-like values: str, int, float, bool,
  None, lists and str-keyed dicts of those, nested at most `MAX_DEPTH` deep, whose JSON text is
  valid UTF-8 (tuples, other types and lone surrogates are refused, since they would not come
  back as they went in).

Tensors must be strided (dense, not sparse) and hold data that can be copied to the CPU (no
`meta` tensors).

A get returns a TensorDict with `batch_size=[len(keys)]`: dense fields as tensors, jagged fields
as `torch.jagged` nested tensors built over the gathered values buffer (`.offsets().diff()` gives
the lengths), object fields as a `NonTensorStack` (`td[name]` is list-like, `.tolist()` the list).
tensordict 0.15.3 keeps jagged nested tensors as plain entries whose batch dim is the NJT's dim 0:
indexing, slicing, `select`, `clone`, `torch.cat` and pickling of such a TensorDict work, which is
why jagged fields are returned as NJT entries rather than padded tensors or sub-tensordicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from storage.columnar import (
    AnyArray,
    Column,
    decode_objects,
    empty_column,
    encode_objects,
    numpy_from_tensor,
)
from storage.columnar import tensor_from_numpy as _tensor
from storage.errors import SchemaError
from storage.schema import FieldSpec, Kind

try:  # NJT's public accessors dispatch through __torch_function__ (20-140 us each on torch 2.13);
    # the class's own attributes and constructor are ~100x faster. The public API is the fallback.
    from torch.nested._internal.nested_tensor import NestedTensor

    _NestedTensor: type[Any] | None = NestedTensor
except ImportError:  # pragma: no cover - only if torch moves its nested tensor class
    _NestedTensor = None

_new_unsafe = getattr(TensorDict, "_new_unsafe", None)  # the unchecked constructor, if it exists

SpecLookup = Callable[[str], FieldSpec | None]
_JSON_SCALARS = (str, int, float)
MAX_DEPTH = 100  # lists and dicts an object value may nest, one inside the other


def _where(partition_id: str, name: str) -> str:
    return f"partition {partition_id!r}, field {name!r}"


def _json_problem(value: Any, row: int, path: str = "", depth: int = 0) -> str | None:
    """None if `value` (row `row`, at `path` in it) is JSON-like and comes back unchanged from
    JSON; else what is wrong."""
    if value is None or isinstance(value, _JSON_SCALARS):
        return None
    is_list = type(value) is list
    if (is_list or type(value) is dict) and depth == MAX_DEPTH:
        return f"row {row} nests lists and dicts more than {MAX_DEPTH} deep"
    if is_list:
        for i, item in enumerate(value):
            problem = _json_problem(item, row, f"{path}[{i}]", depth + 1)
            if problem:
                return problem
        return None
    if type(value) is dict:
        for key, item in value.items():
            if not isinstance(key, str):
                return f"row {row}{path} has a non-str key {key!r}"
            problem = _json_problem(item, row, f"{path}[{key!r}]", depth + 1)
            if problem:
                return problem
        return None
    return (
        f"row {row}{path} is a {type(value).__name__} (use str, int, float, bool, None, list "
        "or dict)"
    )


def _objects(rows: Sequence[Any], where: str) -> Column:
    for i, row in enumerate(rows):
        problem = _json_problem(row, i)
        if problem:
            raise SchemaError(f"{where}: object values must be JSON-like; {problem}")
    try:
        return encode_objects(rows)
    except ValueError:  # a str with a lone surrogate (not UTF-8), an int too long for text
        for i, row in enumerate(rows):
            try:
                encode_objects([row])
            except ValueError as exc:
                raise SchemaError(
                    f"{where}: object row {i} cannot be stored as UTF-8 JSON "
                    f"({type(exc).__name__}: {exc}); fix or drop that value"
                ) from None
        raise


def _spec(kind: Kind, dtype: torch.dtype, where: str, shape: tuple[int, ...] = ()) -> FieldSpec:
    """The spec of a tensor value; SchemaError naming the field for an unsupported dtype."""
    try:
        return FieldSpec(kind, dtype, shape)
    except SchemaError as exc:
        raise SchemaError(f"{where}: {exc}") from None


def _array(tensor: torch.Tensor, where: str) -> AnyArray:
    """A numpy view (or CPU copy) of a tensor's data; SchemaError for sparse or meta tensors."""
    if tensor.layout != torch.strided:
        raise SchemaError(
            f"{where}: only strided tensors are stored, got a {tensor.layout} tensor; convert it "
            "with .to_dense() first"
        )
    if tensor.device.type == "meta":
        raise SchemaError(
            f"{where}: a tensor on the meta device holds no data; put one on the CPU or an "
            "accelerator"
        )
    return numpy_from_tensor(tensor)


def _jagged_from_njt(value: Any, where: str) -> Column:
    """Values and offsets of a `torch.jagged` nested tensor (typed Any: torch stubs lack NJT)."""
    if _NestedTensor is not None and type(value) is _NestedTensor:
        values, offsets, holes = value._values, value._offsets, value._lengths
        rows_are_1d = value._ragged_idx == 1 and values.dim() == 1
    else:
        values, offsets, holes = value.values(), value.offsets(), value.lengths()
        rows_are_1d = value.dim() == 2
    if not rows_are_1d:
        raise SchemaError(
            f"{where}: jagged rows must be 1-D, got a nested tensor of rows {tuple(values.shape[1:])}"
        )
    spec = _spec("jagged", values.dtype, where)
    if holes is not None:  # a view with holes: copy its rows out
        return _jagged_from_rows(list(value.unbind()), where)
    array = _array(values, where)
    bounds = _array(offsets, where).astype(np.int64, copy=False)
    start, stop = int(bounds[0]), int(bounds[-1])
    if start or stop != array.shape[0]:
        array, bounds = array[start:stop], bounds - start
    return Column(spec, array, bounds)


def _jagged_from_rows(rows: Sequence[torch.Tensor], where: str) -> Column:
    dtype = rows[0].dtype
    for i, row in enumerate(rows):
        if row.dim() != 1 or row.dtype != dtype:
            raise SchemaError(
                f"{where}: jagged rows must be 1-D tensors of one dtype; row 0 is {dtype}, "
                f"row {i} is {row.dtype} of shape {tuple(row.shape)}"
            )
    spec = _spec("jagged", dtype, where)
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.fromiter((row.shape[0] for row in rows), np.int64, len(rows)), out=offsets[1:])
    values = np.concatenate([_array(row, where) for row in rows])
    return Column(spec, values, offsets, owned=True)


def _from_list(value: Sequence[Any], expected: FieldSpec | None, where: str) -> Column:
    tensors = [isinstance(item, torch.Tensor) for item in value]
    if value and all(tensors):
        return _jagged_from_rows(value, where)
    if expected is not None and expected.kind != "object":
        kind = "a torch.jagged nested tensor or a list of 1-D tensors"
        if expected.kind == "dense":
            kind = "a tensor with the batch as first dim"
        raise SchemaError(f"{where}: a {expected.describe()} field takes {kind}, got a list")
    if any(tensors):
        raise SchemaError(f"{where}: a list mixing tensors and other values is not a field")
    return _objects(value, where)


def _to_column(value: Any, expected: FieldSpec | None, where: str) -> Column:
    if isinstance(value, torch.Tensor):
        if (_NestedTensor is not None and type(value) is _NestedTensor) or (
            value.is_nested and value.layout == torch.jagged
        ):
            return _jagged_from_njt(value, where)
        if value.is_nested:
            return _jagged_from_rows(list(value.unbind()), where)
        if value.dim() == 0:
            raise SchemaError(f"{where}: a dense field needs the batch as first dim, got a scalar")
        spec = _spec("dense", value.dtype, where, tuple(value.shape[1:]))
        return Column(spec, _array(value, where))
    if isinstance(value, (NonTensorStack, NonTensorData)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return _from_list(value, expected, where)
    raise SchemaError(
        f"{where}: unsupported value of type {type(value).__name__}; put a tensor (dense), "
        "a torch.jagged nested tensor or list of 1-D tensors (jagged), or a list (objects)"
    )


def to_column(value: Any, n_rows: int, expected: FieldSpec | None, where: str) -> Column:
    """Converts one put value to a column, checking kind, dtype, shape and row count.

    The column may share memory with `value`: the store copies what it keeps.
    """
    if n_rows == 0 and isinstance(value, (list, tuple)) and not value:
        if expected is None:
            raise SchemaError(f"{where}: cannot infer a spec from 0 rows; declare the field first")
        return empty_column(expected)
    column = _to_column(value, expected, where)
    if expected is not None and column.spec != expected:
        raise SchemaError(
            f"{where}: expected {expected.describe()}, got {column.spec.describe()}; "
            "convert the value or put it under another field name"
        )
    if column.n_rows != n_rows:
        raise SchemaError(f"{where}: {column.n_rows} rows for {n_rows} keys; give one row per key")
    return column


def to_columns(
    fields: Mapping[str, Any] | TensorDictBase,
    n_rows: int,
    partition_id: str,
    expected: SpecLookup,
) -> dict[str, Column]:
    """Converts every field of a put; raises SchemaError on the first bad one."""
    if not isinstance(fields, (Mapping, TensorDictBase)):
        raise SchemaError(
            f"partition {partition_id!r}: fields must be a dict or TensorDict, got {type(fields).__name__}"
        )
    names = list(fields.keys())
    if not names:
        raise SchemaError(f"partition {partition_id!r}: a put needs at least one field")
    columns = {}
    for name in names:
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise SchemaError(
                f"partition {partition_id!r}: field names are non-empty str not starting with "
                f"'__', got {name!r}"
            )
        value = fields.get(name) if isinstance(fields, TensorDictBase) else fields[name]
        if isinstance(value, TensorDictBase) and not isinstance(value, NonTensorStack):
            raise SchemaError(f"{_where(partition_id, name)}: nested TensorDicts are not fields")
        columns[name] = to_column(value, n_rows, expected(name), _where(partition_id, name))
    return columns


def _njt(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A `torch.jagged` nested tensor over `values` (no copy)."""
    if _NestedTensor is not None:
        try:
            nested: torch.Tensor = _NestedTensor(values, offsets)
            return nested
        except (TypeError, RuntimeError):  # a torch whose private constructor changed
            pass
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def to_torch(column: Column, ragged: list[tuple[Any, torch.Tensor]] | None = None) -> Any:
    """The TensorDict entry of a column; the column's buffers must be fresh (they are shared).

    `ragged` collects the offsets of the jagged entries made so far: a column with the same
    offsets reuses that tensor, so its nested tensor has the same ragged dim and the two can be
    combined elementwise (`td["old_logprobs"] - td["ref_logprobs"]`).
    """
    spec = column.spec
    if spec.kind == "object":
        return NonTensorStack(*decode_objects(column)) if column.n_rows else NonTensorStack()
    assert spec.dtype is not None
    values = _tensor(column.values, spec.dtype)
    if column.offsets is None:
        return values
    offsets = None
    for seen, tensor in ragged or ():
        if seen.shape == column.offsets.shape and np.array_equal(seen, column.offsets):
            offsets = tensor
            break
    if offsets is None:
        offsets = torch.from_numpy(column.offsets)
        if ragged is not None:
            ragged.append((column.offsets, offsets))
    return _njt(values, offsets)


def to_tensordict(columns: Mapping[str, Column], n_rows: int) -> TensorDict:
    """A TensorDict with `batch_size=[n_rows]` holding each column.

    Built without TensorDict's per-entry validation (~30 us an entry, more than the rest of a
    small get): every entry is made here with `n_rows` rows on the CPU.
    """
    ragged: list[tuple[Any, torch.Tensor]] = []
    entries = {name: to_torch(col, ragged) for name, col in columns.items()}
    if _new_unsafe is not None:
        built: TensorDict = _new_unsafe(entries, batch_size=torch.Size([n_rows]))
        return built
    return TensorDict(entries, batch_size=[n_rows])
