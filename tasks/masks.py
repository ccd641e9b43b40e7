"""Masked reductions over token tensors.

Masks are bool with True = real token, and named `*_mask`. Every reduction here ignores the
values at masked positions entirely (they may hold NaN from padding and still not leak in).
An all-masked input reduces to 0, never NaN. `values` and `mask` may be passed positionally.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "last_true",
    "lengths_to_mask",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def lengths_to_mask(lengths: Tensor, width: int) -> Tensor:
    """Bool mask (B, width): True where position < length.

    Raises ValueError for a negative length or one longer than `width`.
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > width):
        raise ValueError(
            f"lengths must lie in [0, {width}] (width), got min {int(lengths.min())} "
            f"and max {int(lengths.max())}"
        )
    positions = torch.arange(width, device=lengths.device)  # (width,)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)  # (B, width)


def last_true(mask: Tensor) -> Tensor:
    """(B,) int64: one past the last True position of each row of ``mask`` (B, T); 0 for a row
    without one. For a right-padded mask this is its length."""
    width = mask.shape[1]
    positions = torch.arange(1, width + 1, device=mask.device)  # (T,)
    return (
        torch.where(mask, positions, 0).amax(dim=1)
        if width
        else mask.new_zeros(mask.shape[0], dtype=torch.int64)
    )


def masked_sum(values: Tensor, mask: Tensor, *, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is True, over `dim` (all dims when None)."""
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, *, dim: int | None = None) -> Tensor:
    """Mean of `values` over real positions; 0 where there are none."""
    total = masked_sum(values=values, mask=mask, dim=dim)
    count = torch.count_nonzero(mask) if dim is None else torch.count_nonzero(mask, dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance over all real positions (a scalar); 0 with fewer than 2 (unbiased) real values."""
    centered = _masked_centered(values=values, mask=mask)
    return _variance_of_centered(
        centered=centered, count=int(torch.count_nonzero(mask)), unbiased=unbiased
    )


def masked_whiten(
    values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """(values − mean) / sqrt(var + eps) over real positions (unbiased var); masked positions 0.

    With `shift_mean=False` the mean is added back after scaling (only the scale changes).
    """
    count = int(torch.count_nonzero(mask))
    centered = _masked_centered(values=values, mask=mask)  # 0 at masked positions
    var = _variance_of_centered(centered=centered, count=count, unbiased=True)
    whitened = centered.mul_(torch.rsqrt(var + eps))
    if not shift_mean:
        mean = masked_mean(values, mask)
        whitened = whitened.add_(mean).masked_fill_(~mask, 0.0)
    return whitened


def _masked_centered(*, values: Tensor, mask: Tensor) -> Tensor:
    """A new tensor: values − (masked mean) at real positions, 0 at masked ones."""
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    mean = kept.sum() / max(int(torch.count_nonzero(mask)), 1)
    return kept.sub_(mean).masked_fill_(~mask, 0.0)


def _variance_of_centered(*, centered: Tensor, count: int, unbiased: bool) -> Tensor:
    denominator = count - 1 if unbiased else count
    if denominator <= 0:
        return torch.zeros((), dtype=centered.dtype, device=centered.device)
    norm: Tensor = torch.linalg.vector_norm(centered)
    return norm.square() / denominator
