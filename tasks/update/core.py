"""PPO losses: clipped policy loss (asymmetric + dual clip), clipped value loss, entropy, and
the aggregation of a (B, T) loss matrix into one scalar.

Aggregation modes (chosen through `AGGREGATIONS`) and their denominator:

| agg                   | loss                                             | denominator            |
|-----------------------|--------------------------------------------------|------------------------|
| `token-mean`          | Σ_b Σ_t ℓ_bt / N                                 | N = real tokens        |
| `seq-mean-token-sum`  | Σ_b (Σ_t ℓ_bt) / S                               | S = non-empty rows     |
| `seq-mean-token-mean` | Σ_b (Σ_t ℓ_bt / n_b) / S                         | S = non-empty rows     |

Every mode is a plain *sum* over rows divided by one number. When a mini-batch is split into
micro-batches, passing the mini-batch's denominator (`loss_denominator`) to each micro-batch
makes the accumulated gradient equal to the whole mini-batch's, whatever the split; passing
the global count across data-parallel workers makes N workers (gradients summed) equal one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tasks.kl import kl_penalty
from tasks.masks import masked_mean, masked_sum

__all__ = [
    "AGGREGATIONS",
    "ActorLossOutput",
    "PolicyLossOutput",
    "ValueLossOutput",
    "actor_loss",
    "aggregate_loss",
    "check_dual_clip",
    "count_loss_units",
    "entropy_from_logits",
    "ppo_policy_loss",
    "value_loss",
]

_LOG_RATIO_BOUND = 20.0


def _token_mean(loss_mat: Tensor, mask: Tensor, denominator: float) -> Tensor:
    return masked_sum(values=loss_mat, mask=mask) / denominator


def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, denominator: float) -> Tensor:
    return masked_sum(values=loss_mat, mask=mask, dim=1).sum() / denominator


def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, denominator: float) -> Tensor:
    per_row = masked_mean(values=loss_mat, mask=mask, dim=1)  # (B,); 0 for empty rows
    return per_row.sum() / denominator


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
}


def _check_agg(agg: str) -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {sorted(AGGREGATIONS)}")


def count_loss_units(*, response_mask: Tensor, agg: str) -> float:
    """The denominator of `agg` for this mask: real tokens (token-mean) or non-empty rows."""
    _check_agg(agg)
    if agg == "token-mean":
        return float(response_mask.sum())
    return float((response_mask.sum(dim=1) > 0).sum())


def aggregate_loss(
    *, loss_mat: Tensor, response_mask: Tensor, agg: str, loss_denominator: float | None = None
) -> Tensor:
    """Scalar loss from a (B, T) matrix; `loss_denominator` overrides this batch's own count.

    A denominator of 0 (no real tokens) is treated as 1, so the loss is 0, not NaN.
    """
    _check_agg(agg)
    if loss_denominator is None:
        loss_denominator = count_loss_units(response_mask=response_mask, agg=agg)
    return AGGREGATIONS[agg](loss_mat, response_mask, max(loss_denominator, 1.0))


@dataclass(frozen=True)
class PolicyLossOutput:
    """loss: scalar (differentiable); clipfrac, approx_kl: detached masked means over tokens."""

    loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor


def check_dual_clip(dual_clip: float | None) -> None:
    """The dual clip caps the loss of negative advantages at ``dual_clip`` times: > 1, or None."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")


def ppo_policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    agg: str,
    loss_denominator: float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate loss with an asymmetric clip and dual clip, optionally decoupled.

    1. ratio = exp(logprobs − old_logprobs) (log-ratio clamped to ±20).
    2. ℓ = max(−A·ratio, −A·clip(ratio, 1 − clip_low, 1 + clip_high)).
    3. Dual clip (A < 0 only): ℓ = min(ℓ, −A·dual_clip) caps the loss of a very large ratio.
    4. Decoupled PPO: ℓ = w·ℓ with ``is_weights`` w (B, T), detached, the correction of the
       proximal policy (old_logprobs) against the behaviour policy that sampled the tokens
       (``tasks.update.correction``); None = 1.
    5. Aggregate; clipfrac = share of real tokens where the clipped term won;
       approx_kl = mean(old_logprobs − logprobs) over real tokens.
    """
    check_dual_clip(dual_clip)
    # 1.
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    # 2.
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    loss_mat = torch.maximum(unclipped, clipped)  # (B, T)
    # 3.
    if dual_clip is not None:
        capped = torch.minimum(loss_mat, -advantages * dual_clip)  # (B, T)
        loss_mat = torch.where(advantages < 0, capped, loss_mat)
    # 4.
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()  # (B, T)
    # 5.
    loss = aggregate_loss(
        loss_mat=loss_mat, response_mask=response_mask, agg=agg, loss_denominator=loss_denominator
    )
    with torch.no_grad():
        clipfrac = masked_mean(values=(clipped > unclipped).to(loss.dtype), mask=response_mask)
        approx_kl = masked_mean(values=-log_ratio, mask=response_mask)
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl)


@dataclass(frozen=True)
class ValueLossOutput:
    """loss: scalar (differentiable); clipfrac: share of real tokens where the clipped term won."""

    loss: Tensor
    clipfrac: Tensor


def value_loss(
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float | None,
    agg: str,
    loss_denominator: float | None = None,
) -> ValueLossOutput:
    """½ · max((V − R)², (V_clip − R)²) with V_clip = V_old + clip(V − V_old, ±clip_range).

    `clip_range=None` gives the plain ½ (V − R)².
    """
    unclipped = (values - returns).square()  # (B, T)
    if clip_range is None:
        clipped = unclipped
    else:
        # clamp into [V_old − c, V_old + c]: exactly V inside the range, so clipfrac counts
        # only tokens that were really clipped (old + (V − old) can differ from V by rounding).
        values_clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
        clipped = (values_clipped - returns).square()  # (B, T)
    loss_mat = 0.5 * torch.maximum(unclipped, clipped)  # (B, T)
    loss = aggregate_loss(
        loss_mat=loss_mat, response_mask=response_mask, agg=agg, loss_denominator=loss_denominator
    )
    with torch.no_grad():
        clipfrac = masked_mean(values=(clipped > unclipped).to(loss.dtype), mask=response_mask)
    return ValueLossOutput(loss=loss, clipfrac=clipfrac)


def entropy_from_logits(*, logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) − Σ softmax(z)·z.  (…, V) → (…)"""
    probs = torch.softmax(logits, dim=-1)  # (…, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


@dataclass(frozen=True)
class ActorLossOutput:
    """loss = pg_loss − entropy_coef·entropy + kl_loss_coef·kl_loss (differentiable scalar).

    The other fields are detached: pg_loss, entropy and kl_loss aggregated like the loss;
    clipfrac and approx_kl as in `PolicyLossOutput`.
    """

    loss: Tensor
    pg_loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor
    entropy: Tensor
    kl_loss: Tensor


def actor_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    agg: str,
    entropy_coef: float,
    kl_loss_coef: float,
    kl_loss_kind: str,
    loss_denominator: float | None = None,
    is_weights: Tensor | None = None,
) -> ActorLossOutput:
    """PPO policy loss plus an optional entropy bonus and a KL-to-reference loss term.

    entropy (B, T) is needed when entropy_coef ≠ 0 and ref_logprobs (B, T) when
    kl_loss_coef ≠ 0; both terms use the same aggregation and denominator as the policy loss.
    is_weights (B, T) weight the policy loss only (see `ppo_policy_loss`).
    """
    policy = ppo_policy_loss(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        agg=agg,
        loss_denominator=loss_denominator,
        is_weights=is_weights,
    )
    total = policy.loss
    zero = torch.zeros((), dtype=total.dtype, device=total.device)
    entropy_term, kl_term = zero, zero
    if entropy is not None:
        entropy_term = aggregate_loss(
            loss_mat=entropy,
            response_mask=response_mask,
            agg=agg,
            loss_denominator=loss_denominator,
        )
        total = total - entropy_coef * entropy_term
    elif entropy_coef != 0.0:
        raise ValueError("entropy_coef is set but no entropy (B, T) was given to actor_loss")
    if ref_logprobs is not None:
        kl_mat = kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, kind=kl_loss_kind)
        kl_term = aggregate_loss(
            loss_mat=kl_mat, response_mask=response_mask, agg=agg, loss_denominator=loss_denominator
        )
        total = total + kl_loss_coef * kl_term
    elif kl_loss_coef != 0.0:
        raise ValueError("kl_loss_coef is set but no ref_logprobs (B, T) were given to actor_loss")
    return ActorLossOutput(
        loss=total,
        pg_loss=policy.loss.detach(),
        clipfrac=policy.clipfrac,
        approx_kl=policy.approx_kl,
        entropy=entropy_term.detach(),
        kl_loss=kl_term.detach(),
    )
