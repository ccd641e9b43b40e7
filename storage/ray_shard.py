"""One shard of the Ray backend: an async actor holding the partitions of the keys hashed to it.

The class is plain Python (the client wraps it with `ray.remote`), and this module imports
neither torch nor tensordict nor, at import time, Ray: a shard worker starts with numpy only
(`tests/storage/test_schema_meta.py` checks it).
A shard answers two ways, on the same state (guarded by one `threading.Condition`):

- Ray method calls on the actor's event loop, whose data are `storage.wire` messages in Ray's
  object store (any node);
- requests on its Unix socket (`storage.channel`, started by the first `config` call), each
  connection served by a thread of its own, whose column bytes sit in the connection's
  shared-memory arena (`storage.shm`): clients on its node.

Store errors travel as error headers and are re-raised typed by the client. A get waits on the
condition, which every commit notifies; a staged (prepared) put holds its own copy of the rows,
since the arena it came in is reused by the next request.

A field's spec holds partition-wide: a multi-shard put is prepared on every shard (those without
its keys validate and fix only the specs), and so is a declare. A shard records in
`Partition.everywhere` the fields whose spec such a put, declare or load fixed on every shard; a
one-shard put (`solo`) is applied at once only when all its fields are there (or in the shared
vocabulary), and otherwise answers `{"spread": true}`, changing nothing, so that the client
sends it through every shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage import shm
from storage.channel import Header, Server, new_address, serve
from storage.columnar import Column, IntArray
from storage.errors import ConflictError, SchemaError, StoreError, preview
from storage.partition import Found, Partition, PartitionDump, PutPlan
from storage.schema import FieldSpec, registered_spec
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
    returns such blocks to the kernel and the next put faults fresh pages in, which can cost more
    than copying the batch (benchmarks/results/store.json). Keeping up to
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


def _pack_found(found: Found, arrays: list[Any]) -> dict[str, Any]:
    """Header entries of the located rows, their buffers appended to `arrays` (views of stored
    chunks where a field's rows are one run: copy them out before the shard changes)."""
    return pack_columns({name: at.view() for name, at in found.located.items()}, arrays)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class _Staged:
    """A prepared, uncommitted change of a shard."""

    apply: Callable[[], None]
    expires: float
    plan: PutPlan | None = None


class StoreShard:
    """One shard: the partitions of the keys that hash to it (a Ray async actor).

    Its state is guarded by one `threading.Condition`, taken by the Ray methods (on the actor's
    event loop) and by the local connections' threads alike, and notified by every commit. Hold
    it only to plan, apply or locate: copying rows out happens after it is released (stored
    chunks are immutable). A get that has to wait does so on the condition in its local
    connection's thread, or, for a Ray call, on a future that the next commit resolves: the event
    loop never blocks on a wait.
    """

    def __init__(self, store: str, index: int, shards: int, owner: str) -> None:
        self._config = {"store": store, "index": index, "shards": shards, "owner": owner}
        self._parts: dict[str, Partition] = {}
        self._staged: dict[str, _Staged] = {}
        self._counts: Counter[str] = Counter()  # requests by verb and transport, for tests
        self._changed = threading.Condition()  # guards the three above and _waiting
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._server: Server | None = None
        _keep_freed_memory()

    async def config(self) -> bytes:
        """Store name, index, shard count, owner token, node id, process id, and the local socket
        (or None)."""
        if self._server is None and shm.available():
            with contextlib.suppress(OSError):  # no local path: clients use Ray calls
                self._server = serve(new_address(), self._serve_local)
        address = self._server.address if self._server else None
        node = {"node": _node_id(), "pid": os.getpid()}
        return json.dumps({**self._config, **node, "socket": address}).encode()

    async def stats(self) -> bytes:
        """Requests served per verb and transport, open local connections, and this process."""
        connections = self._server.connections if self._server else 0
        with self._changed:
            counts = dict(self._counts)
        return json.dumps(
            {"counts": counts, "connections": connections, "pid": os.getpid()}
        ).encode()

    def _count(self, what: str) -> None:
        with self._changed:
            self._counts[what] += 1

    # -- puts ---------------------------------------------------------------------------------

    def _plan(
        self, partition_id: str, keys: list[str], columns: dict[str, Column], overwrite: bool
    ) -> PutPlan:
        """Validates a put against the stored and the staged state (under `_changed`)."""
        part = self._parts.get(partition_id) or Partition(partition_id)
        plan = part.plan_put(keys, columns, overwrite)
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

    def _put_now(
        self,
        partition_id: str,
        keys: list[str],
        columns: dict[str, Column],
        overwrite: bool,
        solo: bool,
    ) -> Header:
        """Validates and stores a one-shard put (copying what it keeps); wakes waiting gets.

        With `solo` (a store of several shards), a put with a field whose spec is not known to be
        fixed on every shard changes nothing and answers `{"spread": True}`.
        """
        with self._changed:
            if solo:
                part = self._parts.get(partition_id)
                shared = part.everywhere if part is not None else set()
                if any(n not in shared and registered_spec(n) is None for n in columns):
                    return {"spread": True}
            plan = self._plan(partition_id, keys, columns, overwrite)
            self._parts.setdefault(partition_id, Partition(partition_id)).apply(plan)
            self._wake()
        return {"ok": True}

    def _prepare_now(
        self,
        txn: str,
        partition_id: str,
        keys: list[str],
        columns: dict[str, Column],
        overwrite: bool,
        ttl: float,
    ) -> None:
        """Validates this shard's part of a multi-shard put and stages it for `commit`.

        Every shard prepares such a put (with no keys, a shard checks and fixes only the specs),
        so on commit its fields' specs are fixed everywhere.
        """
        with self._changed:
            plan = self._plan(partition_id, keys, columns, overwrite)
            parts = self._parts

            def apply() -> None:
                part = parts.setdefault(plan.partition_id, Partition(plan.partition_id))
                part.apply(plan)
                part.everywhere.update(columns)

            self._staged[txn] = _Staged(apply, time.monotonic() + ttl, plan)

    @staticmethod
    def _message_columns(payload: Message, rows: IntArray) -> dict[str, Column]:
        """This shard's rows of a batch in the object store (copied out of it)."""
        header, arrays = open_message(payload)
        columns = unpack_columns(header["fields"], arrays)
        return {name: column.take(rows) for name, column in columns.items()}

    async def put(
        self,
        partition_id: str,
        keys: bytes,
        rows: IntArray,
        payload: Message,
        overwrite: bool,
        solo: bool = False,
    ) -> Message:
        """A one-shard put: validate and apply at once (see `_put_now` for `solo`)."""
        self._count("put:object_store")
        try:
            columns = self._message_columns(payload, rows)
            return message(self._put_now(partition_id, json.loads(keys), columns, overwrite, solo))
        except StoreError as exc:
            return error_message(exc)

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
        self._count("prepare:object_store")
        try:
            columns = self._message_columns(payload, rows)
            self._prepare_now(txn, partition_id, json.loads(keys), columns, overwrite, ttl)
        except StoreError as exc:
            return error_message(exc)
        return message({"ok": True})

    async def stage_import(self, txn: str, payload: Message, replace: bool, ttl: float) -> Message:
        """Validates and stages whole partitions from `load`."""
        try:
            header, arrays = open_message(payload)
            restored = [Partition.restore(dump_from(h, arrays)) for h in header["dumps"]]
            for part in restored:  # every shard loads every spec of a partition
                part.everywhere.update(part.specs)
            with self._changed:
                taken = [p.partition_id for p in restored if p.partition_id in self._parts]
                if taken and not replace:
                    raise StoreError(
                        f"partitions {preview(taken)} already exist; kv_clear them first or load "
                        "with replace=True"
                    )
                self._staged[txn] = _Staged(
                    lambda: self._parts.update({p.partition_id: p for p in restored}),
                    time.monotonic() + ttl,
                )
        except StoreError as exc:
            return error_message(exc)
        return message({"ok": True})

    async def stage_declare(self, txn: str, partition_id: str, specs: bytes, ttl: float) -> Message:
        """Validates and stages a declaration of field specs."""
        try:
            parsed = {name: FieldSpec.from_json(s) for name, s in json.loads(specs).items()}
            with self._changed:
                (self._parts.get(partition_id) or Partition(partition_id)).new_specs(parsed)

                def apply() -> None:
                    part = self._parts.setdefault(partition_id, Partition(partition_id))
                    part.declare(parsed)
                    part.everywhere.update(parsed)  # every shard declares it

                self._staged[txn] = _Staged(apply, time.monotonic() + ttl)
        except StoreError as exc:
            return error_message(exc)
        return message({"ok": True})

    async def commit(self, txn: str) -> Message:
        return message(self._commit(txn))

    def _commit(self, txn: str) -> Header:
        with self._changed:
            staged = self._staged.pop(txn, None)
            if staged is None:
                return error_header(
                    StoreError(f"transaction {txn} expired before its commit; retry")
                )
            staged.apply()
            self._wake()
        return {"ok": True}

    async def abort(self, txn: str) -> None:
        self._abort(txn)

    def _abort(self, txn: str) -> None:
        with self._changed:
            self._staged.pop(txn, None)

    # -- gets ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        """Wakes every waiting get: local threads and Ray calls alike (under `_changed`)."""
        self._changed.notify_all()
        for loop, waiter in self._waiting:
            with contextlib.suppress(RuntimeError):  # a loop closed by the actor's exit
                loop.call_soon_threadsafe(_resolve, waiter)
        self._waiting.clear()

    def _locate(self, partition_id: str, keys: list[str], fields: list[str] | None) -> Found:
        """The keys' fields located now, or what misses (call under `_changed`)."""
        return (self._parts.get(partition_id) or Partition(partition_id)).find(keys, fields)

    def _find(
        self, partition_id: str, keys: list[str], fields: list[str] | None, timeout: float
    ) -> Found:
        """The keys' fields located, waiting up to `timeout` s for missing ones (then reported).

        Blocks the calling thread while it waits (a local connection's own thread).
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = self._locate(partition_id, keys, fields)
                remaining = deadline - time.monotonic()
                if not found.missing or remaining <= 0:
                    return found
                self._changed.wait(remaining)

    async def _find_async(
        self, partition_id: str, keys: list[str], fields: list[str] | None, timeout: float
    ) -> Found:
        """`_find` for the event loop: waits on a future that the next commit resolves."""
        deadline = time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            with self._changed:
                found = self._locate(partition_id, keys, fields)
                remaining = deadline - time.monotonic()
                if not found.missing or remaining <= 0:
                    return found
                self._waiting.append((loop, waiter))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter, remaining)
            with self._changed, contextlib.suppress(ValueError):  # not woken: stop listening
                self._waiting.remove((loop, waiter))

    async def get(self, partition_id: str, keys: bytes, fields: bytes, timeout: float) -> Message:
        """This shard's rows in key order, waiting up to `timeout` s for missing ones."""
        self._count("get:object_store")
        try:
            found = await self._find_async(
                partition_id, json.loads(keys), json.loads(fields), timeout
            )
        except StoreError as exc:
            return error_message(exc)
        if found.missing:
            return message(_missing(found))
        arrays: list[Any] = []
        return message({"fields": _pack_found(found, arrays)}, arrays)  # Ray copies them out

    # -- the local socket ---------------------------------------------------------------------

    def _serve_local(self, request: Header, arena: Arena) -> Header:
        """Answers one request of a local connection (see `_LOCAL`), on that connection's thread."""
        verb = request.get("op")
        handler = _LOCAL.get(verb) if isinstance(verb, str) else None
        try:
            if handler is None:
                raise StoreError(f"shard {self._config['index']}: unknown request {verb!r}")
            self._count(f"{verb}:shm")
            return handler(self, request, arena)
        except StoreError as exc:
            return error_header(exc)
        except (ArenaError, KeyError, TypeError, ValueError) as exc:
            bad = StoreError(f"shard {self._config['index']}: malformed {verb} request: {exc!r}")
            return error_header(bad)

    @staticmethod
    def _arena_columns(request: Header, arena: Arena) -> dict[str, Column]:
        """A request's columns, viewing the connection's arena (valid until its next message)."""
        arena.follow(int(request["arena"]))
        return unpack_columns(request["fields"], arena.read(request["arrays"]))

    def _local_put(self, request: Header, arena: Arena) -> Header:
        columns = self._arena_columns(request, arena)  # apply copies the rows it keeps
        partition_id, keys, overwrite = request["partition"], request["keys"], request["overwrite"]
        return self._put_now(partition_id, keys, columns, overwrite, bool(request.get("solo")))

    def _local_prepare(self, request: Header, arena: Arena) -> Header:
        # a staged put outlives this message, so it holds its own copy of the rows
        columns = {n: c.copy() for n, c in self._arena_columns(request, arena).items()}
        partition_id, keys, overwrite = request["partition"], request["keys"], request["overwrite"]
        ttl = float(request["ttl"])
        self._prepare_now(request["txn"], partition_id, keys, columns, overwrite, ttl)
        return {"ok": True}

    def _local_commit(self, request: Header, arena: Arena) -> Header:
        return self._commit(request["txn"])

    def _local_abort(self, request: Header, arena: Arena) -> Header:
        self._abort(request["txn"])
        return {"ok": True}

    def _local_get(self, request: Header, arena: Arena) -> Header:
        fields, timeout = request["fields"], float(request["timeout"])
        found = self._find(request["partition"], request["keys"], fields, timeout)
        if found.missing:
            return _missing(found)
        arrays: list[Any] = []
        fields = _pack_found(found, arrays)
        return {"fields": fields, "arrays": arena.write(arrays), "arena": arena.size}

    # -- the rest -----------------------------------------------------------------------------

    async def listing(self, partition_id: str) -> bytes:
        with self._changed:
            part = self._parts.get(partition_id)
            return json.dumps(part.listing() if part else {}).encode()

    async def clear(self, partition_id: str, keys: bytes | None) -> int:
        with self._changed:
            part = self._parts.get(partition_id)
            if part is None:
                return 0
            if keys is None:
                del self._parts[partition_id]
                return len(part.key_ids)
            return part.drop(json.loads(keys))

    async def specs(self, partition_id: str) -> bytes:
        """The field specs fixed in a partition here, as JSON ({} if it does not exist)."""
        with self._changed:
            part = self._parts.get(partition_id)
            specs = dict(part.specs) if part else {}
        return json.dumps({name: spec.to_json() for name, spec in specs.items()}).encode()

    async def partitions(self) -> bytes:
        with self._changed:
            return json.dumps(list(self._parts)).encode()

    async def export(self, partition_id: str) -> Message:
        with self._changed:
            part = self._parts.get(partition_id)
            dump = part.export() if part is not None else None
        if dump is None:
            return message({"exists": False})
        arrays: list[Any] = []
        header = dump_header(dump, arrays)
        return message({"exists": True, "dump": header}, arrays)


_LOCAL: dict[str, Callable[[StoreShard, Header, Arena], Header]] = {
    "put": StoreShard._local_put,
    "prepare": StoreShard._local_prepare,
    "commit": StoreShard._local_commit,
    "abort": StoreShard._local_abort,
    "get": StoreShard._local_get,
}
