"""The Ray backend (`ray://NAME?shards=N&namespace=NS&transport=auto`): partitions over Ray actors.

Key k lives on shard `crc32(k) % N`. Each shard is an async Ray actor named
`ppoflow-store/NAME/shard-i` in namespace NS, holding `Partition`s exactly like the embedded
store; any process that opens the same URL reaches the same shards. Ray finds and owns the shards;
how data reaches them depends on where they run (`storage.ray_links`):

- same node (`transport=auto`, the default, or `shm` to insist): requests are JSON frames on the
  shard's Unix socket and column bytes cross through a shared-memory arena reused by every
  request of a connection: a put is one copy into the arena and one into the shard, a get one copy
  into the arena and one into fresh client arrays; no Ray call is on the path;
- another node, or `transport=object_store`: Ray actor calls; a put's batch is placed in the
  object store once and each involved shard copies out its rows, a get's rows come back through it.

A shard that dies takes its rows with it: any call that needed it raises ShardLost naming the
shard, the partition and the keys, and `recover()` makes the lost shards anew, empty, under the
same names (the surviving shards keep their rows).

Either way data crosses processes as numpy buffers plus JSON headers (`storage.wire`), never as
pickled Python objects. A put touching one shard is one request; one spanning shards is two-phase
(every shard validates and stages, then all commit), so a failed put changes nothing, and a
concurrent put to the same keys and fields fails fast with ConflictError instead of deadlocking.
A field's spec holds partition-wide: a two-phase put is prepared on every shard of the store,
those without its keys checking and fixing the specs only; a one-shard put is applied at once
only when its fields' specs are already fixed on every shard, and otherwise comes back unapplied
and goes through every shard (`storage.ray_shard`).
A get waits inside each shard on an asyncio.Condition that puts notify (event-driven); the client
waits on every reply with the remaining timeout, and every wait is bounded. Only this module and
`storage.ray_links` import Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from tensordict import TensorDict

from storage import shm
from storage.base import (
    Fields,
    Store,
    check_keys,
    check_partition_id,
    check_select,
    check_specs,
    timeout_error,
)
from storage.channel import ChannelClosed
from storage.columnar import BoolArray, Column, IntArray, concat, empty_column, gather
from storage.convert import SpecLookup, to_columns, to_tensordict
from storage.errors import SchemaError, ShardLost, StoreError, StoreTimeout
from storage.meta import BatchMeta
from storage.partition import PartitionDump
from storage.ray_links import Link, LocalLink, Outgoing, Pending, RayLink, RayPending, Reply, pick
from storage.ray_shard import StoreShard, actor_name, dump_from, dump_header, shard_of
from storage.schema import FieldSpec, registered_spec
from storage.urls import parse_store_url
from storage.wire import keys_blob, message, open_message, unpack_columns

DEFAULT_SHARDS = 2
_GRACE_S = 10.0  # how much longer than a shard's own wait the client waits for its reply
_MIN_RPC_S = 30.0  # the least any other shard call is given, even with a short default_timeout


def _url(name: str, shards: int, namespace: str, timeout: float, transport: str) -> str:
    url = f"ray://{name}?shards={shards}&namespace={namespace}&timeout={timeout:g}"
    return url if transport == "auto" else f"{url}&transport={transport}"


def _start_shard(name: str, namespace: str, index: int, total: int, token: str) -> Any:
    """The handle of shard `index` of store `name`, created (owned by `token`) if it is not running."""
    options = {"name": actor_name(name, index), "namespace": namespace}
    actor = ray.remote(StoreShard).options(
        **options, get_if_exists=True, num_cpus=0, max_restarts=0
    )
    return actor.remote(name, index, total, token)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _proc_state(pid) != "Z"  # a zombie has exited; only its parent has not reaped it


def _proc_state(pid: int) -> str:
    """The state letter of process ``pid`` ("Z" for a zombie), "" when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _link(actor: Any, config: Mapping[str, Any], transport: str, url: str, timeout: float) -> Link:
    """The local path to a shard when it runs on this node and answers there, else Ray calls."""
    index = int(config["index"])
    if transport == "object_store":
        return RayLink(actor, url, index)
    reason = "it runs on another node"
    if not shm.available():
        reason = "this platform lacks memfd or descriptor passing"
    elif config.get("node") == ray.get_runtime_context().get_node_id():
        reason = "it has no local socket"
        if config.get("socket"):
            try:
                return LocalLink(config["socket"], url, timeout, index)
            except (OSError, ChannelClosed) as exc:
                reason = f"its local socket failed: {exc!r}"
    if transport == "shm":
        raise StoreError(
            f"{url}: shard {config['index']} cannot be reached through shared memory ({reason}); "
            "open the store with transport=auto or transport=object_store"
        )
    return RayLink(actor, url, index)


class RayStore(Store):
    """A client of the shards of one named store (create with `open_store("ray://NAME")`)."""

    def __init__(
        self,
        name: str,
        url: str,
        shards: list[Any],
        owned: list[bool],
        links: list[Link],
        timeout: float,
        *,
        namespace: str,
        transport: str,
        token: str,
    ) -> None:
        super().__init__(url, timeout)
        self.name = name
        self._shards = shards
        self._owned = owned
        self._links = links
        self._rpc_timeout = max(timeout, _MIN_RPC_S)
        self._namespace, self._transport, self._token = namespace, transport, token

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Unpickles as a new handle attached by URL (which never kills the shards on close)."""
        return (_reopen, (self.url,))

    @property
    def transports(self) -> list[str]:
        """How each shard is reached from this handle: "shm" or "object_store"."""
        return [link.transport for link in self._links]

    @classmethod
    def open(
        cls, name: str, shards: int, namespace: str, timeout: float, transport: str = "auto"
    ) -> RayStore:
        """Attaches to the named store's shards, creating those that do not exist yet."""
        if not ray.is_initialized():
            raise StoreError(
                "ray:// stores live on the current Ray instance: call ray.init(...) (or infra's "
                "cluster attach) before open_store"
            )
        name = name.strip("/") or f"store-{uuid.uuid4().hex[:12]}"
        token = uuid.uuid4().hex

        def start(index: int, total: int) -> Any:
            return _start_shard(name, namespace, index, total, token)

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
        url = _url(name, total, namespace, timeout, transport)
        owned = [c["owner"] == token for c in configs]
        links: list[Link] = []
        try:
            for handle, shard_config in zip(handles, configs):
                links.append(_link(handle, shard_config, transport, url, rpc_timeout))
        except StoreError:  # transport=shm and a shard is out of reach: undo this open
            for link in links:
                link.close()
            for handle, mine in zip(handles, owned):
                if mine:
                    ray.kill(handle, no_restart=True)
            raise
        return cls(
            name,
            url,
            handles,
            owned,
            links,
            timeout,
            namespace=namespace,
            transport=transport,
            token=token,
        )

    # -- lost shards -------------------------------------------------------------------------------

    def _alive(self, index: int) -> bool:
        try:
            ray.get(self._shards[index].config.remote(), timeout=self._rpc_timeout)
        except RayActorError:
            return False
        except GetTimeoutError as exc:
            raise StoreTimeout(
                "", [], [], self._rpc_timeout, f"shard {index} did not answer"
            ) from exc
        return True

    def recover(self) -> list[int]:
        """Makes every shard that is gone anew (empty, same name, owned by this handle) and
        reconnects to it; returns their indices. The rows the lost shards held are gone, so
        partitions that had rows there are incomplete: clear them and produce them again."""
        self._check_open()
        lost = [i for i in range(len(self._shards)) if not self._alive(i)]
        for i in lost:
            self._links[i].close()
            ray.kill(self._shards[i], no_restart=True)  # lets Ray free the dead shard's name
            handle, config = self._restart_shard(i)
            self._shards[i], self._owned[i] = handle, config["owner"] == self._token
            self._links[i] = _link(handle, config, self._transport, self.url, self._rpc_timeout)
        return lost

    def _restart_shard(self, index: int) -> tuple[Any, dict[str, Any]]:
        """A new shard ``index`` and its config (Ray frees a dead actor's name shortly after
        its death: until then the name still finds the dead one)."""
        deadline = time.monotonic() + self._rpc_timeout
        while True:
            handle = _start_shard(self.name, self._namespace, index, len(self._shards), self._token)
            try:
                reply = ray.get(handle.config.remote(), timeout=self._rpc_timeout)
                return handle, json.loads(reply)
            except RayActorError:
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"{self.url}: shard {index} could not be made anew: Ray still holds the "
                        "name of the dead one"
                    ) from None
                time.sleep(0.1)

    def kill_shard(self, index: int) -> None:
        """Kills shard ``index`` and waits until it is gone: a lost shard, to rehearse recovery
        (the ``faults`` action ``kill_store_shard``). On this node its process gets SIGKILL (a
        crash); elsewhere Ray kills it."""
        self._check_open()
        handle = self._shards[index]
        config = json.loads(ray.get(handle.config.remote(), timeout=self._rpc_timeout))
        local = config.get("node") == ray.get_runtime_context().get_node_id()
        if local:
            os.kill(int(config["pid"]), signal.SIGKILL)
        else:
            ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + self._rpc_timeout
        while self._alive(index) or (local and _running(int(config["pid"]))):
            if time.monotonic() > deadline:
                raise StoreError(f"{self.url}: shard {index} still runs after it was killed")
            time.sleep(0.05)

    # -- calls ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url} is closed; open the store again")

    def _replies(
        self,
        refs: Sequence[Any],
        timeout: float,
        what: str,
        partition_id: str,
        shards: Sequence[int] | None = None,
    ) -> list[Any]:
        """`ray.get` of plain actor calls (to `shards`, default all in order) with a timeout; Ray
        failures become typed store errors."""
        self._check_open()
        start = time.monotonic()
        try:
            return list(ray.get(list(refs), timeout=timeout))
        except GetTimeoutError as exc:
            raise StoreTimeout(
                partition_id, [], [], time.monotonic() - start, f"{what}: a shard did not answer"
            ) from exc
        except RayActorError as exc:
            dead = self._dead(list(refs), list(range(len(refs))) if shards is None else shards)
            detail = f"{what}: {type(exc).__name__}"
            raise ShardLost(self.url, dead, partition_id, [], detail) from exc
        except RayError as exc:
            raise StoreError(
                f"{self.url}: {what} failed in a shard: {exc}; reopen the store"
            ) from exc

    @staticmethod
    def _dead(refs: Sequence[Any], shards: Sequence[int]) -> int | None:
        """The shard of the first reference that failed because its actor is gone."""
        for ref, shard in zip(refs, shards):
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                return shard
            except RayError:
                continue
        return None

    def _settle(self, pending: Mapping[int, Pending], partition_id: str) -> None:
        """Waits for every reply (each within the call timeout); raises the first failure."""
        errors = []
        for request in pending.values():
            try:
                request.result(self._rpc_timeout, partition_id).release()
            except StoreError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _route(self, keys: Sequence[str]) -> dict[int, IntArray]:
        """Positions of the keys owned by each involved shard (shard 0 answers for no keys)."""
        if not keys or len(self._shards) == 1:
            return {0: np.arange(len(keys), dtype=np.int64)}
        owner = shard_of(keys, len(self._shards))
        routes = {s: np.flatnonzero(owner == s) for s in range(len(self._shards))}
        return {s: rows for s, rows in routes.items() if rows.size}

    @staticmethod
    def _fan_out(start: Callable[[int], Pending], shards: Iterable[int]) -> dict[int, Pending]:
        """Starts a request on every shard (cancelling those started if one cannot be)."""
        pending: dict[int, Pending] = {}
        try:
            for s in shards:
                pending[s] = start(s)
        except BaseException:
            for request in pending.values():
                request.cancel()
            raise
        return pending

    def _two_phase(
        self, stage: Callable[[int, str], Pending], shards: Sequence[int], partition_id: str
    ) -> None:
        """Stages a change on every shard, then commits it, or aborts it everywhere."""
        txn = uuid.uuid4().hex
        try:
            self._settle(self._fan_out(lambda s: stage(s, txn), shards), partition_id)
        except StoreError:
            # best effort: a shard that cannot be reached drops the stage when it expires
            with contextlib.suppress(StoreError):
                aborts = self._fan_out(lambda s: self._links[s].abort(txn), shards)
                self._settle(aborts, partition_id)
            raise
        commits = self._fan_out(lambda s: self._links[s].commit(txn), shards)
        self._settle(commits, partition_id)

    # -- the verbs ---------------------------------------------------------------------------------

    def kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Fields, *, overwrite: bool = False
    ) -> BatchMeta:
        check_partition_id(partition_id)
        keys = check_keys(keys, partition_id)
        columns = to_columns(fields, len(keys), partition_id, self._expected(partition_id, keys))
        self._check_open()
        meta = BatchMeta(partition_id, tuple(keys), tuple(columns))
        n_shards = len(self._shards)
        out = Outgoing(partition_id, keys, columns, self._route(keys), overwrite, n_shards > 1)
        if len(out.routes) == 1:
            ((s, _),) = out.routes.items()
            reply = self._links[s].put(out, s).result(self._rpc_timeout, partition_id)
            reply.release()
            if not reply.header.get("spread"):
                return meta
        # every shard prepares it: those without its keys check and fix the fields' specs
        nothing = np.zeros(0, np.int64)
        out.routes = {s: out.routes.get(s, nothing) for s in range(n_shards)}
        ttl = self._rpc_timeout * 2

        def stage(s: int, txn: str) -> Pending:
            return self._links[s].prepare(txn, out, s, ttl)

        self._two_phase(stage, list(out.routes), partition_id)
        return meta

    def _expected(self, partition_id: str, keys: Sequence[str]) -> SpecLookup:
        """Where a put's values find the spec they must have.

        Rows say their spec, but zero rows may not (`[]`): for a put of no keys, the partition's
        specs are read from shard 0 (which holds every spec fixed in the partition).
        """
        if keys:
            return registered_spec
        (reply,) = self._replies(
            [self._shards[0].specs.remote(partition_id)], self._rpc_timeout, "put", partition_id
        )
        fixed = {name: FieldSpec.from_json(spec) for name, spec in json.loads(reply).items()}
        return lambda name: fixed.get(name) or registered_spec(name)

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
        self._check_open()
        start = time.monotonic()
        routes = self._route(keys)
        pending = self._fan_out(
            lambda s: self._links[s].get(partition_id, pick(keys, routes[s]), fields, budget),
            routes,
        )
        replies: dict[int, Reply] = {}
        try:
            for s, request in pending.items():
                remaining = max(0.0, budget - (time.monotonic() - start)) + _GRACE_S
                replies[s] = request.result(remaining, partition_id)
            missing = self._missing(len(keys), routes, replies)
            if missing:
                raise timeout_error(partition_id, keys, missing, time.monotonic() - start)
            columns = self._merge(partition_id, len(keys), routes, replies)
        finally:
            for s, request in pending.items():
                if s in replies:
                    replies[s].release()
                else:
                    request.cancel()
        return to_tensordict(columns, len(keys))

    @staticmethod
    def _missing(
        n_keys: int, routes: Mapping[int, IntArray], replies: Mapping[int, Reply]
    ) -> dict[str, BoolArray]:
        missing: dict[str, BoolArray] = {}
        for s, reply in replies.items():
            for name, rows in reply.header.get("missing", {}).items():
                mask = missing.setdefault(name, np.zeros(n_keys, np.bool_))
                mask[routes[s][np.asarray(rows, np.int64)]] = True
        return missing

    @staticmethod
    def _merge(
        partition_id: str,
        n_keys: int,
        routes: Mapping[int, IntArray],
        replies: Mapping[int, Reply],
    ) -> dict[str, Column]:
        """The shards' rows in request order, as fresh copies (replies view arenas or Ray)."""
        parts = {s: unpack_columns(r.header["fields"], r.arrays) for s, r in replies.items()}
        order = list(parts)
        names = [n for n in parts[order[0]] if all(n in parts[s] for s in order)]
        if len(order) == 1 and routes[order[0]].size == n_keys:  # one shard, already in order
            return {name: parts[order[0]][name].copy() for name in names}
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
        check_partition_id(partition_id)
        refs = [shard.listing.remote(partition_id) for shard in self._shards]
        listing: dict[str, list[str]] = {}
        for reply in self._replies(refs, self._rpc_timeout, "kv_list", partition_id):
            listing.update(json.loads(reply))
        return listing

    def kv_clear(self, partition_id: str, keys: Sequence[str] | None = None) -> int:
        check_partition_id(partition_id)
        shards: list[int] | None = None
        if keys is None:
            refs = [shard.clear.remote(partition_id, None) for shard in self._shards]
        else:
            keys = check_keys(keys, partition_id)
            routes = self._route(keys)
            refs = [
                self._shards[s].clear.remote(partition_id, keys_blob(pick(keys, rows)))
                for s, rows in routes.items()
            ]
            shards = list(routes)
        return sum(self._replies(refs, self._rpc_timeout, "kv_clear", partition_id, shards))

    def declare(self, partition_id: str, specs: Mapping[str, FieldSpec]) -> None:
        check_partition_id(partition_id)
        blob = json.dumps(
            {n: s.to_json() for n, s in check_specs(specs, partition_id).items()}
        ).encode()
        ttl = self._rpc_timeout * 2

        def stage(s: int, txn: str) -> Pending:
            ref = self._shards[s].stage_declare.remote(txn, partition_id, blob, ttl)
            return RayPending(ref, "declare", self.url, s)

        self._check_open()
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
        self._check_open()
        ttl = self._rpc_timeout * 2
        payloads = [self._import_payload(dumps, s) for s in range(len(self._shards))]

        def stage(s: int, txn: str) -> Pending:
            ref = self._shards[s].stage_import.remote(txn, payloads[s], replace, ttl)
            return RayPending(ref, "load", self.url, s)

        self._two_phase(stage, range(len(self._shards)), ",".join(d.partition_id for d in dumps))

    def _import_payload(self, dumps: Sequence[PartitionDump], shard: int) -> Any:
        arrays: list[Any] = []
        headers = [dump_header(_shard_part(d, shard, len(self._shards)), arrays) for d in dumps]
        return ray.put(message({"dumps": headers}, arrays))

    def close(self) -> None:
        """Closes this handle's connections and kills the shards it created (attached handles
        leave them running)."""
        if self._closed:
            return
        self._closed = True
        for link in self._links:
            link.close()
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


def _reopen(url: str) -> RayStore:
    """A handle attached to the shards a `ray://` URL names (how a pickled handle comes back)."""
    parsed = parse_store_url(url)
    return RayStore.open(
        parsed.name, parsed.shards, parsed.namespace, parsed.timeout, parsed.transport
    )
