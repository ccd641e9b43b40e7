"""Columnar transport of jagged rows between the flow process and Ray workers.

A list of 1-D tensors travels as one numpy values buffer plus int64 offsets (Ray moves numpy
zero-copy through its object store), never as a pickled list of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class Jagged:
    """Rows ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_rows(cls, rows: list[Tensor] | Tensor) -> Jagged:
        if isinstance(rows, Tensor) and rows.is_nested:
            values = rows.values().detach().cpu()
            offsets = rows.offsets().detach().cpu().to(torch.int64)
            return cls(values.numpy(), offsets.numpy())
        lengths = torch.tensor([int(r.numel()) for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if rows:
            values = torch.cat([r.detach().reshape(-1).cpu() for r in rows])
        else:
            values = torch.zeros(0)
        return cls(values.numpy(), offsets.numpy())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> Tensor:
        return torch.from_numpy(np.diff(self.offsets))

    def rows(self) -> list[Tensor]:
        values = torch.from_numpy(np.array(self.values, copy=True))
        return list(torch.split(values, np.diff(self.offsets).tolist()))

    def nested(self) -> Tensor:
        """A ``torch.jagged`` nested tensor over a copy of the values."""
        values = torch.from_numpy(np.array(self.values, copy=True))
        return torch.nested.nested_tensor_from_jagged(values, torch.from_numpy(self.offsets.copy()))

    def padded(self, *, pad: float = 0.0, width: int | None = None) -> Tensor:
        """Right-padded (B, width) tensor."""
        lengths = self.lengths
        width = int(lengths.max()) if width is None and len(lengths) else (width or 0)
        values = torch.from_numpy(np.array(self.values, copy=True))
        out = torch.full((len(lengths), width), pad, dtype=values.dtype)
        mask = torch.arange(width)[None, :] < lengths[:, None]
        out[mask] = values
        return out


def rows_to_padded(rows: list[Tensor], *, pad: float = 0.0, width: int | None = None) -> Tensor:
    return Jagged.from_rows(rows).padded(pad=pad, width=width)
