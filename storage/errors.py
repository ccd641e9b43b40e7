"""Typed errors of the store.

Every error says which partition, key and field it is about and what to do. Callers catch
`StoreError` for anything the store raises; `StoreTimeout` is also a builtin `TimeoutError`, so
orchestration retries (Prefect, Ray) treat a missing input as a timeout.
"""

from __future__ import annotations

from collections.abc import Sequence

_SHOW = 8  # items of a long list shown in a message before "... and N more"


def preview(items: Sequence[object], limit: int = _SHOW) -> str:
    """`['a', 'b', ... and 3 more]`: a list for a message, cut after `limit` items."""
    shown = ", ".join(repr(item) for item in items[:limit])
    rest = len(items) - limit
    return f"[{shown}, ... and {rest} more]" if rest > 0 else f"[{shown}]"


class StoreError(Exception):
    """Base class of every error the store raises."""


class SchemaError(StoreError, ValueError):
    """A put or declaration does not match the field's spec (kind, dtype, shape, row count)."""


class ConflictError(StoreError):
    """A put would change a value that is already stored (pass overwrite=True to replace it)."""


class StoreCorruptError(StoreError):
    """A saved partition file is truncated, foreign or inconsistent."""


class StoreTimeout(StoreError, TimeoutError):
    """Keys or fields did not arrive within the timeout of a get.

    Attributes name what was missing, so a caller can log or retry precisely.
    """

    def __init__(
        self,
        partition_id: str,
        missing_keys: Sequence[str],
        missing_fields: Sequence[str],
        waited_s: float,
        detail: str = "",
    ) -> None:
        self.partition_id = partition_id
        self.missing_keys = tuple(missing_keys)
        self.missing_fields = tuple(missing_fields)
        self.waited_s = waited_s
        self.detail = detail
        message = (
            f"partition {partition_id!r}: {len(self.missing_keys)} key(s) "
            f"{preview(self.missing_keys)} still lack field(s) {preview(self.missing_fields)} "
            f"after waiting {waited_s:.3f} s"
        )
        if detail:
            message += f" ({detail})"
        message += "; check that the producing stage ran, or raise the timeout"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.partition_id, self.missing_keys, self.missing_fields, self.waited_s, self.detail),
        )


class ShardLost(StoreError):
    """A shard of a ``ray://`` store is gone (its actor died, or its node): the rows it held are
    lost. Names the store, the shard, the partition and the keys the call needed from it.

    What to do: ``RayStore.recover()`` makes the lost shards anew (empty), then the rows are
    produced again; the training flow does both and continues from its latest checkpoint when
    ``trainer.max_restarts`` allows.
    """

    def __init__(
        self,
        url: str,
        shard: int | None,
        partition_id: str,
        keys: Sequence[str],
        detail: str = "",
    ) -> None:
        self.url = url
        self.shard = shard
        self.partition_id = partition_id
        self.keys = tuple(keys)
        self.detail = detail
        which = "a shard" if shard is None else f"shard {shard}"
        message = f"{url}: {which} is lost"
        if detail:
            message += f" ({detail})"
        if partition_id:
            message += f"; partition {partition_id!r} lost the rows it held"
            if self.keys:
                message += f" of {len(self.keys)} key(s) {preview(self.keys)}"
        message += (
            "; recover the store (RayStore.recover) and produce those rows again (a training "
            "run restarts from its latest checkpoint, up to trainer.max_restarts times)"
        )
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.url, self.shard, self.partition_id, self.keys, self.detail))
