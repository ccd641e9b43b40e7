"""Dynamic sampling's choice (pure math): which groups of a step teach something, which go, and
how many prompts the next round draws.

A group whose samples all have the same metric value (every answer right, or every answer
wrong) has zero advantage under a group-relative estimator: it contributes nothing but cost.
``choose_groups`` keeps the groups whose values spread, in the order they were sampled, up to
``want`` of them; the rest are dropped (no spread) or surplus (beyond ``want``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GroupChoice", "choose_groups", "refill_size", "varying_groups"]


def varying_groups(*, values: Tensor, group_ids: Tensor) -> Tensor:
    """(B,) bool: True for a sample whose group's values are not all equal (max > min).

    A group of one sample never varies. ``group_ids`` (B,) are any integer labels."""
    if values.dim() != 1 or group_ids.shape != values.shape:
        raise ValueError(
            f"values and group_ids must both be (B,), got {tuple(values.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,)
    n_groups = int(inverse.max()) + 1
    v = values.double()
    high = torch.full((n_groups,), -math.inf, dtype=torch.float64)  # (G,)
    low = torch.full((n_groups,), math.inf, dtype=torch.float64)  # (G,)
    high = high.scatter_reduce(0, inverse, v, reduce="amax")
    low = low.scatter_reduce(0, inverse, v, reduce="amin")
    return (high > low)[inverse]  # (B,)


@dataclass(frozen=True)
class GroupChoice:
    """The groups of one candidate batch, by label, each in order of first appearance."""

    kept: tuple[int, ...]
    dropped: tuple[int, ...]  # no spread
    surplus: tuple[int, ...]  # spread, but beyond ``want``


def choose_groups(*, values: Tensor, group_ids: Tensor, want: int) -> GroupChoice:
    """Keep the first ``want`` groups (in order of first appearance) whose values spread."""
    if want < 0:
        raise ValueError(f"want must be >= 0, got {want}")
    varies = varying_groups(values=values, group_ids=group_ids)  # (B,)
    order: dict[int, bool] = {}
    for gid, v in zip(group_ids.tolist(), varies.tolist(), strict=True):
        order.setdefault(int(gid), bool(v))
    spread = [g for g, v in order.items() if v]
    return GroupChoice(
        kept=tuple(spread[:want]),
        dropped=tuple(g for g, v in order.items() if not v),
        surplus=tuple(spread[want:]),
    )


def refill_size(*, missing: int, kept: int, judged: int, cap: int) -> int:
    """Prompts the next round draws: enough to fill ``missing`` groups at the keep rate seen so
    far (``kept`` of ``judged`` groups), at least ``missing`` and at most ``cap``."""
    if missing <= 0:
        return 0
    if kept <= 0 or judged <= 0:
        return max(cap, missing)
    return max(missing, min(cap, math.ceil(missing * judged / kept)))
