"""ppoflow's typed, partitioned key-value store (stands in for verl's TransferQueue).

Stages never pass tensors to each other: each reads its inputs from and writes its outputs to a
store, and passes only a `BatchMeta` handle on::

    from storage import open_store
    store = open_store("memory://")          # in-process (a test's); a run opens store.url
    meta = store.kv_batch_put(keys, "train/step-000001", {"prompt_ids": ids, "scores": s})
    td = store.kv_batch_get(meta.keys, meta.partition_id, ["prompt_ids"], timeout=30)

`ray://NAME?shards=2` puts the data in Ray actors that any process can open by name. Importing
this package imports neither Ray nor torch: `Store`, `open_store` and `DEFAULT_TIMEOUT_S` load
their modules (and torch) when first used, so a Ray store shard, which imports only the modules
it serves rows with, starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from storage.errors import (
    ConflictError,
    SchemaError,
    ShardLost,
    StoreCorruptError,
    StoreError,
    StoreTimeout,
)
from storage.meta import BatchMeta
from storage.schema import VOCABULARY, FieldSpec, declare_field, registered_spec

if TYPE_CHECKING:
    from storage.base import DEFAULT_TIMEOUT_S, Store
    from storage.factory import open_store

_LOADED_ON_USE = {
    "DEFAULT_TIMEOUT_S": "storage.base",
    "Store": "storage.base",
    "open_store": "storage.factory",
}


def __getattr__(name: str) -> Any:
    """`Store`, `open_store` and `DEFAULT_TIMEOUT_S`, from their modules on first use."""
    module = _LOADED_ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "VOCABULARY",
    "BatchMeta",
    "ConflictError",
    "FieldSpec",
    "SchemaError",
    "ShardLost",
    "Store",
    "StoreCorruptError",
    "StoreError",
    "StoreTimeout",
    "declare_field",
    "open_store",
    "registered_spec",
]
