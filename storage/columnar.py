"""Columns: one field's rows as numpy buffers, and the moves between them.

A `Column` holds the rows of one field, whatever their number, in at most two buffers:

- dense: `values` of shape `(n, *shape)`;
- jagged: `values` of shape `(total,)` and int64 `offsets` of shape `(n + 1,)` starting at 0;
- object: the rows' UTF-8 JSON bytes as uint8 `values` plus `offsets`, like a jagged field.

Rows are never separate Python objects on the hot path: copies are one `memcpy` per run of
consecutive rows, or one vectorized gather, so cost grows with bytes, not with rows. Data moves
through numpy, whose copies are single-threaded and steady on a busy machine (torch's threaded
copies stall when cores are shared), and becomes torch tensors without a copy at the edges
(`to_torch`). bfloat16 is held as its uint16 bits; the spec keeps the real dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from storage.schema import FieldSpec

if TYPE_CHECKING:
    import torch

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
AnyArray = npt.NDArray[Any]

_MAX_RUNS = 64  # up to this many runs of consecutive rows, always copy run by run
_MIN_RUN_ELEMENTS = 48  # past _MAX_RUNS, runs shorter than this on average use one vectorized index
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, eq=False)
class Column:
    """The rows of one field. `offsets` is None for dense fields, int64 `(n + 1,)` otherwise."""

    spec: FieldSpec
    values: AnyArray
    offsets: IntArray | None = None
    owned: bool = False  # True when no one else references the buffers (safe to keep)

    @property
    def n_rows(self) -> int:
        return int(self.values.shape[0]) if self.offsets is None else int(self.offsets.size - 1)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return int(self.values.nbytes) + extra

    def lengths(self) -> IntArray:
        """Elements per row of a ragged column."""
        assert self.offsets is not None, "dense columns have no lengths"
        return np.diff(self.offsets)

    def slice(self, start: int, stop: int) -> Column:
        """Rows `start:stop` as views (no copy); offsets rebased to 0."""
        if self.offsets is None:
            return Column(self.spec, self.values[start:stop])
        offsets = self.offsets[start : stop + 1]
        base = int(offsets[0])
        return Column(self.spec, self.values[base : int(offsets[-1])], offsets - base)

    def copy(self) -> Column:
        """A column that owns contiguous copies of its buffers."""
        offsets = None if self.offsets is None else self.offsets.copy()
        return Column(self.spec, self.values.copy(order="C"), offsets, owned=True)

    def owned_copy(self) -> Column:
        """This column if it already owns its buffers, else a copy."""
        return self if self.owned else self.copy()

    def take(self, rows: IntArray) -> Column:
        """The given rows, in that order, as a fresh copy."""
        return gather([self], np.zeros(rows.size, np.int64), rows)


def empty_column(spec: FieldSpec) -> Column:
    """A column of zero rows."""
    if spec.kind == "dense":
        return Column(spec, np.empty((0, *spec.shape), spec.np_dtype), owned=True)
    return Column(spec, np.empty(0, spec.np_dtype), np.zeros(1, np.int64), owned=True)


def concat(parts: Sequence[Column]) -> Column:
    """Rows of `parts` one after the other, as a fresh copy."""
    spec = parts[0].spec
    values = np.concatenate([part.values for part in parts])
    if spec.kind == "dense":
        return Column(spec, values, owned=True)
    offsets = np.zeros(sum(part.n_rows for part in parts) + 1, np.int64)
    np.cumsum(np.concatenate([part.lengths() for part in parts]), out=offsets[1:])
    return Column(spec, values, offsets, owned=True)


def gather(chunks: Sequence[Column], chunk_ids: IntArray, rows: IntArray) -> Column:
    """Row i of the result is row `rows[i]` of `chunks[chunk_ids[i]]`; always a fresh copy.

    Runs of consecutive rows are copied as slices (one memcpy each); many short runs use one
    vectorized index instead, whose cost per element beats a Python step per run.
    """
    if rows.size == 0:
        return empty_column(chunks[0].spec)
    breaks = (chunk_ids[1:] != chunk_ids[:-1]) | (rows[1:] != rows[:-1] + 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    if starts.size > _MAX_RUNS:
        elements = sum(chunk.values.shape[0] for chunk in chunks)
        per_run = elements / max(1, sum(chunk.n_rows for chunk in chunks)) * rows.size / starts.size
        if chunks[0].offsets is None or per_run < _MIN_RUN_ELEMENTS:
            return _gather_rows(chunks, chunk_ids, rows)
    stops = np.append(starts[1:], rows.size)
    return _gather_runs(chunks, chunk_ids, rows, starts, stops)


def _per_chunk(
    chunks: Sequence[Column],
    chunk_ids: IntArray,
    pick_from: Callable[[Column, BoolArray], AnyArray],
) -> AnyArray:
    """`out[i] = pick_from(chunk, mask)[...]` assembled over the chunks that `chunk_ids` names."""
    out: AnyArray = np.empty(chunk_ids.size, np.int64)
    for c in np.unique(chunk_ids).tolist():
        mask = chunk_ids == c
        out[mask] = pick_from(chunks[c], mask)
    return out


def _gather_runs(
    chunks: Sequence[Column], chunk_ids: IntArray, rows: IntArray, starts: IntArray, stops: IntArray
) -> Column:
    """`gather` as one slice per run of consecutive rows of one chunk."""
    spec = chunks[0].spec
    run_chunk, first, last = chunk_ids[starts], rows[starts], rows[stops - 1] + 1
    if spec.kind == "dense":
        lo, hi = first, last
    else:
        lo = _per_chunk(chunks, run_chunk, lambda chunk, m: _offsets(chunk)[first[m]])
        hi = _per_chunk(chunks, run_chunk, lambda chunk, m: _offsets(chunk)[last[m]])
    pieces = [
        chunks[c].values[a:b] for c, a, b in zip(run_chunk.tolist(), lo.tolist(), hi.tolist())
    ]
    values = pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)
    if spec.kind == "dense":
        return Column(spec, values, owned=True)
    lengths = _per_chunk(chunks, chunk_ids, lambda chunk, m: chunk.lengths()[rows[m]])
    offsets = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Column(spec, values, offsets, owned=True)


def _offsets(column: Column) -> IntArray:
    assert column.offsets is not None, "dense columns have no offsets"
    return column.offsets


def _ranges(starts: IntArray, lengths: IntArray) -> IntArray:
    """Concatenated `arange(s, s + n)` for each start s and length n, without a Python loop."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    shift = np.repeat(starts - (ends - lengths), lengths)
    return shift + np.arange(total, dtype=np.int64)


def _gather_rows(chunks: Sequence[Column], chunk_ids: IntArray, rows: IntArray) -> Column:
    """`gather` for scattered rows: one vectorized index per source chunk."""
    spec = chunks[0].spec
    used = np.unique(chunk_ids).tolist()
    if spec.kind == "dense":
        out = np.empty((rows.size, *chunks[used[0]].values.shape[1:]), spec.np_dtype)
        for c in used:
            pick = chunk_ids == c
            out[pick] = chunks[c].values[rows[pick]]
        return Column(spec, out, owned=True)
    lengths = np.empty(rows.size, np.int64)
    for c in used:
        pick = chunk_ids == c
        lengths[pick] = chunks[c].lengths()[rows[pick]]
    offsets = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if len(used) == 1:
        source = chunks[used[0]]
        assert source.offsets is not None
        values = source.values[_ranges(source.offsets[rows], lengths)]
        return Column(spec, values, offsets, owned=True)
    values = np.empty(int(offsets[-1]), spec.np_dtype)
    for c in used:
        pick = np.flatnonzero(chunk_ids == c)
        source = chunks[c]
        assert source.offsets is not None
        src = _ranges(source.offsets[rows[pick]], lengths[pick])
        values[_ranges(offsets[pick], lengths[pick])] = source.values[src]
    return Column(spec, values, offsets, owned=True)


def _bits(values: AnyArray) -> AnyArray:
    """The array viewed as unsigned integers of the same width: equality is bitwise."""
    return values.view(_BITS[values.dtype.itemsize])


def rows_equal(a: Column, b: Column) -> BoolArray:
    """Per row, whether `a` and `b` hold identical content (bitwise; NaN equals the same NaN)."""
    n = a.n_rows
    if n == 0:
        return np.ones(0, np.bool_)
    if a.offsets is None or b.offsets is None:
        differs = _bits(a.values).reshape(n, -1) != _bits(b.values).reshape(n, -1)
        return np.asarray(~differs.any(axis=1), np.bool_)
    same: BoolArray = np.diff(a.offsets) == np.diff(b.offsets)
    if np.array_equal(a.offsets, b.offsets):
        flips = np.concatenate(([0], np.cumsum(_bits(a.values) != _bits(b.values))))
        same = flips[a.offsets[1:]] == flips[a.offsets[:-1]]
    else:
        for i in np.flatnonzero(same).tolist():
            same[i] = np.array_equal(
                _bits(a.slice(i, i + 1).values), _bits(b.slice(i, i + 1).values)
            )
    if a.spec.kind == "object" and not same.all():
        for i in np.flatnonzero(~same).tolist():  # same JSON value, other bytes (dict key order)
            same[i] = _canonical(a.slice(i, i + 1)) == _canonical(b.slice(i, i + 1))
    return same


def _canonical(column: Column) -> str:
    """The JSON text of a one-row object column with dict keys sorted.

    Equal texts are equal JSON values: unlike Python's `==`, this tells 1, 1.0 and true apart,
    and 0.0 from -0.0.
    """
    (value,) = decode_objects(column)
    return json.dumps(value, sort_keys=True)


def encode_objects(rows: Sequence[Any]) -> Column:
    """JSON-encodes one value per row into an object column (values must be JSON-like)."""
    blobs = [json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode() for row in rows]
    offsets = np.zeros(len(blobs) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, blobs), np.int64, len(blobs)), out=offsets[1:])
    values = np.frombuffer(b"".join(blobs), np.uint8).copy()
    return Column(FieldSpec.objects(), values, offsets, owned=True)


def decode_objects(column: Column) -> list[Any]:
    """The Python values of an object column, one per row."""
    assert column.offsets is not None
    blob = column.values.tobytes()
    bounds = column.offsets.tolist()
    return [json.loads(blob[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def tensor_from_numpy(values: AnyArray, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor sharing a writable numpy buffer (bfloat16 bits reinterpreted)."""
    import torch

    tensor = torch.from_numpy(values)
    return tensor.view(dtype) if dtype == torch.bfloat16 else tensor


def numpy_from_tensor(tensor: torch.Tensor) -> AnyArray:
    """A numpy view of a CPU tensor's data (moved to CPU first if needed); bfloat16 as uint16."""
    import torch

    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
