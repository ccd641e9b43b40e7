"""Partitions on disk: one Arrow IPC file per partition, written atomically.

A file holds one table: a `__key__` column (large_string) and one column per field that has data.

- dense fields: the element type, or `fixed_size_list<element>[prod(shape)]` for per-sample shapes;
- jagged fields: `large_list<element>` (one values buffer + int64 offsets, as in memory);
- object fields: `large_string` holding each row's JSON.

A null cell means the key does not hold that field. bfloat16 is kept as its uint16 bits. The
schema metadata carries the format tag, the partition id and every field spec (declared fields
without data included), so a file is self-describing. Files are written to a temp name, fsynced
and renamed; a reader checks everything and raises `StoreCorruptError` naming the file.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa

from storage.columnar import BoolArray, Column, IntArray, encode_objects
from storage.errors import SchemaError, StoreCorruptError, StoreError, preview
from storage.partition import PartitionDump
from storage.schema import FieldSpec

FORMAT = b"ppoflow-partition/1"
KEY_COLUMN = "__key__"
SUFFIX = ".arrow"


def file_name(partition_id: str) -> str:
    """`train/step-000012` -> `train%2Fstep-000012.arrow` (any partition id is a safe name)."""
    return quote(partition_id, safe="") + SUFFIX


def arrow_type(spec: FieldSpec) -> pa.DataType:
    """The Arrow type of a field's column."""
    if spec.kind == "object":
        return pa.large_string()
    element = pa.from_numpy_dtype(spec.np_dtype)
    if spec.kind == "jagged":
        return pa.large_list(element)
    if spec.shape:
        return pa.list_(element, int(np.prod(spec.shape)))
    return element


# -- write ------------------------------------------------------------------------------------


def _full_offsets(present: BoolArray, column: Column) -> IntArray:
    """Offsets over all keys: absent keys get empty rows."""
    lengths = np.zeros(present.size, np.int64)
    lengths[present] = column.lengths()
    offsets = np.zeros(present.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _to_arrow(spec: FieldSpec, present: BoolArray, column: Column) -> pa.Array:
    absent = pa.array(~present)
    if spec.kind == "dense":
        full = np.zeros((present.size, *spec.shape), spec.np_dtype)
        full[present] = column.values
        if not spec.shape:
            return pa.array(full, mask=~present)
        size = int(np.prod(spec.shape))
        return pa.FixedSizeListArray.from_arrays(pa.array(full.reshape(-1)), size, mask=absent)
    offsets = pa.array(_full_offsets(present, column))
    if spec.kind == "jagged":
        return pa.LargeListArray.from_arrays(offsets, pa.array(column.values), mask=absent)
    validity = pa.array(present).buffers()[1]
    data = pa.py_buffer(column.values.tobytes())
    return pa.LargeStringArray.from_buffers(present.size, offsets.buffers()[1], data, validity)


def _to_table(dump: PartitionDump) -> pa.Table:
    arrays = [pa.array(dump.keys, pa.large_string())]
    names = [KEY_COLUMN]
    for name, column in dump.columns.items():
        arrays.append(_to_arrow(dump.specs[name], dump.present[name], column))
        names.append(name)
    specs = {name: spec.to_json() for name, spec in dump.specs.items()}
    metadata = {
        b"ppoflow.format": FORMAT,
        b"ppoflow.partition": dump.partition_id.encode(),
        b"ppoflow.specs": json.dumps(specs).encode(),
    }
    return pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(metadata)


def write_partition(directory: Path, dump: PartitionDump) -> Path:
    """Writes one partition file atomically (temp file, fsync, rename); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / file_name(dump.partition_id)
    temp = directory / f".{final.name}.{uuid.uuid4().hex}.tmp"
    table = _to_table(dump)
    try:
        with pa.OSFile(str(temp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)
    _fsync_directory(directory)
    return final


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- read -------------------------------------------------------------------------------------


def _read_table(path: Path) -> pa.Table:
    try:
        with pa.OSFile(str(path), "rb") as source:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise StoreCorruptError(
            f"{path}: not a readable Arrow IPC file (truncated or foreign?): {exc}"
        ) from exc


def _header(path: Path, table: pa.Table) -> tuple[str, dict[str, FieldSpec]]:
    meta = table.schema.metadata or {}
    if meta.get(b"ppoflow.format") != FORMAT:
        found = meta.get(b"ppoflow.format", b"none").decode(errors="replace")
        raise StoreCorruptError(
            f"{path}: not a ppoflow partition file (format tag {found!r}, "
            f"expected {FORMAT.decode()!r})"
        )
    try:
        partition_id = meta[b"ppoflow.partition"].decode()
        raw = json.loads(meta[b"ppoflow.specs"])
        specs = {name: FieldSpec.from_json(spec) for name, spec in raw.items()}
    except (KeyError, ValueError, AttributeError, SchemaError) as exc:
        raise StoreCorruptError(f"{path}: unreadable partition header: {exc}") from exc
    return partition_id, specs


def _keys(path: Path, table: pa.Table) -> list[str]:
    if table.schema.names[:1] != [KEY_COLUMN] or table.schema.field(0).type != pa.large_string():
        raise StoreCorruptError(f"{path}: first column must be {KEY_COLUMN!r} of large_string")
    keys: list[Any] = table.column(0).to_pylist()
    if any(key is None for key in keys) or len(set(keys)) != len(keys):
        raise StoreCorruptError(f"{path}: keys must be distinct and non-null")
    return keys


def _ragged(path: Path, name: str, array: pa.Array, spec: FieldSpec) -> Column:
    if spec.kind == "object":
        return encode_objects([json.loads(text) for text in array.to_pylist()])
    offsets = np.asarray(array.offsets.to_numpy(), np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    if offsets.size and (np.any(np.diff(offsets) < 0) or offsets[-1] > values.size):
        raise StoreCorruptError(f"{path}: field {name!r} has offsets outside its values")
    base = int(offsets[0]) if offsets.size else 0
    values = values[base : int(offsets[-1])] if offsets.size else values[:0]
    return Column(spec, values, offsets - base)


def _column(
    path: Path, name: str, chunked: pa.ChunkedArray, spec: FieldSpec
) -> tuple[BoolArray, Column]:
    if chunked.type != arrow_type(spec):
        raise StoreCorruptError(
            f"{path}: field {name!r} is stored as {chunked.type}, but its spec "
            f"{spec.describe()} needs {arrow_type(spec)}"
        )
    array = chunked.combine_chunks()
    present = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), np.bool_)
    kept = array.drop_null()
    try:
        if spec.kind != "dense":
            return present, _ragged(path, name, kept, spec)
        flat = kept.flatten() if spec.shape else kept
        values = flat.to_numpy(zero_copy_only=False).reshape(len(kept), *spec.shape)
        return present, Column(spec, values.astype(spec.np_dtype, copy=False))
    except (ValueError, pa.ArrowException) as exc:
        raise StoreCorruptError(f"{path}: field {name!r} cannot be decoded: {exc}") from exc


def read_partition(path: Path) -> PartitionDump:
    """Reads and checks one partition file."""
    table = _read_table(path)
    partition_id, specs = _header(path, table)
    keys = _keys(path, table)
    present, columns = {}, {}
    for name in table.schema.names[1:]:
        if name not in specs:
            raise StoreCorruptError(f"{path}: column {name!r} has no spec in the header")
        present[name], columns[name] = _column(path, name, table.column(name), specs[name])
    return PartitionDump(partition_id, keys, specs, present, columns)


def read_partitions(
    directory: Path, partitions: Sequence[str] | None = None
) -> list[PartitionDump]:
    """Reads every partition file of `directory` (or only `partitions`), checking them all."""
    if not directory.is_dir():
        raise StoreError(f"{directory} is not a directory of saved partitions")
    if partitions is None:
        paths = sorted(directory.glob(f"[!.]*{SUFFIX}"))
    else:
        paths = [directory / file_name(pid) for pid in partitions]
        lacking = [p.name for p in paths if not p.is_file()]
        if lacking:
            raise StoreError(f"{directory} has no saved partition files {preview(lacking)}")
    dumps = [read_partition(path) for path in paths]
    ids = [dump.partition_id for dump in dumps]
    if len(set(ids)) != len(ids):
        raise StoreCorruptError(
            f"{directory}: several files hold the same partition: {sorted(ids)}"
        )
    if partitions is not None and ids != list(partitions):
        raise StoreCorruptError(
            f"{directory}: files hold partitions {ids}, expected {list(partitions)}"
        )
    return dumps
