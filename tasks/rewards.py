"""Rule rewards (checked against a ground truth) and the weighted sum of reward components.

Rules are chosen by name through `RULES`; each maps (response_text, ground_truth) to a float.
The rules live in `infra.reward_functions` (standard library only), which also offers them to
`reward.functions` with verl's compute_score signature (built-ins `exact_match`, `gsm8k`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from infra.reward_functions import exact_match, hash_answer_match, parse_hash_answer

__all__ = ["RULES", "exact_match", "hash_answer_match", "parse_hash_answer", "weighted_sum"]

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
