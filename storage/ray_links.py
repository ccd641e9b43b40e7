"""How the Ray store's client reaches one shard: `LocalLink` on its node, `RayLink` from anywhere.

- `LocalLink`: each request is a small JSON frame on the shard's Unix socket (`storage.channel`)
  and column bytes go through the connection's shared-memory arena (`storage.shm`). A put is one
  copy into the arena and one out of it into the shard's own arrays; a get is one copy into the
  arena and one out of it into the client's fresh arrays. No Ray call, no object store, no
  pickling. Connections are pooled (one per concurrent caller, up to 4 kept idle), each with its
  own arena, which keeps the size of the largest message it carried (a connection whose arena
  grew past 256 MiB is closed after use instead of kept).
- `RayLink`: Ray actor calls whose data are `storage.wire` messages in Ray's object store; a put's
  batch is placed there once and each involved shard copies out its rows. Used for shards on other
  nodes, where the socket cannot be reached, or when the URL says `transport=object_store`.

Both start a request and return a `Pending`, so the client fans out to every shard before it
waits. `Pending.result` raises a shard that is gone (its actor dead, its socket closed) as ShardLost
naming the shard, partition and keys, other transport failures as StoreTimeout or StoreError, and
error replies as their typed error; a `Reply`'s arrays may view an arena, so copy them before `release`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from storage.channel import ChannelClosed, Connection, Header
from storage.columnar import AnyArray, Column, IntArray
from storage.errors import ShardLost, StoreError, StoreTimeout
from storage.shm import ArenaError
from storage.wire import check_header, keys_blob, message, open_message, pack_columns

_IDLE = 4  # idle connections a local link keeps open (each holds an arena)
_KEEP_ARENA = 256 << 20  # a connection whose arena grew past this is closed, not kept idle


def no_answer(partition_id: str, what: str, start: float) -> StoreTimeout:
    return StoreTimeout(
        partition_id, [], [], time.monotonic() - start, f"{what}: a shard did not answer"
    )


def lost(url: str, what: str, exc: BaseException) -> StoreError:
    return StoreError(f"{url}: {what} failed in a shard: {exc}; reopen the store")


def gone(
    url: str, shard: int, what: str, exc: BaseException, partition_id: str, keys: Sequence[str]
) -> ShardLost:
    """The shard's actor or socket is gone: the rows of `keys` it held are lost."""
    return ShardLost(url, shard, partition_id, keys, f"{what}: {type(exc).__name__}: {exc}")


def pick(keys: list[str], rows: IntArray) -> list[str]:
    """The keys at `rows` (all of them, as they are, when `rows` covers every key)."""
    return keys if rows.size == len(keys) else [keys[i] for i in rows.tolist()]


@dataclass
class Outgoing:
    """One put as the links send it: the batch, the rows of each shard, and its Ray copies.

    A shard whose route is empty gets the fields as columns of zero rows (their specs only).
    `solo`: a one-shard put to a store of several shards, which the shard applies only when
    every field's spec is already fixed on every shard (else it answers `{"spread": true}`).
    """

    partition_id: str
    keys: list[str]
    columns: dict[str, Column]
    routes: dict[int, IntArray]  # shard -> positions of its keys (sorted; maybe none)
    overwrite: bool
    solo: bool = False
    _payload: Any = field(default=None, repr=False)
    _no_rows: Any = field(default=None, repr=False)

    def columns_of(self, shard: int) -> dict[str, Column]:
        rows = self.routes[shard]
        if rows.size == len(self.keys):
            return self.columns
        return {name: column.take(rows) for name, column in self.columns.items()}

    def payload(self, shard: int) -> Any:
        """What a shard reads its rows from in Ray's object store: the whole batch, placed once
        for every shard that has rows in it, or the fields' zero-row columns."""
        if self.routes[shard].size == 0 and self.keys:
            if self._no_rows is None:
                self._no_rows = self._place(self.columns_of(shard))
            return self._no_rows
        if self._payload is None:
            self._payload = self._place(self.columns)
        return self._payload

    @staticmethod
    def _place(columns: dict[str, Column]) -> Any:
        arrays: list[AnyArray] = []
        header = {"fields": pack_columns(columns, arrays)}
        return ray.put(message(header, arrays))


@dataclass
class Reply:
    """A shard's answer; its arrays may view a connection's arena until `release`."""

    header: Header
    arrays: list[AnyArray] = field(default_factory=list)
    on_release: Callable[[], None] | None = None

    def release(self) -> None:
        """Hands the connection back (once): the arrays must not be read after this."""
        done, self.on_release = self.on_release, None
        if done is not None:
            done()


class Pending(Protocol):
    def result(self, timeout: float, partition_id: str) -> Reply: ...

    def cancel(self) -> None: ...


class Link(Protocol):
    transport: str

    def put(self, out: Outgoing, shard: int) -> Pending: ...

    def prepare(self, txn: str, out: Outgoing, shard: int, ttl: float) -> Pending: ...

    def commit(self, txn: str) -> Pending: ...

    def abort(self, txn: str) -> Pending: ...

    def get(
        self, partition_id: str, keys: list[str], fields: list[str] | None, timeout: float
    ) -> Pending: ...

    def close(self) -> None: ...


# -- through Ray -------------------------------------------------------------------------------


class RayPending:
    """A Ray actor call to shard `shard` whose result is a `storage.wire` message (or None);
    `keys` are those the call is about (named when the shard is gone)."""

    def __init__(self, ref: Any, what: str, url: str, shard: int, keys: Sequence[str] = ()) -> None:
        self._ref, self._what, self._url = ref, what, url
        self._shard, self._keys = shard, keys

    def result(self, timeout: float, partition_id: str) -> Reply:
        start = time.monotonic()
        try:
            reply = ray.get(self._ref, timeout=timeout)
        except GetTimeoutError as exc:
            raise no_answer(partition_id, self._what, start) from exc
        except RayActorError as exc:
            raise gone(self._url, self._shard, self._what, exc, partition_id, self._keys) from exc
        except RayError as exc:
            raise lost(self._url, self._what, exc) from exc
        if reply is None:
            return Reply({})
        header, arrays = open_message(reply)
        return Reply(header, arrays)

    def cancel(self) -> None:
        """Nothing to undo: a late reply is dropped with its reference."""


class RayLink:
    """A shard reached by Ray actor calls, its data through the object store."""

    transport = "object_store"

    def __init__(self, actor: Any, url: str, index: int) -> None:
        self.actor, self._url, self.index = actor, url, index

    def _call(self, what: str, ref: Any, keys: Sequence[str] = ()) -> RayPending:
        return RayPending(ref, what, self._url, self.index, keys)

    def put(self, out: Outgoing, shard: int) -> Pending:
        rows = out.routes[shard]
        keys = pick(out.keys, rows)
        payload = out.payload(shard)
        ref = self.actor.put.remote(
            out.partition_id, keys_blob(keys), rows, payload, out.overwrite, out.solo
        )
        return self._call("put", ref, keys)

    def prepare(self, txn: str, out: Outgoing, shard: int, ttl: float) -> Pending:
        rows = out.routes[shard]
        keys = pick(out.keys, rows)
        args = (out.partition_id, keys_blob(keys), rows, out.payload(shard))
        ref = self.actor.prepare.remote(txn, *args, out.overwrite, ttl)
        return self._call("prepare", ref, keys)

    def commit(self, txn: str) -> Pending:
        return self._call("commit", self.actor.commit.remote(txn))

    def abort(self, txn: str) -> Pending:
        return self._call("abort", self.actor.abort.remote(txn))

    def get(
        self, partition_id: str, keys: list[str], fields: list[str] | None, timeout: float
    ) -> Pending:
        names = json.dumps(fields).encode()
        ref = self.actor.get.remote(partition_id, keys_blob(keys), names, timeout)
        return self._call("get", ref, keys)

    def close(self) -> None:
        """Ray owns the actor handle: nothing to close."""


# -- through the local socket and shared memory -------------------------------------------------


class LocalPending:
    """A request sent on a pooled connection; the connection is busy until the reply is read.
    `keys` are those the request is about (named when the shard is gone)."""

    def __init__(
        self, link: LocalLink, conn: Connection, what: str, keys: Sequence[str] = ()
    ) -> None:
        self._link, self._what, self._keys = link, what, keys
        self._conn: Connection | None = conn

    def result(self, timeout: float, partition_id: str) -> Reply:
        conn, self._conn = self._conn, None
        assert conn is not None, "a reply is read once"
        start = time.monotonic()
        try:
            header = conn.receive(start + timeout)
            arrays = []
            if "arrays" in header:
                conn.arena.follow(int(header["arena"]))
                arrays = conn.arena.read(header["arrays"])
        except TimeoutError as exc:  # the reply may still come: the connection is unusable
            conn.close()
            raise no_answer(partition_id, self._what, start) from exc
        except (OSError, ChannelClosed) as exc:  # the shard's end of the socket is gone
            conn.close()
            link = self._link
            raise gone(link.url, link.index, self._what, exc, partition_id, self._keys) from exc
        except (ArenaError, ValueError, KeyError) as exc:
            conn.close()
            raise lost(self._link.url, self._what, exc) from exc
        try:
            check_header(header)
        except StoreError:
            self._link.release(conn)
            raise
        return Reply(header, arrays, lambda: self._link.release(conn))

    def cancel(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class LocalLink:
    """A shard on this node, reached through its Unix socket and shared-memory arenas."""

    transport = "shm"

    def __init__(self, address: str, url: str, timeout: float, index: int) -> None:
        """Connects once (OSError or ChannelClosed when the local path does not work)."""
        self.url, self.index = url, index
        self._address, self._timeout = address, timeout
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self.release(Connection(address, timeout))

    def _acquire(self) -> Connection:
        with self._lock:
            if self._pid != os.getpid():  # a forked child must not share its parent's sockets
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        return Connection(self._address, self._timeout)

    def release(self, conn: Connection) -> None:
        """Returns a connection whose reply has been read (and its arrays copied) to the pool."""
        with self._lock:
            keep = len(self._idle) < _IDLE and conn.arena.size <= _KEEP_ARENA
            if keep and not self._closed and self._pid == os.getpid():
                self._idle.append(conn)
                return
        conn.close()

    def _send(
        self,
        what: str,
        header: Header,
        arrays: Sequence[AnyArray] | None = None,
        keys: Sequence[str] = (),
    ) -> Pending:
        partition_id = str(header.get("partition", ""))
        try:
            conn = self._acquire()
        except (OSError, ChannelClosed) as exc:
            raise gone(self.url, self.index, what, exc, partition_id, keys) from exc
        try:
            if arrays is not None:
                header = {**header, "arrays": conn.arena.write(arrays), "arena": conn.arena.size}
            conn.send({"op": what, **header})
        except OSError as exc:
            conn.close()
            raise gone(self.url, self.index, what, exc, partition_id, keys) from exc
        except ArenaError as exc:
            conn.close()
            raise lost(self.url, what, exc) from exc
        return LocalPending(self, conn, what, keys)

    def _put_header(self, out: Outgoing, shard: int) -> tuple[Header, list[AnyArray]]:
        arrays: list[AnyArray] = []
        fields = pack_columns(out.columns_of(shard), arrays)
        keys = pick(out.keys, out.routes[shard])
        header = {"partition": out.partition_id, "keys": keys, "overwrite": out.overwrite}
        return {**header, "fields": fields}, arrays

    def put(self, out: Outgoing, shard: int) -> Pending:
        header, arrays = self._put_header(out, shard)
        return self._send("put", {**header, "solo": out.solo}, arrays, header["keys"])

    def prepare(self, txn: str, out: Outgoing, shard: int, ttl: float) -> Pending:
        header, arrays = self._put_header(out, shard)
        return self._send("prepare", {**header, "txn": txn, "ttl": ttl}, arrays, header["keys"])

    def commit(self, txn: str) -> Pending:
        return self._send("commit", {"txn": txn})

    def abort(self, txn: str) -> Pending:
        return self._send("abort", {"txn": txn})

    def get(
        self, partition_id: str, keys: list[str], fields: list[str] | None, timeout: float
    ) -> Pending:
        header = {"partition": partition_id, "keys": keys, "fields": fields, "timeout": timeout}
        return self._send("get", header, keys=keys)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
