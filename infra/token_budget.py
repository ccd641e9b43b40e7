"""Rows cut into batches under a token budget, longest first: a batch costs its rows × its
longest row (the tokens of a right-padded batch). The reward model's scoring batches and the
trainer's token-budget micro-batches (``tasks.batching``) are cut by this one rule."""

from __future__ import annotations

from collections.abc import Sequence


def longest_first_groups(
    lengths: Sequence[int], budget: int | None, max_rows: int | None = None
) -> list[list[int]]:
    """Row indices sorted by length, longest first (ties in row order), cut into runs: a run
    that starts at a row of length n holds up to ``budget // n`` rows (at least that one row;
    every row left when n is 0 or ``budget`` is None), and at most ``max_rows``."""
    order = sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))
    groups: list[list[int]] = []
    start = 0
    while start < len(order):
        longest = int(lengths[order[start]])
        take = len(order) - start if budget is None or longest <= 0 else max(budget // longest, 1)
        if max_rows is not None:
            take = min(take, max_rows)
        groups.append(order[start : start + take])
        start += take
    return groups
