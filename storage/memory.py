"""The embedded store (`memory://`): partitions in this process, guarded by one condition.

Producers and consumers may be threads. A put converts and copies its values outside the lock,
then validates against the partition and applies under it, and wakes every waiting get; a get
locates its rows under the lock (waiting on the condition while something is missing, never
polling) and copies them out after releasing it (stored chunks are immutable).

`memory://NAME` opens a store shared by every `open_store` of that name in this process, so
stages running in one flow process see the same data; plain `memory://` is private.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

from storage.base import (
    DEFAULT_TIMEOUT_S,
    Fields,
    Store,
    check_keys,
    check_partition_id,
    check_select,
    check_specs,
    timeout_error,
)
from storage.convert import to_columns, to_tensordict
from storage.errors import StoreError, preview
from storage.meta import BatchMeta
from storage.partition import Partition, PartitionDump
from storage.schema import FieldSpec, registered_spec


@dataclass
class _State:
    """What handles of one named store share."""

    parts: dict[str, Partition] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)


_named: dict[str, _State] = {}
_named_lock = threading.Lock()


class MemoryStore(Store):
    """The in-process backend."""

    def __init__(self, name: str = "", default_timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(f"memory://{name}", default_timeout)
        self._name = name
        if not name:
            self._state = _State()
            return
        with _named_lock:
            self._state = _named.setdefault(name, _State())

    def __reduce__(self) -> tuple[Any, ...]:
        raise StoreError(
            f"{self.url} lives in this process and cannot be pickled; pass a ray:// store (or "
            "its URL) to other processes"
        )

    def kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Fields, *, overwrite: bool = False
    ) -> BatchMeta:
        check_partition_id(partition_id)
        keys = check_keys(keys, partition_id)
        part = self._state.parts.get(partition_id)
        expected = part.expected_spec if part is not None else registered_spec
        columns = to_columns(fields, len(keys), partition_id, expected)
        columns = {name: column.owned_copy() for name, column in columns.items()}
        with self._state.cond:
            part = self._state.parts.get(partition_id) or Partition(partition_id)
            plan = part.plan_put(keys, columns, overwrite)
            part.apply(plan)
            self._state.parts[partition_id] = part
            self._state.cond.notify_all()
        return BatchMeta(partition_id, tuple(keys), tuple(columns))

    def kv_batch_get(
        self,
        keys: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> TensorDict:
        check_partition_id(partition_id)
        keys = check_keys(keys, partition_id)
        fields = check_select(select_fields, partition_id)
        budget = self.resolve_timeout(timeout)
        start = time.monotonic()
        with self._state.cond:
            while True:
                part = self._state.parts.get(partition_id) or Partition(partition_id)
                found = part.find(keys, fields)  # a missing partition finds what an empty one does
                remaining = start + budget - time.monotonic()
                if not found.missing:
                    break
                if remaining <= 0:
                    raise timeout_error(partition_id, keys, found.missing, time.monotonic() - start)
                self._state.cond.wait(remaining)
        columns = {name: located.column() for name, located in found.located.items()}
        return to_tensordict(columns, len(keys))

    def kv_list(self, partition_id: str) -> dict[str, list[str]]:
        check_partition_id(partition_id)
        with self._state.cond:
            part = self._state.parts.get(partition_id)
            return part.listing() if part else {}

    def kv_clear(self, partition_id: str, keys: Sequence[str] | None = None) -> int:
        check_partition_id(partition_id)
        if keys is not None:
            keys = check_keys(keys, partition_id)
        with self._state.cond:
            part = self._state.parts.get(partition_id)
            if part is None:
                return 0
            if keys is None:
                del self._state.parts[partition_id]
                return len(part.key_ids)
            return part.drop(keys)

    def declare(self, partition_id: str, specs: Mapping[str, FieldSpec]) -> None:
        check_partition_id(partition_id)
        specs = check_specs(specs, partition_id)
        with self._state.cond:
            part = self._state.parts.get(partition_id) or Partition(partition_id)
            part.declare(specs)
            self._state.parts[partition_id] = part

    def partitions(self) -> list[str]:
        with self._state.cond:
            return list(self._state.parts)

    def _export(self, partition_id: str) -> PartitionDump:
        with self._state.cond:
            part = self._state.parts.get(partition_id)
            if part is None:
                raise StoreError(f"partition {partition_id!r} does not exist")
            return part.export()

    def _import(self, dumps: Sequence[PartitionDump], replace: bool) -> None:
        restored = [Partition.restore(dump) for dump in dumps]
        with self._state.cond:
            taken = [p.partition_id for p in restored if self._state.parts.get(p.partition_id)]
            if taken and not replace:
                raise StoreError(
                    f"partitions {preview(taken)} already exist in {self.url}; kv_clear them "
                    "first or load with replace=True"
                )
            for part in restored:
                self._state.parts[part.partition_id] = part
            self._state.cond.notify_all()

    def close(self) -> None:
        """Forgets this store's name; the data goes when the last handle is dropped."""
        if self._name:
            with _named_lock:
                if _named.get(self._name) is self._state:
                    del _named[self._name]
