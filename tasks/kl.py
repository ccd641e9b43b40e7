"""KL between the policy and the reference model: per-token estimators and coefficient control.

Estimators of KL(π‖π_ref) from one sample per token, with Δ = logprobs − ref_logprobs:

| kind  | per-token value                               | notes                              |
|-------|-----------------------------------------------|------------------------------------|
| `k1`  | Δ                                             | unbiased, can be negative          |
| `abs` | |Δ|                                           |                                    |
| `k2`  | ½·Δ²                                          | biased, low variance               |
| `k3`  | exp(−Δ) + Δ − 1, i.e. e^(ref−logp) − (ref−logp) − 1 | unbiased, ≥ 0; Δ clamped to ±20, value to ≤ 10 |

Kinds are chosen through the `KL_PENALTIES` dict. Controllers hold the coefficient β and are part
of checkpoints (`state_dict` / `load_state_dict`). `algorithm.kl.adaptive` chooses between them:
false keeps `algorithm.kl.coef` fixed, true adapts it towards `algorithm.kl.target` over
`algorithm.kl.horizon`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from tasks.masks import masked_mean

__all__ = [
    "KL_PENALTIES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLPenaltyOutput",
    "apply_kl_penalty",
    "kl_penalty",
]

_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


def _k1(delta: Tensor) -> Tensor:
    return delta


def _abs(delta: Tensor) -> Tensor:
    return delta.abs()


def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


def _k3(delta: Tensor) -> Tensor:
    ref_minus_logp = (-delta).clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    value = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0
    return value.clamp(min=-_K3_VALUE_BOUND, max=_K3_VALUE_BOUND)


KL_PENALTIES: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "abs": _abs,
    "k2": _k2,
    "k3": _k3,
}


def kl_penalty(*, logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate (same shape as the inputs) of the given `kind`."""
    if kind not in KL_PENALTIES:
        raise ValueError(f"unknown KL kind {kind!r}; choose one of {sorted(KL_PENALTIES)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have the same shape"
        )
    return KL_PENALTIES[kind](logprobs - ref_logprobs)


class KLPenaltyOutput(NamedTuple):
    """token_rewards (B, T) with −coef·KL added on real tokens; kl_mean: KL over real tokens."""

    token_rewards: Tensor
    kl_mean: float


def apply_kl_penalty(
    *,
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    coef: float,
    kind: str,
) -> KLPenaltyOutput:
    """token_rewards − coef · KL per real token (masked positions unchanged).

    kl_mean is the mean KL over all real tokens of the batch (0 when there are none): the
    `current_kl` to feed an adaptive controller.
    """
    with torch.no_grad():
        kl = kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, kind=kind)  # (B, T)
        kl = torch.where(response_mask, kl, torch.zeros_like(kl))
        penalised = token_rewards - coef * kl.to(token_rewards.dtype)  # (B, T)
        kl_mean = float(masked_mean(values=kl, mask=response_mask))
    return KLPenaltyOutput(token_rewards=penalised, kl_mean=kl_mean)


@dataclass
class FixedKLController:
    """A constant coefficient (`algorithm.kl.adaptive: false`); `update` does nothing."""

    coef: float

    @property
    def value(self) -> float:
        return self.coef

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "fixed", "value": self.coef}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        self.coef = _checked_value(state, expected_kind="fixed")


class AdaptiveKLController:
    """Proportional control of β towards a target KL (Ziegler et al., 2019), for
    `algorithm.kl.adaptive: true`; β starts at `algorithm.kl.coef`.

    error = clip(current_kl / target − 1, −0.2, 0.2);  β ← β · (1 + error · n_steps / horizon)
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs init_coef ≥ 0, target > 0 and horizon > 0; got "
                f"init_coef={init_coef}, target={target}, horizon={horizon}"
            )
        self._value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self._value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "adaptive", "value": self._value}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        self._value = _checked_value(state, expected_kind="adaptive")


def _checked_value(state: dict[str, float | str], *, expected_kind: str) -> float:
    if state.get("kind") != expected_kind:
        raise ValueError(
            f"KL controller state is of kind {state.get('kind')!r} but this controller is "
            f"{expected_kind!r}: the checkpoint was written with a different algorithm.kl.adaptive setting"
        )
    value = state.get("value")
    if not isinstance(value, (int, float)):
        raise ValueError(f"KL controller state has no numeric 'value': {state!r}")
    return float(value)
