"""Reading and writing a stage's declared fields, converting between the store's types and the
columnar ``Jagged`` buffers the workers take."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from infra.transport import Jagged
from storage import BatchMeta
from tasks.context import StageContext


def to_plain(value: Any) -> Any:
    """Store value → ``Jagged`` (jagged fields), ``Tensor`` (dense) or ``list`` (objects)."""
    if isinstance(value, Tensor):
        if value.is_nested:
            return Jagged(value.values().numpy(), value.offsets().to(torch.int64).numpy())
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)


def read(ctx: StageContext, meta: BatchMeta, fields: tuple[str, ...]) -> dict[str, Any]:
    """Get ``fields`` for ``meta.keys``; waits up to ``store.get_timeout_s`` for stalled producers."""
    td = ctx.store.kv_batch_get(
        list(meta.keys), meta.partition_id, list(fields), timeout=ctx.get_timeout
    )
    return {name: to_plain(td[name]) for name in fields}


def write(ctx: StageContext, meta: BatchMeta, fields: dict[str, Any]) -> BatchMeta:
    """Put ``fields`` (Jagged, dense tensors or lists) for ``meta.keys``; returns the widened handle."""
    payload = {k: (v.nested() if isinstance(v, Jagged) else v) for k, v in fields.items()}
    ctx.store.kv_batch_put(list(meta.keys), meta.partition_id, payload)
    return meta.with_fields(*fields)
