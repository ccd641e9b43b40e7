"""One partition's data: field specs, columnar chunks, and the key -> (chunk, row) index.

Each put of a field appends one chunk (a `Column` of the rows it wrote) and points its keys at
`(chunk, row)`; a chunk is freed when no key points at it any more. Keys get small integer ids,
so locating a batch is one dict lookup per key plus numpy indexing per field.

A put is planned first (`plan_put`: specs, content comparison, conflicts) without changing
anything, and applied second (`apply`, which cannot fail). The embedded store does both under one
lock; a Ray shard plans in a prepare call and applies on commit. Not thread-safe by itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from storage.columnar import BoolArray, Column, IntArray, empty_column, gather, rows_equal
from storage.errors import ConflictError, SchemaError, preview
from storage.schema import FieldSpec, registered_spec

ANY_FIELD = "(any field)"  # the "field" a key misses when a get asks for whatever fields exist


@dataclass(frozen=True, eq=False)
class Located:
    """Where the rows of one field live: row i is `rows[i]` of `chunks[chunk_ids[i]]`."""

    spec: FieldSpec
    chunks: list[Column]
    chunk_ids: IntArray
    rows: IntArray

    def column(self) -> Column:
        """A fresh copy of the rows (safe to run outside the lock: chunks are immutable)."""
        if self.rows.size == 0:
            return empty_column(self.spec)
        return gather(self.chunks, self.chunk_ids, self.rows)

    def view(self) -> Column:
        """The rows without a copy when they are one run of one chunk, else a copy.

        Only for handing straight to a serializer: the result may share a stored chunk's memory.
        """
        rows = self.rows
        one_run = (
            len(self.chunks) == 1
            and rows.size > 0
            and int(rows[-1]) - int(rows[0]) == rows.size - 1  # cheap test first
            and bool((rows[1:] > rows[:-1]).all())  # keys are distinct: increasing = one run
        )
        if one_run:
            return self.chunks[0].slice(int(rows[0]), int(rows[-1]) + 1)
        return self.column()


@dataclass
class Found:
    """Result of `Partition.find`: every field located, or which rows each field misses."""

    located: dict[str, Located] = field(default_factory=dict)
    missing: dict[str, BoolArray] = field(default_factory=dict)


@dataclass
class PutPlan:
    """A validated put: new specs to fix and, per field, the rows to write (None = all)."""

    partition_id: str
    keys: list[str]
    new_specs: dict[str, FieldSpec]
    writes: dict[str, tuple[IntArray | None, Column]]


@dataclass
class PartitionDump:
    """A whole partition in key order: per field, which keys hold it and their rows."""

    partition_id: str
    keys: list[str]
    specs: dict[str, FieldSpec]
    present: dict[str, BoolArray]
    columns: dict[str, Column]


class FieldIndex:
    """The chunks of one field and, per key id, the chunk and row holding its value."""

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec
        self.chunks: list[Column | None] = []
        self.live: list[int] = []
        self.chunk_of: IntArray = np.full(0, -1, np.int64)
        self.row_of: IntArray = np.zeros(0, np.int64)

    def grow(self, size: int) -> None:
        old = self.chunk_of.size
        if size <= old:
            return
        new = max(size, 2 * old, 64)
        self.chunk_of = np.concatenate([self.chunk_of, np.full(new - old, -1, np.int64)])
        self.row_of = np.concatenate([self.row_of, np.zeros(new - old, np.int64)])

    def present(self, ids: IntArray) -> BoolArray:
        if ids.size and ids.min() >= 0 and ids.max() < self.chunk_of.size:  # every key known
            return np.asarray(self.chunk_of[ids] >= 0, np.bool_)
        known = (ids >= 0) & (ids < self.chunk_of.size)
        out = np.zeros(ids.size, np.bool_)
        out[known] = self.chunk_of[ids[known]] >= 0
        return out

    def locate(self, ids: IntArray) -> Located:
        chunk_ids, rows = self.chunk_of[ids], self.row_of[ids]
        if chunk_ids.size and chunk_ids.min() == chunk_ids.max():
            used, local = [int(chunk_ids[0])], np.zeros(chunk_ids.size, np.int64)
        else:
            unique, local = np.unique(chunk_ids, return_inverse=True)
            used = unique.tolist()
        chunks = [self.chunks[c] for c in used]
        assert all(chunk is not None for chunk in chunks), "a live key points at a freed chunk"
        return Located(self.spec, [c for c in chunks if c is not None], local, rows)

    def write(self, ids: IntArray, column: Column) -> None:
        if ids.size == 0:  # nothing to point at the chunk: keep none
            return
        self._release(ids)
        self.chunks.append(column)
        self.live.append(int(ids.size))
        self.chunk_of[ids] = len(self.chunks) - 1
        self.row_of[ids] = np.arange(ids.size, dtype=np.int64)

    def drop(self, ids: IntArray) -> None:
        ids = ids[self.present(ids)]
        self._release(ids)
        self.chunk_of[ids] = -1

    def _release(self, ids: IntArray) -> None:
        old = self.chunk_of[ids]
        chunk_ids, counts = np.unique(old[old >= 0], return_counts=True)
        for c, n in zip(chunk_ids.tolist(), counts.tolist()):
            self.live[c] -= n
            if self.live[c] == 0:
                self.chunks[c] = None


class Partition:
    """Specs, keys and field indexes of one partition."""

    def __init__(self, partition_id: str) -> None:
        self.partition_id = partition_id
        self.specs: dict[str, FieldSpec] = {}
        # Fields whose spec is fixed on every shard of a Ray store (kept by `storage.ray_shard`;
        # the embedded store, which holds the whole partition in one place, leaves it empty).
        self.everywhere: set[str] = set()
        self.fields: dict[str, FieldIndex] = {}
        self.key_ids: dict[str, int] = {}
        self._free: list[int] = []
        self._next_id = 0

    # -- specs ---------------------------------------------------------------------------------

    def expected_spec(self, name: str) -> FieldSpec | None:
        """The spec a value of `name` must have here, if one is fixed."""
        return self.specs.get(name) or registered_spec(name)

    def new_specs(self, specs: Mapping[str, FieldSpec]) -> dict[str, FieldSpec]:
        """The specs not yet fixed here; SchemaError if one conflicts with a fixed spec."""
        new = {}
        for name, spec in specs.items():
            known = self.expected_spec(name)
            if known is None:
                new[name] = spec
            elif known != spec:
                raise SchemaError(
                    f"partition {self.partition_id!r}, field {name!r}: expected "
                    f"{known.describe()}, got {spec.describe()}; convert the value or use "
                    "another field name"
                )
            elif name not in self.specs:
                new[name] = spec
        return new

    def declare(self, specs: Mapping[str, FieldSpec]) -> None:
        self.specs.update(self.new_specs(specs))

    # -- put -----------------------------------------------------------------------------------

    def ids(self, keys: Sequence[str]) -> IntArray:
        """The id of each key, -1 for keys not in the partition."""
        return np.fromiter(map(self.key_ids.get, keys, repeat(-1)), np.int64, len(keys))

    def plan_put(
        self, keys: Sequence[str], columns: Mapping[str, Column], overwrite: bool
    ) -> PutPlan:
        """Validates a put against what is stored; changes nothing.

        Rows already holding identical content are skipped (a retried put is a no-op).
        Raises SchemaError for a spec conflict, ConflictError for different content.
        """
        new_specs = self.new_specs({name: col.spec for name, col in columns.items()})
        ids = self.ids(keys)
        writes: dict[str, tuple[IntArray | None, Column]] = {}
        conflicts: dict[str, list[str]] = {}
        for name, column in columns.items():
            write, changed = self._rows_to_write(name, ids, column, overwrite)
            if changed.size and not overwrite:
                conflicts[name] = [keys[i] for i in changed.tolist()]
            elif write.all():
                writes[name] = (None, column)
            elif write.any():
                writes[name] = (np.flatnonzero(write), column)
        if conflicts:
            raise self._conflict(conflicts)
        return PutPlan(self.partition_id, list(keys), new_specs, writes)

    def _rows_to_write(
        self, name: str, ids: IntArray, column: Column, overwrite: bool
    ) -> tuple[BoolArray, IntArray]:
        """Rows that are new or changed (changed ones only with overwrite), and changed rows."""
        index = self.fields.get(name)
        exists = index.present(ids) if index else np.zeros(ids.size, np.bool_)
        if index is None or not exists.any():
            return ~exists, np.zeros(0, np.int64)
        old_rows = np.flatnonzero(exists)
        same = rows_equal(index.locate(ids[old_rows]).column(), column.take(old_rows))
        changed = old_rows[~same]
        write = ~exists
        if overwrite:
            write[changed] = True
        return write, changed

    def _conflict(self, conflicts: Mapping[str, list[str]]) -> ConflictError:
        parts = [
            f"field {name!r} for {len(keys)} key(s) {preview(keys)}"
            for name, keys in conflicts.items()
        ]
        return ConflictError(
            f"partition {self.partition_id!r}: different values are already stored for "
            + "; ".join(parts)
            + ". Re-put identical content, or pass overwrite=True to replace them"
        )

    def apply(self, plan: PutPlan) -> None:
        """Stores a planned put (copying what it keeps). Cannot fail."""
        for name, spec in plan.new_specs.items():
            self.specs.setdefault(name, spec)
        ids = self._assign(plan.keys)
        for name, (rows, column) in plan.writes.items():
            index = self.fields.get(name)
            if index is None:
                index = self.fields[name] = FieldIndex(self.specs[name])
            index.grow(self._next_id)
            if rows is None:
                index.write(ids, column.owned_copy())
            else:
                index.write(ids[rows], column.take(rows))

    def _assign(self, keys: Sequence[str]) -> IntArray:
        """Ids of the keys, giving new keys free ids first, then fresh ones."""
        ids = self.ids(keys)
        new = np.flatnonzero(ids < 0)
        if new.size:
            reused = self._free[len(self._free) - min(len(self._free), new.size) :]
            del self._free[len(self._free) - len(reused) :]
            count = new.size - len(reused)
            new_ids = reused + list(range(self._next_id, self._next_id + count))
            self._next_id += count
            self.key_ids.update(zip([keys[i] for i in new.tolist()], new_ids))
            ids[new] = new_ids
        return ids

    # -- get, list, clear ----------------------------------------------------------------------

    def find(self, keys: Sequence[str], fields: Sequence[str] | None) -> Found:
        """Locates `fields` (None: every field all keys hold) of `keys`, or reports what misses."""
        ids = self.ids(keys)
        if fields is None:
            if (ids < 0).any():
                return Found(missing={ANY_FIELD: ids < 0})
            fields = [name for name, index in self.fields.items() if index.present(ids).all()]
        found = Found()
        for name in fields:
            index = self.fields.get(name)
            present = index.present(ids) if index else np.zeros(ids.size, np.bool_)
            if not present.all():
                found.missing[name] = ~present
            elif index is not None:
                found.located[name] = index.locate(ids)
            else:
                found.located[name] = self._located_nothing(name)
        if found.missing:
            found.located.clear()
        return found

    def _located_nothing(self, name: str) -> Located:
        spec = self.expected_spec(name)
        if spec is None:
            raise SchemaError(
                f"partition {self.partition_id!r}: field {name!r} has no spec yet, so even 0 keys "
                "cannot be read; declare it"
            )
        empty = np.zeros(0, np.int64)
        return Located(spec, [], empty, empty)

    def listing(self) -> dict[str, list[str]]:
        """`{key: [fields it holds]}` in the order keys arrived."""
        keys = list(self.key_ids)
        ids = np.fromiter(self.key_ids.values(), np.int64, len(keys))
        masks = {name: index.present(ids).tolist() for name, index in self.fields.items()}
        return {key: [n for n, mask in masks.items() if mask[i]] for i, key in enumerate(keys)}

    def drop(self, keys: Sequence[str]) -> int:
        """Removes keys with all their fields; returns how many were present."""
        ids = self.ids(keys)
        known = ids >= 0
        for index in self.fields.values():
            index.drop(ids[known])
        for key, kid in zip(keys, ids.tolist()):
            if kid >= 0 and self.key_ids.pop(key, None) is not None:
                self._free.append(kid)
        return int(known.sum())

    # -- whole partition -----------------------------------------------------------------------

    def export(self) -> PartitionDump:
        """Every key and field (copied), for save."""
        keys = list(self.key_ids)
        ids = np.fromiter(self.key_ids.values(), np.int64, len(keys))
        present = {name: index.present(ids) for name, index in self.fields.items()}
        columns = {
            name: self.fields[name].locate(ids[mask]).column() for name, mask in present.items()
        }
        return PartitionDump(self.partition_id, keys, dict(self.specs), present, columns)

    @classmethod
    def restore(cls, dump: PartitionDump) -> Partition:
        """A partition holding exactly what `dump` holds (its buffers are copied)."""
        part = cls(dump.partition_id)
        part.declare(dump.specs)
        ids = part._assign(dump.keys)
        for name, column in dump.columns.items():
            index = part.fields[name] = FieldIndex(part.specs[name])
            index.grow(part._next_id)
            if column.n_rows:
                index.write(ids[dump.present[name]], column.owned_copy())
        return part
