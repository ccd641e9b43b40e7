"""Off-policy correction of the actor's loss against the behaviour policy (torch only).

The rollout engine's log-probs of the sampled tokens (``rollout_logprobs``, π_rollout: the
behaviour policy) can differ from the trainer's (π_old, the proximal policy the PPO ratio is
clipped against): another engine's or dtype's numerics, or an async rollout some policy
versions behind. Decoupled PPO weights each token's clipped loss by the importance ratio
ρ = π_old / π_rollout (``tasks.update.core.ppo_policy_loss``'s ``is_weights``).

1. log ρ_t = log π_old − log π_rollout on real tokens; a row's log ρ_b = Σ_t log ρ_t and its
   geometric mean's log ρ̄_b = mean_t log ρ_t (log-ratios clamped to ±20 before exp).
2. The mode (``CORRECTIONS``) gives a weight w and a keep mask per token:

   | mode                | w_t                   | keep_t                   |
   |---------------------|-----------------------|--------------------------|
   | `none`              | 1                     | True                     |
   | `token_truncate`    | min(ρ_t, cap)         | True                     |
   | `sequence_truncate` | min(ρ_b, cap)         | True                     |
   | `token_mask`        | 1                     | low ≤ ρ_t ≤ high         |
   | `sequence_mask`     | 1                     | low ≤ ρ_b ≤ high         |
   | `geometric_mask`    | 1                     | low ≤ exp(log ρ̄_b) ≤ high |

3. ``weights`` = w on kept real tokens, 0 elsewhere (no gradient flows through them); tokens not
   kept also leave the loss mask (``keep_mask``), so the entropy and KL terms skip them too.

``rollout_gap`` measures the gap every step (``rollout_corr/*``), whatever the mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tasks.kl import kl_penalty
from tasks.masks import masked_mean, masked_sum

__all__ = ["CORRECTIONS", "Correction", "RolloutGap", "rollout_correction", "rollout_gap"]

_LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    """weights (B, T): w on kept real tokens, 0 elsewhere (detached); keep_mask (B, T) bool:
    real tokens that stay in the loss; ratio (B, T): the ratio at the mode's level (ρ_t, ρ_b
    or exp(log ρ̄_b)) before truncation, 0 off real tokens; clipped_mask (B, T) bool: real
    tokens whose weight the cap truncated."""

    weights: Tensor
    keep_mask: Tensor
    ratio: Tensor
    clipped_mask: Tensor


def _row_log_ratio(log_ratio: Tensor, response_mask: Tensor, *, mean: bool) -> Tensor:
    """Each row's summed (or mean) log-ratio on every one of its positions. (B, T)"""
    per_row = (masked_mean if mean else masked_sum)(log_ratio, response_mask, dim=1)  # (B,)
    return per_row.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).unsqueeze(1).expand_as(log_ratio)


def _truncate(level: Tensor, response_mask: Tensor, cap: float) -> Correction:
    ratio = torch.exp(level)  # (B, T)
    return Correction(
        weights=ratio.clamp(max=cap),
        keep_mask=response_mask,
        ratio=ratio,
        clipped_mask=response_mask & (ratio > cap),
    )


def _mask(level: Tensor, response_mask: Tensor, low: float, high: float) -> Correction:
    ratio = torch.exp(level)  # (B, T)
    inside = (ratio >= low) & (ratio <= high)  # (B, T)
    return Correction(
        weights=torch.ones_like(ratio),
        keep_mask=response_mask & inside,
        ratio=ratio,
        clipped_mask=torch.zeros_like(response_mask),
    )


# Each mode: (log ρ_t (B, T), response_mask (B, T), cap, low, high) -> Correction.
CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float, float, float], Correction]] = {
    "none": lambda lr, m, cap, low, high: _mask(lr, m, 0.0, float("inf")),
    "token_truncate": lambda lr, m, cap, low, high: _truncate(lr, m, cap),
    "sequence_truncate": lambda lr, m, cap, low, high: _truncate(
        _row_log_ratio(lr, m, mean=False), m, cap
    ),
    "token_mask": lambda lr, m, cap, low, high: _mask(lr, m, low, high),
    "sequence_mask": lambda lr, m, cap, low, high: _mask(
        _row_log_ratio(lr, m, mean=False), m, low, high
    ),
    "geometric_mask": lambda lr, m, cap, low, high: _mask(
        _row_log_ratio(lr, m, mean=True), m, low, high
    ),
}


def rollout_correction(
    *,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    mode: str,
    cap: float,
    low: float,
    high: float,
) -> Correction:
    """The correction of ``mode`` (see the module docstring) for (B, T) log-probs of the
    proximal policy (``old_logprobs``) and the behaviour policy (``rollout_logprobs``)."""
    if mode not in CORRECTIONS:
        raise ValueError(
            f"unknown rollout correction {mode!r}; choose one of {sorted(CORRECTIONS)}"
        )
    with torch.no_grad():
        # 1.
        log_ratio = (old_logprobs.detach() - rollout_logprobs).clamp(
            -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND
        )  # (B, T)
        log_ratio = torch.where(response_mask, log_ratio, torch.zeros_like(log_ratio))
        # 2.
        out = CORRECTIONS[mode](log_ratio, response_mask, cap, low, high)
        # 3.
        zero = torch.zeros_like(out.weights)
        return Correction(
            weights=torch.where(out.keep_mask, out.weights, zero),
            keep_mask=out.keep_mask,
            ratio=torch.where(response_mask, out.ratio, zero),
            clipped_mask=out.clipped_mask,
        )


@dataclass(frozen=True)
class RolloutGap:
    """The ``rollout_corr/*`` metrics of one batch (floats), over its real tokens."""

    kl_k1: float  # mean of log π_rollout − log π_old: KL(π_rollout ‖ π_old), k1
    kl_k3: float  # mean of ρ − 1 − log ρ: the same KL, k3 (≥ 0)
    ppl_ratio: float  # mean over non-empty rows of the trainer's perplexity / the rollout's
    is_weight_mean: float  # mean of the mode's ratio (``Correction.ratio``, before the cap)
    is_weight_max: float
    clipped_fraction: float  # share of real tokens whose weight the cap truncated
    masked_fraction: float  # share of real tokens the mode left out of the loss

    def metrics(self) -> dict[str, float]:
        return {f"rollout_corr/{name}": value for name, value in self.__dict__.items()}


def rollout_gap(
    *,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    correction: Correction,
) -> RolloutGap:
    """How far the behaviour policy is from the proximal one, and what ``correction`` did."""
    with torch.no_grad():
        old = old_logprobs.detach()
        k1 = kl_penalty(logprobs=rollout_logprobs, ref_logprobs=old, kind="k1")  # (B, T)
        k3 = kl_penalty(logprobs=rollout_logprobs, ref_logprobs=old, kind="k3")  # (B, T)
        rows = response_mask.any(dim=1)  # (B,)
        # exp(−mean log π_old) / exp(−mean log π_rollout) = exp(mean(log π_rollout − log π_old))
        row_ratio = torch.exp(masked_mean(k1, response_mask, dim=1).clamp(max=_LOG_RATIO_BOUND))
        real = response_mask.any()
        ratio_max = correction.ratio[response_mask].max() if real else torch.ones(())

        def share(mask: Tensor) -> float:
            return float(masked_mean(mask.to(old.dtype), response_mask))

        return RolloutGap(
            kl_k1=float(masked_mean(k1, response_mask)),
            kl_k3=float(masked_mean(k3, response_mask)),
            ppl_ratio=float(row_ratio[rows].mean()) if rows.any() else 1.0,
            is_weight_mean=float(masked_mean(correction.ratio, response_mask)) if real else 1.0,
            is_weight_max=float(ratio_max),
            clipped_fraction=share(correction.clipped_mask),
            masked_fraction=share(response_mask & ~correction.keep_mask),
        )
