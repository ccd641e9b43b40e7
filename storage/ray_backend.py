"""The Ray backend (`ray://NAME?shards=N&namespace=NS`): partitions spread over Ray actor shards.

Key k lives on shard `crc32(k) % N`. Each shard is an async Ray actor named
`ppoflow-store/NAME/shard-i` in namespace NS, holding `Partition`s exactly like the embedded
store; any process that opens the same URL reaches the same shards. A get waits inside each
shard on an asyncio.Condition that puts notify (event-driven), and the client waits on every
shard's reply with the remaining timeout; every blocking `ray.get` has a timeout.

Data crosses processes as numpy buffers plus a JSON header (`storage.wire`), never as pickled
Python objects. A put is placed in the object store once, and each involved shard copies out
the rows it owns (zero-copy reads on one node; across nodes each involved shard pulls the batch).
A put touching one shard is one call; one spanning shards is two-phase (every shard validates
and stages, then all commit), so a failed put changes nothing. A concurrent put to the same keys
and fields fails fast with ConflictError instead of deadlocking. Only this module imports Ray (the shard class in `storage.ray_shard` does not).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError
from tensordict import TensorDict

from storage.base import (
    Fields,
    Store,
    check_keys,
    check_partition_id,
    check_select,
    check_specs,
    timeout_error,
)
from storage.columnar import BoolArray, Column, IntArray, concat, empty_column, gather
from storage.convert import to_columns, to_tensordict
from storage.errors import SchemaError, StoreError, StoreTimeout
from storage.factory import open_store
from storage.meta import BatchMeta
from storage.partition import PartitionDump
from storage.ray_shard import StoreShard, actor_name, dump_from, dump_header, shard_of
from storage.schema import FieldSpec, registered_spec
from storage.wire import keys_blob, message, open_message, pack_columns, unpack_columns

DEFAULT_SHARDS = 2
_GRACE_S = 10.0  # how much longer than a shard's own wait the client waits for its reply
_MIN_RPC_S = 30.0  # the least any other shard call is given, even with a short default_timeout


class RayStore(Store):
    """A client of the shards of one named store (create with `open_store("ray://NAME")`)."""

    def __init__(
        self, name: str, namespace: str, shards: list[Any], owned: list[bool], timeout: float
    ) -> None:
        url = f"ray://{name}?shards={len(shards)}&namespace={namespace}&timeout={timeout:g}"
        super().__init__(url, timeout)
        self.name = name
        self._shards = shards
        self._owned = owned
        self._rpc_timeout = max(timeout, _MIN_RPC_S)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Unpickles as a new handle attached by URL (which never kills the shards on close)."""
        return (open_store, (self.url,))

    @classmethod
    def open(cls, name: str, shards: int, namespace: str, timeout: float) -> RayStore:
        """Attaches to the named store's shards, creating those that do not exist yet."""
        if not ray.is_initialized():
            raise StoreError(
                "ray:// stores live on the current Ray instance: call ray.init(...) (or infra's "
                "cluster attach) before open_store"
            )
        name = name.strip("/") or f"store-{uuid.uuid4().hex[:12]}"
        token = uuid.uuid4().hex
        actor = ray.remote(StoreShard)

        def start(index: int, total: int) -> Any:
            options = {"name": actor_name(name, index), "namespace": namespace}
            return actor.options(**options, get_if_exists=True, num_cpus=0, max_restarts=0).remote(
                name, index, total, token
            )

        first = start(0, shards or DEFAULT_SHARDS)
        rpc_timeout = max(timeout, _MIN_RPC_S)
        config = json.loads(ray.get(first.config.remote(), timeout=rpc_timeout))
        total = int(config["shards"])
        if shards and shards != total:
            raise StoreError(
                f"store {name!r} already exists with {total} shards, not {shards}; open it "
                f"without ?shards= or with shards={total}"
            )
        handles = [first] + [start(i, total) for i in range(1, total)]
        configs = [config] + [
            json.loads(c)
            for c in ray.get([h.config.remote() for h in handles[1:]], timeout=rpc_timeout)
        ]
        return cls(name, namespace, handles, [c["owner"] == token for c in configs], timeout)

    # -- calls ------------------------------------------------------------------------------------

    def _replies(
        self, refs: Sequence[Any], timeout: float, what: str, partition_id: str
    ) -> list[Any]:
        """`ray.get` with a timeout; Ray failures become typed store errors."""
        if self._closed:
            raise StoreError(f"{self.url} is closed; open the store again")
        start = time.monotonic()
        try:
            return list(ray.get(list(refs), timeout=timeout))
        except GetTimeoutError as exc:
            raise StoreTimeout(
                partition_id, [], [], time.monotonic() - start, f"{what}: a shard did not answer"
            ) from exc
        except RayError as exc:
            raise StoreError(
                f"{self.url}: {what} failed in a shard: {exc}; reopen the store"
            ) from exc

    def _route(self, keys: Sequence[str]) -> dict[int, IntArray]:
        """Positions of the keys owned by each involved shard (shard 0 answers for no keys)."""
        if not keys:
            return {0: np.zeros(0, np.int64)}
        owner = shard_of(keys, len(self._shards))
        routes = {s: np.flatnonzero(owner == s) for s in range(len(self._shards))}
        return {s: rows for s, rows in routes.items() if rows.size}

    def _two_phase(
        self, stage: Callable[[int, str], Any], shards: Sequence[int], partition_id: str
    ) -> None:
        """Stages a change on every shard, then commits it, or aborts it everywhere."""
        txn = uuid.uuid4().hex
        replies = self._replies(
            [stage(s, txn) for s in shards], self._rpc_timeout, "prepare", partition_id
        )
        errors = []
        for reply in replies:
            try:
                open_message(reply)
            except StoreError as exc:
                errors.append(exc)
        if errors:
            self._replies(
                [self._shards[s].abort.remote(txn) for s in shards],
                self._rpc_timeout,
                "abort",
                partition_id,
            )
            raise errors[0]
        commits = [self._shards[s].commit.remote(txn) for s in shards]
        for reply in self._replies(commits, self._rpc_timeout, "commit", partition_id):
            open_message(reply)

    # -- the verbs ---------------------------------------------------------------------------------

    def kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Fields, *, overwrite: bool = False
    ) -> BatchMeta:
        check_partition_id(partition_id)
        keys = check_keys(keys, partition_id)
        columns = to_columns(fields, len(keys), partition_id, registered_spec)
        arrays: list[Any] = []
        payload = ray.put(message({"fields": pack_columns(columns, arrays)}, arrays))
        routes = self._route(keys)
        shard_keys = {s: keys_blob([keys[i] for i in rows.tolist()]) for s, rows in routes.items()}
        if len(routes) == 1:
            ((s, rows),) = routes.items()
            ref = self._shards[s].put.remote(partition_id, shard_keys[s], rows, payload, overwrite)
            open_message(self._replies([ref], self._rpc_timeout, "put", partition_id)[0])
        else:
            ttl = self._rpc_timeout * 2

            def stage(s: int, txn: str) -> Any:
                args = (partition_id, shard_keys[s], routes[s], payload, overwrite, ttl)
                return self._shards[s].prepare.remote(txn, *args)

            self._two_phase(stage, list(routes), partition_id)
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
        fields = json.dumps(check_select(select_fields, partition_id)).encode()
        budget = self.resolve_timeout(timeout)
        start = time.monotonic()
        routes = self._route(keys)
        refs = {
            s: self._shards[s].get.remote(
                partition_id, keys_blob([keys[i] for i in rows.tolist()]), fields, budget
            )
            for s, rows in routes.items()
        }
        replies = {}
        for s, ref in refs.items():
            remaining = max(0.0, budget - (time.monotonic() - start)) + _GRACE_S
            replies[s] = open_message(self._replies([ref], remaining, "get", partition_id)[0])
        missing = self._missing(len(keys), routes, replies)
        if missing:
            raise timeout_error(partition_id, keys, missing, time.monotonic() - start)
        return to_tensordict(self._merge(partition_id, len(keys), routes, replies), len(keys))

    @staticmethod
    def _missing(
        n_keys: int,
        routes: Mapping[int, IntArray],
        replies: Mapping[int, tuple[dict[str, Any], list[Any]]],
    ) -> dict[str, BoolArray]:
        missing: dict[str, BoolArray] = {}
        for s, (header, _) in replies.items():
            for name, rows in header.get("missing", {}).items():
                mask = missing.setdefault(name, np.zeros(n_keys, np.bool_))
                mask[routes[s][np.asarray(rows, np.int64)]] = True
        return missing

    @staticmethod
    def _merge(
        partition_id: str,
        n_keys: int,
        routes: Mapping[int, IntArray],
        replies: Mapping[int, tuple[dict[str, Any], list[Any]]],
    ) -> dict[str, Column]:
        """The shards' rows back in request order (one gather per field: a fresh copy)."""
        parts = {
            s: unpack_columns(header["fields"], arrays) for s, (header, arrays) in replies.items()
        }
        order = list(parts)
        names = [n for n in parts[order[0]] if all(n in parts[s] for s in order)]
        chunk_ids = np.zeros(n_keys, np.int64)
        rows = np.zeros(n_keys, np.int64)
        for j, s in enumerate(order):
            chunk_ids[routes[s]] = j
            rows[routes[s]] = np.arange(routes[s].size)
        merged = {}
        for name in names:
            chunks = [parts[s][name] for s in order]
            if any(chunk.spec != chunks[0].spec for chunk in chunks):
                specs = sorted({chunk.spec.describe() for chunk in chunks})
                raise SchemaError(
                    f"partition {partition_id!r}, field {name!r}: shards disagree on its spec: {specs}"
                )
            merged[name] = gather(chunks, chunk_ids, rows)
        return merged

    def kv_list(self, partition_id: str) -> dict[str, list[str]]:
        refs = [shard.listing.remote(partition_id) for shard in self._shards]
        listing: dict[str, list[str]] = {}
        for reply in self._replies(refs, self._rpc_timeout, "kv_list", partition_id):
            listing.update(json.loads(reply))
        return listing

    def kv_clear(self, partition_id: str, keys: Sequence[str] | None = None) -> int:
        check_partition_id(partition_id)
        if keys is None:
            refs = [shard.clear.remote(partition_id, None) for shard in self._shards]
        else:
            keys = check_keys(keys, partition_id)
            routes = self._route(keys)
            refs = [
                self._shards[s].clear.remote(
                    partition_id, keys_blob([keys[i] for i in rows.tolist()])
                )
                for s, rows in routes.items()
            ]
        return sum(self._replies(refs, self._rpc_timeout, "kv_clear", partition_id))

    def declare(self, partition_id: str, specs: Mapping[str, FieldSpec]) -> None:
        check_partition_id(partition_id)
        blob = json.dumps(
            {n: s.to_json() for n, s in check_specs(specs, partition_id).items()}
        ).encode()
        ttl = self._rpc_timeout * 2

        def stage(s: int, txn: str) -> Any:
            return self._shards[s].stage_declare.remote(txn, partition_id, blob, ttl)

        self._two_phase(stage, range(len(self._shards)), partition_id)

    def partitions(self) -> list[str]:
        refs = [shard.partitions.remote() for shard in self._shards]
        seen: dict[str, None] = {}
        for reply in self._replies(refs, self._rpc_timeout, "partitions", ""):
            seen.update(dict.fromkeys(json.loads(reply)))
        return list(seen)

    def _export(self, partition_id: str) -> PartitionDump:
        refs = [shard.export.remote(partition_id) for shard in self._shards]
        dumps = []
        for reply in self._replies(refs, self._rpc_timeout, "save", partition_id):
            header, arrays = open_message(reply)
            if header["exists"]:
                dumps.append(dump_from(header["dump"], arrays))
        if not dumps:
            raise StoreError(f"partition {partition_id!r} does not exist in {self.url}")
        return _concat_dumps(dumps)

    def _import(self, dumps: Sequence[PartitionDump], replace: bool) -> None:
        ttl = self._rpc_timeout * 2
        payloads = [self._import_payload(dumps, s) for s in range(len(self._shards))]

        def stage(s: int, txn: str) -> Any:
            return self._shards[s].stage_import.remote(txn, payloads[s], replace, ttl)

        self._two_phase(stage, range(len(self._shards)), ",".join(d.partition_id for d in dumps))

    def _import_payload(self, dumps: Sequence[PartitionDump], shard: int) -> Any:
        arrays: list[Any] = []
        headers = [dump_header(_shard_part(d, shard, len(self._shards)), arrays) for d in dumps]
        return ray.put(message({"dumps": headers}, arrays))

    def close(self) -> None:
        """Kills the shards this handle created; handles that attached leave them running."""
        if self._closed:
            return
        self._closed = True
        for shard, owned in zip(self._shards, self._owned):
            if owned:
                ray.kill(shard, no_restart=True)


def _shard_part(dump: PartitionDump, shard: int, n_shards: int) -> PartitionDump:
    """The keys of a partition that live on one shard (every shard gets the specs)."""
    mine = shard_of(dump.keys, n_shards) == shard
    keys = [key for key, keep in zip(dump.keys, mine.tolist()) if keep]
    present, columns = {}, {}
    for name, column in dump.columns.items():
        row_of_key = np.cumsum(dump.present[name]) - 1
        rows = row_of_key[mine & dump.present[name]]
        present[name] = dump.present[name][mine]
        columns[name] = column.take(rows)
    return PartitionDump(dump.partition_id, keys, dump.specs, present, columns)


def _concat_dumps(dumps: Sequence[PartitionDump]) -> PartitionDump:
    """One partition from the shards' parts (keys are disjoint across shards)."""
    specs: dict[str, FieldSpec] = {}
    names: dict[str, None] = {}
    for dump in dumps:
        specs.update(dump.specs)
        names.update(dict.fromkeys(dump.columns))
    keys = [key for dump in dumps for key in dump.keys]
    present, columns = {}, {}
    for name in names:
        masks = [d.present.get(name, np.zeros(len(d.keys), np.bool_)) for d in dumps]
        present[name] = np.concatenate(masks)
        parts = [d.columns[name] for d in dumps if name in d.columns and d.columns[name].n_rows]
        columns[name] = concat(parts) if parts else empty_column(specs[name])
    return PartitionDump(dumps[0].partition_id, keys, specs, present, columns)
