"""Jagged rows as the store holds them: ``torch.jagged`` nested tensors, one row per sample.

The store returns every jagged field as a nested tensor over one values buffer (its offsets
give the lengths) and takes one back, or a list of 1-D rows. These helpers are the only
conversions the stages need: to rows, to lengths, to a right-padded batch and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from storage import BatchMeta
from tasks.context import StageContext


def offsets(jagged: Tensor) -> Tensor:
    """Where each row of a nested tensor starts in its values buffer, and where the last ends
    (B + 1,)."""
    starts: Tensor = jagged.offsets()  # type: ignore[attr-defined]  # nested tensors have offsets
    return starts


def lengths(jagged: Tensor) -> Tensor:
    """Row lengths (B,) int64 of a nested tensor."""
    return offsets(jagged).diff().to(torch.int64)


def rows(jagged: Tensor) -> list[Tensor]:
    """The rows of a nested tensor as 1-D tensors (views of its values buffer)."""
    return list(torch.split(jagged.values(), lengths(jagged).tolist()))


def nested(parts: Sequence[Tensor]) -> Tensor:
    """A ``torch.jagged`` nested tensor of 1-D rows (empty rows allowed)."""
    sizes = torch.tensor([int(p.numel()) for p in parts], dtype=torch.int64)
    offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
    torch.cumsum(sizes, 0, out=offsets[1:])
    values = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def padded(jagged: Tensor, width: int | None = None, *, pad: float = 0.0) -> Tensor:
    """Right-padded (B, width) tensor of a nested tensor's rows (width: the longest row)."""
    n = lengths(jagged)
    width = (int(n.max()) if len(n) else 0) if width is None else width
    values = jagged.values()
    out = torch.full((len(n), width), pad, dtype=values.dtype)
    out[torch.arange(width)[None, :] < n[:, None]] = values
    return out


def from_padded(batch: Tensor, row_lengths: Tensor) -> Tensor:
    """The nested tensor of a right-padded (B, T) batch's first ``row_lengths[b]`` entries."""
    mask = torch.arange(batch.shape[1])[None, :] < row_lengths[:, None]
    offsets = torch.zeros(len(row_lengths) + 1, dtype=torch.int64)
    torch.cumsum(row_lengths.to(torch.int64), 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(batch[mask].contiguous(), offsets)


def read(ctx: StageContext, meta: BatchMeta, fields: tuple[str, ...]) -> dict[str, Any]:
    """The flow process's own read of ``fields`` (what it alone computes on: prompts it puts,
    reward-function inputs); waits up to ``store.get_timeout_s``."""
    fields_read: dict[str, Any] = ctx.rt.store.get_fields(
        meta, fields, timeout=ctx.cfg.store.get_timeout_s
    )
    return fields_read


def write(ctx: StageContext, meta: BatchMeta, fields: dict[str, Any]) -> BatchMeta:
    """Put ``fields`` for ``meta.keys`` from the flow process; returns the widened handle."""
    ctx.rt.store.kv_batch_put(list(meta.keys), meta.partition_id, fields)
    return meta.with_fields(*fields)
