"""One shard of the Ray backend: an async actor holding the partitions of the keys hashed to it.

The class is plain Python (the client wraps it with `ray.remote`), and this module imports
neither Ray nor tensordict, so a shard worker starts with torch and numpy only. Every method
returns bytes or a `storage.wire` message; store errors travel as error messages and are
re-raised typed by the client. A get waits on an asyncio.Condition that every commit notifies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage.columnar import IntArray
from storage.errors import ConflictError, SchemaError, StoreError, preview
from storage.partition import Partition, PartitionDump, PutPlan
from storage.schema import FieldSpec
from storage.wire import Message, error_message, message, open_message, pack_columns, unpack_columns


def actor_name(store: str, index: int) -> str:
    return f"ppoflow-store/{store}/shard-{index}"


def shard_of(keys: Sequence[str], n_shards: int) -> IntArray:
    """The shard of each key: a stable hash, the same in every process."""
    crc = zlib.crc32
    hashes = np.fromiter((crc(key.encode()) for key in keys), np.int64, len(keys))
    return hashes % n_shards


def dump_header(dump: PartitionDump, arrays: list[Any]) -> dict[str, Any]:
    present = {}
    for name, mask in dump.present.items():
        present[name] = len(arrays)
        arrays.append(mask)
    return {
        "partition": dump.partition_id,
        "keys": dump.keys,
        "specs": {name: spec.to_json() for name, spec in dump.specs.items()},
        "columns": pack_columns(dump.columns, arrays),
        "present": present,
    }


def dump_from(header: Mapping[str, Any], arrays: Sequence[Any]) -> PartitionDump:
    specs = {name: FieldSpec.from_json(spec) for name, spec in header["specs"].items()}
    present = {name: np.asarray(arrays[i], np.bool_) for name, i in header["present"].items()}
    columns = unpack_columns(header["columns"], arrays)
    return PartitionDump(header["partition"], list(header["keys"]), specs, present, columns)


@dataclass
class _Staged:
    """A prepared, uncommitted change of a shard."""

    apply: Callable[[], None]
    expires: float
    plan: PutPlan | None = None


class StoreShard:
    """One shard: the partitions of the keys that hash to it (a Ray async actor)."""

    def __init__(self, store: str, index: int, shards: int, owner: str) -> None:
        self._config = {"store": store, "index": index, "shards": shards, "owner": owner}
        self._parts: dict[str, Partition] = {}
        self._staged: dict[str, _Staged] = {}
        self._cond = asyncio.Condition()

    async def config(self) -> bytes:
        return json.dumps(self._config).encode()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _plan(
        self, partition_id: str, keys: bytes, rows: IntArray, payload: Message, overwrite: bool
    ) -> PutPlan:
        header, arrays = open_message(payload)
        columns = unpack_columns(header["fields"], arrays)
        mine = {name: column.take(rows) for name, column in columns.items()}
        part = self._parts.get(partition_id) or Partition(partition_id)
        plan = part.plan_put(json.loads(keys), mine, overwrite)
        self._check_staged(plan)
        return plan

    def _check_staged(self, plan: PutPlan) -> None:
        now = time.monotonic()
        for txn in [txn for txn, staged in self._staged.items() if staged.expires < now]:
            del self._staged[txn]
        keys = set(plan.keys)
        for staged in self._staged.values():
            other = staged.plan
            if other is None or other.partition_id != plan.partition_id:
                continue
            if set(other.writes) & set(plan.writes) and not keys.isdisjoint(other.keys):
                raise ConflictError(
                    f"partition {plan.partition_id!r}: another put to the same keys and fields is "
                    "being committed; retry when it has finished"
                )
            for name, spec in plan.new_specs.items():
                if other.new_specs.get(name, spec) != spec:
                    raise SchemaError(
                        f"partition {plan.partition_id!r}, field {name!r}: a concurrent put is "
                        f"fixing it as {other.new_specs[name].describe()}, got {spec.describe()}"
                    )

    def _apply_plan(self, plan: PutPlan) -> None:
        self._parts.setdefault(plan.partition_id, Partition(plan.partition_id)).apply(plan)

    async def put(
        self, partition_id: str, keys: bytes, rows: IntArray, payload: Message, overwrite: bool
    ) -> Message:
        """A one-shard put: validate and apply at once."""
        try:
            plan = self._plan(partition_id, keys, rows, payload, overwrite)
        except StoreError as exc:
            return error_message(exc)
        self._apply_plan(plan)
        await self._notify()
        return message({"ok": True})

    async def prepare(
        self,
        txn: str,
        partition_id: str,
        keys: bytes,
        rows: IntArray,
        payload: Message,
        overwrite: bool,
        ttl: float,
    ) -> Message:
        """Validates and stages this shard's rows of a multi-shard put."""
        try:
            plan = self._plan(partition_id, keys, rows, payload, overwrite)
        except StoreError as exc:
            return error_message(exc)
        self._staged[txn] = _Staged(lambda: self._apply_plan(plan), time.monotonic() + ttl, plan)
        return message({"ok": True})

    async def stage_import(self, txn: str, payload: Message, replace: bool, ttl: float) -> Message:
        """Validates and stages whole partitions from `load`."""
        try:
            header, arrays = open_message(payload)
            restored = [Partition.restore(dump_from(h, arrays)) for h in header["dumps"]]
            taken = [p.partition_id for p in restored if p.partition_id in self._parts]
            if taken and not replace:
                raise StoreError(
                    f"partitions {preview(taken)} already exist; kv_clear them first or load "
                    "with replace=True"
                )
        except StoreError as exc:
            return error_message(exc)
        self._staged[txn] = _Staged(
            lambda: self._parts.update({p.partition_id: p for p in restored}),
            time.monotonic() + ttl,
        )
        return message({"ok": True})

    async def stage_declare(self, txn: str, partition_id: str, specs: bytes, ttl: float) -> Message:
        """Validates and stages a declaration of field specs."""
        try:
            parsed = {name: FieldSpec.from_json(s) for name, s in json.loads(specs).items()}
            (self._parts.get(partition_id) or Partition(partition_id)).new_specs(parsed)
        except StoreError as exc:
            return error_message(exc)

        def apply() -> None:
            self._parts.setdefault(partition_id, Partition(partition_id)).declare(parsed)

        self._staged[txn] = _Staged(apply, time.monotonic() + ttl)
        return message({"ok": True})

    async def commit(self, txn: str) -> Message:
        staged = self._staged.pop(txn, None)
        if staged is None:
            return error_message(StoreError(f"transaction {txn} expired before its commit; retry"))
        staged.apply()
        await self._notify()
        return message({"ok": True})

    async def abort(self, txn: str) -> None:
        self._staged.pop(txn, None)

    async def get(self, partition_id: str, keys: bytes, fields: bytes, timeout: float) -> Message:
        """This shard's rows in key order, waiting up to `timeout` s for missing ones."""
        wanted, names = json.loads(keys), json.loads(fields)
        deadline = time.monotonic() + timeout
        try:
            async with self._cond:
                while True:
                    part = self._parts.get(partition_id) or Partition(partition_id)
                    found = part.find(wanted, names)
                    remaining = deadline - time.monotonic()
                    if not found.missing or remaining <= 0:
                        break
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), remaining)
        except StoreError as exc:
            return error_message(exc)
        if found.missing:
            missing = {name: np.flatnonzero(mask).tolist() for name, mask in found.missing.items()}
            return message({"missing": missing})
        arrays: list[Any] = []
        columns = {name: located.view() for name, located in found.located.items()}
        return message({"fields": pack_columns(columns, arrays)}, arrays)  # Ray copies them out

    async def listing(self, partition_id: str) -> bytes:
        part = self._parts.get(partition_id)
        return json.dumps(part.listing() if part else {}).encode()

    async def clear(self, partition_id: str, keys: bytes | None) -> int:
        part = self._parts.get(partition_id)
        if part is None:
            return 0
        if keys is None:
            del self._parts[partition_id]
            return len(part.key_ids)
        return part.drop(json.loads(keys))

    async def partitions(self) -> bytes:
        return json.dumps(list(self._parts)).encode()

    async def export(self, partition_id: str) -> Message:
        part = self._parts.get(partition_id)
        if part is None:
            return message({"exists": False})
        arrays: list[Any] = []
        header = dump_header(part.export(), arrays)
        return message({"exists": True, "dump": header}, arrays)
