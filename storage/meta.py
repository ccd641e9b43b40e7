"""`BatchMeta`: the small handle stages pass instead of tensors.

A handle names a partition, the keys of its samples and the fields they hold. It is frozen,
picklable and JSON-friendly (`to_json` / `from_json`), so it crosses Prefect task boundaries and
Ray calls at no cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from storage.errors import SchemaError, preview


def _strings(values: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(values, str):
        raise SchemaError(f"BatchMeta {what} must be a sequence of str, got the string {values!r}")
    items = tuple(values)
    if set(map(type, items)) - {str}:
        bad = [item for item in items if type(item) is not str]
        raise SchemaError(f"BatchMeta {what} must be str, got {preview(bad)}")
    return items


@dataclass(frozen=True)
class BatchMeta:
    """Partition + keys + fields of one batch in the store.

    Attributes:
        partition_id: the partition the samples live in, e.g. `train/step-000012`.
        keys: one key per sample, in batch order.
        fields: the fields this handle vouches for.
    """

    partition_id: str
    keys: tuple[str, ...]
    fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.partition_id, str) or not self.partition_id:
            raise SchemaError(f"partition_id must be a non-empty str, got {self.partition_id!r}")
        object.__setattr__(self, "keys", _strings(self.keys, "keys"))
        object.__setattr__(self, "fields", _strings(self.fields, "fields"))

    def __len__(self) -> int:
        return len(self.keys)

    def select(self, *fields: str) -> BatchMeta:
        """The same keys with only `fields`, which this handle must already hold."""
        unknown = [name for name in fields if name not in self.fields]
        if unknown:
            raise SchemaError(
                f"partition {self.partition_id!r}: fields {preview(unknown)} are not in this "
                f"handle's fields {preview(self.fields)}"
            )
        return BatchMeta(self.partition_id, self.keys, tuple(fields))

    def with_fields(self, *fields: str) -> BatchMeta:
        """The same keys with `fields` added (kept in order, without repeats)."""
        merged = dict.fromkeys((*self.fields, *fields))
        return BatchMeta(self.partition_id, self.keys, tuple(merged))

    def subset(self, keys: Iterable[str]) -> BatchMeta:
        """A handle for some of the keys (in the given order), with the same fields."""
        chosen = tuple(keys)
        known = set(self.keys)
        unknown = [key for key in chosen if key not in known]
        if unknown:
            raise SchemaError(
                f"partition {self.partition_id!r}: keys {preview(unknown)} are not in this handle"
            )
        return BatchMeta(self.partition_id, chosen, self.fields)

    def split(self, size: int) -> list[BatchMeta]:
        """Consecutive handles of at most `size` keys each."""
        if size <= 0:
            raise SchemaError(f"split size must be positive, got {size}")
        return [
            BatchMeta(self.partition_id, self.keys[i : i + size], self.fields)
            for i in range(0, len(self.keys), size)
        ]

    def shards(self, parts: int) -> list[BatchMeta]:
        """`parts` consecutive handles covering every key, sizes differing by at most one (the
        first ones larger); some are empty when there are fewer keys than parts."""
        if parts <= 0:
            raise SchemaError(f"shard count must be positive, got {parts}")
        size, extra = divmod(len(self.keys), parts)
        out, start = [], 0
        for i in range(parts):
            stop = start + size + (1 if i < extra else 0)
            out.append(BatchMeta(self.partition_id, self.keys[start:stop], self.fields))
            start = stop
        return out

    def to_json(self) -> dict[str, Any]:
        """A dict of plain lists and strings."""
        return {
            "partition_id": self.partition_id,
            "keys": list(self.keys),
            "fields": list(self.fields),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchMeta:
        """Rebuilds a handle from `to_json` output."""
        try:
            return cls(data["partition_id"], tuple(data["keys"]), tuple(data.get("fields", ())))
        except (KeyError, TypeError) as exc:
            raise SchemaError(f"malformed BatchMeta {data!r}: {exc}") from exc
