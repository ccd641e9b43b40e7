"""Rule rewards (checked against a ground truth) and the weighted sum of reward components.

Rules are chosen by name through `RULES`; each maps (response_text, ground_truth) to a float.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

import torch
from torch import Tensor

__all__ = ["RULES", "exact_match", "hash_answer_match", "parse_hash_answer", "weighted_sum"]

_HASH_ANSWER = re.compile(r"####\s*([-+]?[0-9][0-9,]*(?:\.[0-9]+)?|[-+]?\.[0-9]+)")


def exact_match(response_text: str, ground_truth: str) -> float:
    """1.0 when the texts are equal after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response_text.strip() == ground_truth.strip() else 0.0


def parse_hash_answer(text: str) -> str | None:
    """The number after the last `#### ` marker (GSM8K format), commas removed; None if absent.

    "so 1,234 in all\\n#### 1,234" → "1234"; "#### -3.5" → "-3.5".
    """
    matches = _HASH_ANSWER.findall(text)
    if not matches:
        return None
    return str(matches[-1]).replace(",", "").lstrip("+")


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def hash_answer_match(response_text: str, ground_truth: str) -> float:
    """1.0 when the response's `#### <number>` equals the ground truth's number, else 0.0.

    The ground truth may be a bare number ("1,234") or text in the same `####` format; numbers
    compare by value ("72" matches "72.0"). A response without a `####` answer scores 0.0.
    """
    answer = parse_hash_answer(response_text)
    if answer is None:
        return 0.0
    truth = parse_hash_answer(ground_truth)
    if truth is None:
        truth = ground_truth.strip().replace(",", "")
    answer_value, truth_value = _as_number(answer), _as_number(truth)
    if answer_value is None or truth_value is None:
        return 1.0 if answer == truth else 0.0
    return 1.0 if answer_value == truth_value else 0.0


RULES: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "hash_answer_match": hash_answer_match,
}


def weighted_sum(components: dict[str, Tensor], weights: dict[str, float]) -> Tensor:
    """Σ weights[name] · components[name]; every component needs a weight and vice versa.

    A weight of 0 keeps a component logged but out of the reward. All components must have
    one shape; the result has the widest floating dtype among them (float32 at least).
    """
    missing_weights = sorted(set(components) - set(weights))
    missing_components = sorted(set(weights) - set(components))
    if missing_weights or missing_components:
        raise KeyError(
            f"reward components and weights must name the same rewards: components without a "
            f"weight {missing_weights}, weights without a component {missing_components} "
            f"(components {sorted(components)}, weights {sorted(weights)})"
        )
    if not components:
        raise ValueError("weighted_sum needs at least one reward component")
    shapes = {name: tuple(t.shape) for name, t in components.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"reward components must share one shape, got {shapes}")
    dtype = torch.float32
    for tensor in components.values():
        if tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    names = sorted(components)
    total = torch.zeros(shapes[names[0]], dtype=dtype, device=components[names[0]].device)
    for name in names:
        total = total + weights[name] * components[name].to(dtype)
    return total
