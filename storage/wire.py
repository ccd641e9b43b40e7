"""Columns between processes without pickling Python objects: a JSON header plus numpy buffers.

A message is `(header, *arrays)`: `header` is UTF-8 JSON bytes; each column contributes its
values buffer (and, for jagged and object fields, its int64 offsets) as plain numpy arrays, which
Ray's object store moves zero-copy. Object fields travel as their JSON bytes, like any buffer.
The same column entries (`pack_columns`) describe arrays placed in a shared-memory arena
(`storage.shm`) on the local path. Errors travel as `{"error": class name, "message": text}`
headers and are re-raised typed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from storage.columnar import AnyArray, Column
from storage.errors import ConflictError, SchemaError, StoreCorruptError, StoreError
from storage.schema import FieldSpec

Message = tuple[Any, ...]  # (header bytes, *numpy arrays)
_ERRORS: dict[str, type[StoreError]] = {
    cls.__name__: cls for cls in (StoreError, SchemaError, ConflictError, StoreCorruptError)
}


def pack_columns(columns: Mapping[str, Column], arrays: list[AnyArray]) -> dict[str, Any]:
    """Header entries for `columns`; appends their buffers to `arrays`."""
    header = {}
    for name, column in columns.items():
        entry: dict[str, Any] = {"spec": column.spec.to_json(), "values": len(arrays)}
        arrays.append(column.values)
        if column.offsets is not None:
            entry["offsets"] = len(arrays)
            arrays.append(column.offsets)
        header[name] = entry
    return header


def unpack_columns(header: Mapping[str, Any], arrays: Sequence[AnyArray]) -> dict[str, Column]:
    """Columns viewing `arrays` (read-only when they come from Ray: copy before keeping)."""
    columns = {}
    for name, entry in header.items():
        offsets = arrays[entry["offsets"]] if "offsets" in entry else None
        spec = FieldSpec.from_json(entry["spec"])
        columns[name] = Column(spec, arrays[entry["values"]], offsets)
    return columns


def message(header: Mapping[str, Any], arrays: Sequence[AnyArray] = ()) -> Message:
    return (json.dumps(header).encode(), *arrays)


def error_header(exc: StoreError) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


def error_message(exc: StoreError) -> Message:
    return message(error_header(exc))


def check_header(header: dict[str, Any]) -> dict[str, Any]:
    """The header itself, unless it is an error reply: then its typed error is raised."""
    if "error" in header:
        raise _ERRORS.get(header["error"], StoreError)(header["message"])
    return header


def open_message(reply: Message) -> tuple[dict[str, Any], list[AnyArray]]:
    """The header and arrays of a reply; re-raises an error reply as its typed error."""
    header = check_header(json.loads(reply[0]))
    return header, [np.asarray(array) for array in reply[1:]]


def keys_blob(keys: Sequence[str]) -> bytes:
    return json.dumps(list(keys)).encode()
