"""One shard of the Ray backend: an async actor holding the partitions of the keys hashed to it.

The class is plain Python (the client wraps it with `ray.remote`), and this module imports
neither tensordict nor, at import time, Ray, so a shard worker starts with torch and numpy only.
A shard answers two ways, on one asyncio loop and so on the same state:

- Ray method calls, whose data are `storage.wire` messages in Ray's object store (any node);
- requests on its Unix socket (`storage.channel`, started by the first `config` call), whose
  column bytes sit in the connection's shared-memory arena (`storage.shm`): clients on its node.

Store errors travel as error headers and are re-raised typed by the client. A get waits on an
asyncio.Condition that every commit notifies; a staged (prepared) put holds its own copy of the
rows, since the arena it came in is reused by the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage import shm
from storage.channel import Header, Server, new_address, serve
from storage.columnar import Column, IntArray
from storage.errors import ConflictError, SchemaError, StoreError, preview
from storage.partition import Found, Partition, PartitionDump, PutPlan
from storage.schema import FieldSpec
from storage.shm import Arena, ArenaError
from storage.wire import (
    Message,
    error_header,
    error_message,
    message,
    open_message,
    pack_columns,
    unpack_columns,
)


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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def _keep_freed_memory() -> None:
    """Asks glibc to keep freed blocks of this process for reuse rather than hand them back.

    A shard frees and refills megabytes per put (every kv_clear frees a batch); by default glibc
    returns such blocks to the kernel and the next put faults fresh pages in, which on a VM costs
    about 3 us per 4 KiB page: 1.2 ms for a 1.6 MB batch, more than copying it. Keeping up to
    256 MiB of free memory at the top of the heap (and serving blocks up to 32 MiB from the heap)
    makes a steady put/clear cycle reuse warm pages. A no-op where glibc is not the allocator.
    """
    with contextlib.suppress(OSError, AttributeError):  # no libc.so.6, or no mallopt in it
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)


def _node_id() -> str:
    """The Ray node this process runs on ("" outside Ray). Ray is already loaded in a shard."""
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""


def _missing(found: Found) -> Header:
    return {
        "missing": {name: np.flatnonzero(mask).tolist() for name, mask in found.missing.items()}
    }


def _detached(plan: PutPlan) -> PutPlan:
    """The plan holding its own copies of the rows (its columns may view a reused arena)."""
    writes = {name: (rows, column.copy()) for name, (rows, column) in plan.writes.items()}
    return PutPlan(plan.partition_id, plan.keys, plan.new_specs, writes)


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
        self._server: Server | None = None
        self._counts: Counter[str] = Counter()  # requests by verb and transport, for tests
        _keep_freed_memory()

    async def config(self) -> bytes:
        """Store name, index, shard count, owner token, node id, and the local socket (or None)."""
        if self._server is None and shm.available():
            with contextlib.suppress(OSError):  # no local path: clients use Ray calls
                self._server = await serve(new_address(), self._serve_local)
        address = self._server.address if self._server else None
        return json.dumps({**self._config, "node": _node_id(), "socket": address}).encode()

    async def stats(self) -> bytes:
        """Requests served per verb and transport, open local connections, and this process."""
        connections = self._server.connections if self._server else 0
        stats = {"counts": self._counts, "connections": connections, "pid": os.getpid()}
        return json.dumps(stats).encode()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    # -- puts ---------------------------------------------------------------------------------

    def _plan(
        self, partition_id: str, keys: list[str], columns: dict[str, Column], overwrite: bool
    ) -> PutPlan:
        part = self._parts.get(partition_id) or Partition(partition_id)
        plan = part.plan_put(keys, columns, overwrite)
        self._check_staged(plan)
        return plan

    def _plan_message(
        self, partition_id: str, keys: bytes, rows: IntArray, payload: Message, overwrite: bool
    ) -> PutPlan:
        """The plan of this shard's rows of a batch in the object store (copied out of it)."""
        header, arrays = open_message(payload)
        columns = unpack_columns(header["fields"], arrays)
        mine = {name: column.take(rows) for name, column in columns.items()}
        return self._plan(partition_id, json.loads(keys), mine, overwrite)

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

    async def _apply_now(self, plan: PutPlan) -> None:
        """Stores a plan (copying what it keeps) and wakes waiting gets."""
        self._parts.setdefault(plan.partition_id, Partition(plan.partition_id)).apply(plan)
        await self._notify()

    def _stage(self, txn: str, plan: PutPlan, ttl: float) -> None:
        parts = self._parts

        def apply() -> None:
            parts.setdefault(plan.partition_id, Partition(plan.partition_id)).apply(plan)

        self._staged[txn] = _Staged(apply, time.monotonic() + ttl, plan)

    async def put(
        self, partition_id: str, keys: bytes, rows: IntArray, payload: Message, overwrite: bool
    ) -> Message:
        """A one-shard put: validate and apply at once."""
        self._counts["put:object_store"] += 1
        try:
            plan = self._plan_message(partition_id, keys, rows, payload, overwrite)
        except StoreError as exc:
            return error_message(exc)
        await self._apply_now(plan)
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
        self._counts["prepare:object_store"] += 1
        try:
            plan = self._plan_message(partition_id, keys, rows, payload, overwrite)
        except StoreError as exc:
            return error_message(exc)
        self._stage(txn, plan, ttl)
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
        return message(await self._commit(txn))

    async def _commit(self, txn: str) -> Header:
        staged = self._staged.pop(txn, None)
        if staged is None:
            return error_header(StoreError(f"transaction {txn} expired before its commit; retry"))
        staged.apply()
        await self._notify()
        return {"ok": True}

    async def abort(self, txn: str) -> None:
        self._staged.pop(txn, None)

    # -- gets ---------------------------------------------------------------------------------

    async def _find(
        self, partition_id: str, keys: list[str], fields: list[str] | None, timeout: float
    ) -> Found:
        """The keys' fields located, waiting up to `timeout` s for missing ones (then reported)."""
        deadline = time.monotonic() + timeout
        async with self._cond:
            while True:
                part = self._parts.get(partition_id) or Partition(partition_id)
                found = part.find(keys, fields)
                remaining = deadline - time.monotonic()
                if not found.missing or remaining <= 0:
                    return found
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._cond.wait(), remaining)

    async def get(self, partition_id: str, keys: bytes, fields: bytes, timeout: float) -> Message:
        """This shard's rows in key order, waiting up to `timeout` s for missing ones."""
        self._counts["get:object_store"] += 1
        try:
            found = await self._find(partition_id, json.loads(keys), json.loads(fields), timeout)
        except StoreError as exc:
            return error_message(exc)
        if found.missing:
            return message(_missing(found))
        arrays: list[Any] = []
        columns = {name: located.view() for name, located in found.located.items()}
        return message({"fields": pack_columns(columns, arrays)}, arrays)  # Ray copies them out

    # -- the local socket ---------------------------------------------------------------------

    async def _serve_local(self, request: Header, arena: Arena) -> Header:
        """Answers one request of a local connection (see `_LOCAL`)."""
        verb = request.get("op")
        handler = _LOCAL.get(verb) if isinstance(verb, str) else None
        try:
            if handler is None:
                raise StoreError(f"shard {self._config['index']}: unknown request {verb!r}")
            self._counts[f"{verb}:shm"] += 1
            return await handler(self, request, arena)
        except StoreError as exc:
            return error_header(exc)
        except (ArenaError, KeyError, TypeError, ValueError) as exc:
            bad = StoreError(f"shard {self._config['index']}: malformed {verb} request: {exc!r}")
            return error_header(bad)

    def _arena_plan(self, request: Header, arena: Arena) -> PutPlan:
        arena.follow(int(request["arena"]))
        columns = unpack_columns(request["fields"], arena.read(request["arrays"]))
        return self._plan(request["partition"], request["keys"], columns, request["overwrite"])

    async def _local_put(self, request: Header, arena: Arena) -> Header:
        await self._apply_now(self._arena_plan(request, arena))  # apply copies the rows it keeps
        return {"ok": True}

    async def _local_prepare(self, request: Header, arena: Arena) -> Header:
        plan = _detached(self._arena_plan(request, arena))
        self._stage(request["txn"], plan, float(request["ttl"]))
        return {"ok": True}

    async def _local_commit(self, request: Header, arena: Arena) -> Header:
        return await self._commit(request["txn"])

    async def _local_abort(self, request: Header, arena: Arena) -> Header:
        self._staged.pop(request["txn"], None)
        return {"ok": True}

    async def _local_get(self, request: Header, arena: Arena) -> Header:
        fields, timeout = request["fields"], float(request["timeout"])
        found = await self._find(request["partition"], request["keys"], fields, timeout)
        if found.missing:
            return _missing(found)
        arrays: list[Any] = []
        columns = {name: located.view() for name, located in found.located.items()}
        header = {"fields": pack_columns(columns, arrays)}
        return {**header, "arrays": arena.write(arrays), "arena": arena.size}

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


_LOCAL: dict[str, Callable[[StoreShard, Header, Arena], Awaitable[Header]]] = {
    "put": StoreShard._local_put,
    "prepare": StoreShard._local_prepare,
    "commit": StoreShard._local_commit,
    "abort": StoreShard._local_abort,
    "get": StoreShard._local_get,
}
