"""`Store`: the interface both backends implement, and the argument checks they share.

Backends implement six verbs (`kv_batch_put`, `kv_batch_get`, `kv_list`, `kv_clear`, `declare`,
`partitions`) plus `_export`/`_import` of whole partitions; `save`/`load` (Arrow IPC files, see
`storage.arrow_io`) and the `BatchMeta` helpers (`get`, `get_fields`) live here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from storage import arrow_io
from storage.columnar import BoolArray
from storage.errors import SchemaError, StoreError, StoreTimeout, preview
from storage.meta import BatchMeta
from storage.partition import PartitionDump
from storage.schema import FieldSpec

if TYPE_CHECKING:  # tensordict is slow to import; Ray shard workers never need it
    from tensordict import TensorDict, TensorDictBase

DEFAULT_TIMEOUT_S = 300.0
Fields: TypeAlias = "Mapping[str, Any] | TensorDictBase"


def check_timeout(value: float, what: str) -> float:
    """A finite, non-negative number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise StoreError(f"{what} must be a finite number of seconds, got {value!r}")
    if value < 0:
        raise StoreError(f"{what} must be >= 0 seconds, got {value!r}")
    return float(value)


def check_partition_id(partition_id: str) -> str:
    if not isinstance(partition_id, str) or not partition_id:
        raise SchemaError(f"partition_id must be a non-empty str, got {partition_id!r}")
    return partition_id


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_keys(keys: Sequence[str], partition_id: str) -> list[str]:
    """Keys as a list of distinct str; SchemaError otherwise."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise SchemaError(
            f"partition {partition_id!r}: keys must be a list or tuple of str, got {type(keys).__name__}"
        )
    keys = list(keys)
    if set(map(type, keys)) - {str}:
        bad = [key for key in keys if type(key) is not str]
        raise SchemaError(f"partition {partition_id!r}: keys must be str, got {preview(bad)}")
    try:
        "".join(keys).encode()  # one check for all keys (UTF-8 refuses any surrogate)
    except UnicodeEncodeError:
        bad = [key for key in keys if not _is_utf8(key)]
        raise SchemaError(
            f"partition {partition_id!r}: keys must be valid UTF-8 text, got {preview(bad)} "
            "(lone surrogates); give each sample a key without them"
        ) from None
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        repeated = []
        for key in keys:
            if key in seen:
                repeated.append(key)
            seen.add(key)
        raise SchemaError(
            f"partition {partition_id!r}: duplicate keys {preview(repeated)} in one call; "
            "give each sample its own key"
        )
    return keys


def check_select(select_fields: Sequence[str] | None, partition_id: str) -> list[str] | None:
    """Requested field names as a list of distinct str (None: every field the keys hold)."""
    if select_fields is None:
        return None
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    fields = list(select_fields)
    if any(not isinstance(name, str) for name in fields) or len(set(fields)) != len(fields):
        raise SchemaError(
            f"partition {partition_id!r}: select_fields must be distinct str, got {fields!r}"
        )
    return fields


def check_specs(specs: Mapping[str, FieldSpec], partition_id: str) -> dict[str, FieldSpec]:
    """The specs as a dict of non-empty str -> FieldSpec; SchemaError otherwise."""
    if not isinstance(specs, Mapping):
        raise SchemaError(
            f"partition {partition_id!r}: declare takes a mapping of field name to FieldSpec, "
            f"got {type(specs).__name__}"
        )
    bad = {name: spec for name, spec in specs.items() if not isinstance(spec, FieldSpec)}
    if bad or any(not isinstance(name, str) or not name for name in specs):
        raise SchemaError(
            f"partition {partition_id!r}: declare takes {{name: FieldSpec}}, got {dict(specs)!r}"
        )
    return dict(specs)


def timeout_error(
    partition_id: str,
    keys: Sequence[str],
    missing: Mapping[str, BoolArray],
    waited_s: float,
    detail: str = "",
) -> StoreTimeout:
    """A StoreTimeout naming the keys that miss at least one field and the fields missing."""
    lacking = None
    for mask in missing.values():
        lacking = mask.copy() if lacking is None else lacking | mask
    missing_keys = [] if lacking is None else [keys[i] for i in lacking.nonzero()[0].tolist()]
    counts = ", ".join(f"{name}: {int(mask.sum())}" for name, mask in missing.items())
    detail = f"keys missing per field: {counts}" + (f"; {detail}" if detail else "")
    return StoreTimeout(partition_id, missing_keys, list(missing), waited_s, detail)


class Store(ABC):
    """A typed, partitioned key-value store of samples (see DESIGN.md, "The store contract")."""

    def __init__(self, url: str, default_timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._url = url
        self._default_timeout = check_timeout(default_timeout, "default_timeout")
        self._closed = False

    @property
    def url(self) -> str:
        """The URL that opens this store (for a named store: from any process)."""
        return self._url

    @property
    def default_timeout(self) -> float:
        """Seconds a get waits when called with `timeout=None`."""
        return self._default_timeout

    def resolve_timeout(self, timeout: float | None) -> float:
        """`timeout`, or the store's default when None; never unbounded."""
        return self._default_timeout if timeout is None else check_timeout(timeout, "timeout")

    # -- the verbs -----------------------------------------------------------------------------

    @abstractmethod
    def kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Fields, *, overwrite: bool = False
    ) -> BatchMeta:
        """Stores one row per key of each field, atomically; returns the batch's handle.

        A field's first put (or declare) fixes its spec in the whole partition.

        Raises:
            SchemaError: bad keys, kinds, dtypes, shapes or row counts (nothing is stored).
            ConflictError: a key already holds different content for a field and not overwrite.
        """

    @abstractmethod
    def kv_batch_get(
        self,
        keys: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> TensorDict:
        """The fields of the keys as a TensorDict (`batch_size=[len(keys)]`, request order).

        Waits for keys and fields not yet stored, up to `timeout` seconds (None: the store's
        default; 0: check once). `select_fields=None` waits for every key to exist and returns
        the fields all of them hold; `select_fields=[]` waits for nothing and returns no fields,
        whether or not the keys or the partition exist.

        Raises:
            StoreTimeout: something was still missing when the timeout passed.
        """

    def get_fields(
        self, meta: BatchMeta, fields: Sequence[str], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """`kv_batch_get` of `fields` for `meta`'s keys, as plain values: jagged fields as
        `torch.jagged` nested tensors, dense fields as tensors, object fields as lists."""
        td = self.kv_batch_get(list(meta.keys), meta.partition_id, list(fields), timeout=timeout)
        out: dict[str, Any] = {}
        for name in fields:
            value = td[name]
            if isinstance(value, torch.Tensor):
                out[name] = value
            else:
                out[name] = value.tolist() if hasattr(value, "tolist") else list(value)
        return out

    @abstractmethod
    def kv_list(self, partition_id: str) -> dict[str, list[str]]:
        """`{key: [fields it holds]}` of a partition ({} if it does not exist).

        Raises:
            SchemaError: `partition_id` is not a non-empty str.
        """

    @abstractmethod
    def kv_clear(self, partition_id: str, keys: Sequence[str] | None = None) -> int:
        """Drops keys (None: the whole partition, specs included); returns how many existed."""

    @abstractmethod
    def declare(self, partition_id: str, specs: Mapping[str, FieldSpec]) -> None:
        """Fixes field specs of a partition before any put; conflicting specs raise SchemaError."""

    @abstractmethod
    def partitions(self) -> list[str]:
        """Ids of the partitions that exist."""

    @abstractmethod
    def _export(self, partition_id: str) -> PartitionDump:
        """A copy of a whole partition."""

    @abstractmethod
    def _import(self, dumps: Sequence[PartitionDump], replace: bool) -> None:
        """Installs whole partitions atomically (StoreError if one exists and not replace)."""

    # -- built on the verbs --------------------------------------------------------------------

    def get(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, *, timeout: float | None = None
    ) -> TensorDict:
        """`kv_batch_get` of a handle's keys; `fields` defaults to the handle's fields."""
        chosen = list(meta.fields) if fields is None else fields
        return self.kv_batch_get(list(meta.keys), meta.partition_id, chosen, timeout)

    def save(self, path: str | Path, partitions: Sequence[str] | None = None) -> list[Path]:
        """Writes partitions (default: all) to `path/`, one Arrow IPC file each, atomically."""
        known = self.partitions()
        chosen = known if partitions is None else list(partitions)
        unknown = [pid for pid in chosen if pid not in known]
        if unknown:
            raise StoreError(
                f"cannot save unknown partitions {preview(unknown)}; known: {preview(known)}"
            )
        return [arrow_io.write_partition(Path(path), self._export(pid)) for pid in chosen]

    def load(
        self, path: str | Path, partitions: Sequence[str] | None = None, *, replace: bool = False
    ) -> list[BatchMeta]:
        """Reads partitions saved by `save`; all files are checked before anything changes.

        Raises:
            StoreCorruptError: a file is torn, foreign or inconsistent (the store is unchanged).
            StoreError: a partition already exists here and `replace` is False.
        """
        dumps = arrow_io.read_partitions(Path(path), partitions)
        self._import(dumps, replace)
        return [BatchMeta(d.partition_id, tuple(d.keys), tuple(d.columns)) for d in dumps]

    def close(self) -> None:
        """Releases what this handle created (Ray actors); the embedded store drops its data."""
        self._closed = True

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
