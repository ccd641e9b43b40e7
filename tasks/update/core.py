"""PPO-family losses: the policy losses (`POLICY_LOSSES`: PPO's clipped ratio, GSPO, CISPO,
SAPO), the clipped value loss, entropy, and the aggregation of a (B, T) loss matrix into one
scalar.

Policy losses (chosen through `POLICY_LOSSES` by ``actor.policy_loss``), r = π_θ / π_old per
token; each returns a `PolicyLossOutput` and takes the same inputs, aggregation and denominator:

| policy_loss | per-token loss ℓ                                    | clipfrac                        |
|-------------|-----------------------------------------------------|---------------------------------|
| `ppo`       | max(−A·r, −A·clip(r)); dual clip for A < 0          | share of tokens clipped         |
| `gspo`      | as `ppo` with the row's geometric-mean ratio for r  | share of tokens in clipped rows |
| `cispo`     | −sg(clip(r))·A·log π                                | share of weights clipped        |
| `sapo`      | −A·(4/τ)·σ(τ·(r − 1))                               | mean share the gate removes     |

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
Every policy loss keeps this: its terms are per row (GSPO's ratio is its row's), and a row is
never split across micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tasks.kl import kl_penalty
from tasks.masks import masked_mean, masked_sum

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "ActorLossOutput",
    "PolicyLoss",
    "PolicyLossOutput",
    "PolicyLossSettings",
    "ValueLossOutput",
    "actor_loss",
    "aggregate_loss",
    "check_dual_clip",
    "cispo_policy_loss",
    "count_loss_units",
    "entropy_from_logits",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "sapo_policy_loss",
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


def _log_ratio(*, logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """log π_θ − log π_old per token, clamped to ±20 so its exp stays finite.  (B, T)"""
    return (logprobs - old_logprobs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """max(−A·ratio, −A·clip(ratio, 1 − clip_low, 1 + clip_high)) per token, and where the
    clipped term won.  (B, T), (B, T) bool"""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _weigh_and_aggregate(
    *,
    loss_mat: Tensor,
    clipped: Tensor,
    log_ratio: Tensor,
    response_mask: Tensor,
    agg: str,
    loss_denominator: float | None,
    is_weights: Tensor | None,
) -> PolicyLossOutput:
    """The last steps every policy loss shares: ℓ·w with the detached ``is_weights`` w (None = 1),
    the aggregation, and the detached metrics: clipfrac = mean of ``clipped`` (B, T) (bool, or a
    share in [0, 1]) over real tokens, approx_kl = mean(−log_ratio) over real tokens."""
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()  # (B, T)
    loss = aggregate_loss(
        loss_mat=loss_mat, response_mask=response_mask, agg=agg, loss_denominator=loss_denominator
    )
    with torch.no_grad():
        clipfrac = masked_mean(values=clipped.detach().to(loss.dtype), mask=response_mask)
        approx_kl = masked_mean(values=-log_ratio.detach(), mask=response_mask)
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl)


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
    log_ratio = _log_ratio(logprobs=logprobs, old_logprobs=old_logprobs)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    # 2.
    loss_mat, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)  # (B, T) x2
    # 3.
    if dual_clip is not None:
        capped = torch.minimum(loss_mat, -advantages * dual_clip)  # (B, T)
        loss_mat = torch.where(advantages < 0, capped, loss_mat)
    # 4. and 5.
    return _weigh_and_aggregate(
        loss_mat=loss_mat,
        clipped=clipped,
        log_ratio=log_ratio,
        response_mask=response_mask,
        agg=agg,
        loss_denominator=loss_denominator,
        is_weights=is_weights,
    )


def gspo_policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    agg: str,
    loss_denominator: float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): one importance ratio per sequence, the
    geometric mean of its token ratios, clipped per sequence; written per token (the paper's
    GSPO-token form), so a per-token advantage weights its own token.

    1. log r = logprobs − old_logprobs per token (clamped to ±20); the row's
       log s = mean of log r over its real tokens (``response_mask``), s = (Π r)^(1/n).
    2. s_t = exp(sg(log s) + logprobs − sg(logprobs)): s in value on every token of the row,
       gradient s·∇log π_t. With one advantage per row and `seq-mean-token-mean` this is the
       paper's sequence objective in value and gradient; a one-token row is `ppo_policy_loss`.
    3. ℓ = max(−A·s_t, −A·clip(s_t, 1 − clip_low, 1 + clip_high)): a row is clipped whole.
    4. ℓ = w·ℓ with the detached ``is_weights`` w (as `ppo_policy_loss`).
    5. Aggregate; clipfrac = share of real tokens whose (row's) clipped term won;
       approx_kl = mean(old_logprobs − logprobs) over real tokens.

    No dual clip: the paper has none. A row never spans micro-batches, so step 1 is the same
    in any split.
    """
    # 1.
    log_ratio = _log_ratio(logprobs=logprobs, old_logprobs=old_logprobs)  # (B, T)
    seq_log_ratio = masked_mean(values=log_ratio, mask=response_mask, dim=1)  # (B,); 0 if empty
    # 2.
    token_log_ratio = seq_log_ratio.detach().unsqueeze(1) + logprobs - logprobs.detach()  # (B, T)
    seq_ratio = torch.exp(token_log_ratio)  # (B, T)
    # 3.
    loss_mat, clipped = _clipped_surrogate(seq_ratio, advantages, clip_low, clip_high)
    # 4. and 5.
    return _weigh_and_aggregate(
        loss_mat=loss_mat,
        clipped=clipped,
        log_ratio=log_ratio,
        response_mask=response_mask,
        agg=agg,
        loss_denominator=loss_denominator,
        is_weights=is_weights,
    )


def cispo_policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float | None,
    clip_high: float,
    agg: str,
    loss_denominator: float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight is clipped and detached and
    multiplies the log-prob, so every token keeps a gradient (PPO's clip zeroes a clipped
    token's gradient; CISPO only bounds its weight).

    1. ratio = exp(logprobs − old_logprobs) (log-ratio clamped to ±20).
    2. ŵ = sg(clip(ratio, 1 − clip_low, 1 + clip_high)); clip_low None = no lower bound.
    3. ℓ = −ŵ·A·logprobs: gradient −ŵ·A·∇log π on every token (the loss value holds log π, so
       it is not comparable with the ratio losses' values).
    4. ℓ = w·ℓ with the detached ``is_weights`` w (as `ppo_policy_loss`).
    5. Aggregate; clipfrac = share of real tokens whose weight was clipped;
       approx_kl = mean(old_logprobs − logprobs) over real tokens.
    """
    # 1.
    log_ratio = _log_ratio(logprobs=logprobs, old_logprobs=old_logprobs)  # (B, T)
    ratio = torch.exp(log_ratio).detach()  # (B, T)
    # 2.
    low = None if clip_low is None else 1.0 - clip_low
    weight = ratio.clamp(low, 1.0 + clip_high)  # (B, T)
    # 3.
    loss_mat = -weight * advantages * logprobs  # (B, T)
    # 4. and 5.
    return _weigh_and_aggregate(
        loss_mat=loss_mat,
        clipped=weight != ratio,
        log_ratio=log_ratio,
        response_mask=response_mask,
        agg=agg,
        loss_denominator=loss_denominator,
        is_weights=is_weights,
    )


def sapo_policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    tau_pos: float,
    tau_neg: float,
    agg: str,
    loss_denominator: float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a smooth gate of the token ratio in place of
    PPO's hard clip, with its own temperature for positive and for other advantages.

    1. ratio = exp(logprobs − old_logprobs) (log-ratio clamped to ±20).
    2. τ = tau_pos where A > 0, else tau_neg.
    3. ℓ = −A·f(ratio), f(r) = (4/τ)·σ(τ·(r − 1)). Its gradient is −A·g·r·∇log π with the
       gate g = 4·σ·(1 − σ) ∈ (0, 1]: 1 at r = 1 (the plain policy gradient), falling smoothly
       as r leaves 1, faster for a larger τ.
    4. ℓ = w·ℓ with the detached ``is_weights`` w (as `ppo_policy_loss`).
    5. Aggregate; clipfrac = mean of 1 − g over real tokens, the share of the gradient the gate
       removes (0 on-policy; PPO's clipfrac is the same share with g ∈ {0, 1});
       approx_kl = mean(old_logprobs − logprobs) over real tokens.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    # 1.
    log_ratio = _log_ratio(logprobs=logprobs, old_logprobs=old_logprobs)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    # 2.
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)  # (B, T)
    # 3.
    sigma = torch.sigmoid(tau * (ratio - 1.0))  # (B, T)
    loss_mat = -advantages * (4.0 / tau) * sigma  # (B, T)
    # 4. and 5.
    return _weigh_and_aggregate(
        loss_mat=loss_mat,
        clipped=1.0 - 4.0 * sigma * (1.0 - sigma),
        log_ratio=log_ratio,
        response_mask=response_mask,
        agg=agg,
        loss_denominator=loss_denominator,
        is_weights=is_weights,
    )


# A policy loss with its settings bound: called with logprobs, old_logprobs, advantages,
# response_mask, agg, loss_denominator and is_weights (keywords, as `ppo_policy_loss`).
PolicyLoss = Callable[..., PolicyLossOutput]


@dataclass(frozen=True, kw_only=True)
class PolicyLossSettings:
    """The policy loss (a `POLICY_LOSSES` name) and every loss's settings, named as the config's
    ``actor.*`` fields (the one place their values and defaults live); each loss reads its own."""

    policy_loss: str
    clip_low: float
    clip_high: float
    dual_clip: float | None
    gspo_clip_low: float
    gspo_clip_high: float
    cispo_clip_low: float | None
    cispo_clip_high: float
    sapo_tau_pos: float
    sapo_tau_neg: float

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"policy_loss {self.policy_loss!r} is not one of {sorted(POLICY_LOSSES)}"
            )
        check_dual_clip(self.dual_clip)
        if self.sapo_tau_pos <= 0 or self.sapo_tau_neg <= 0:
            raise ValueError(
                f"sapo_tau_pos and sapo_tau_neg must be > 0, got {self.sapo_tau_pos}, "
                f"{self.sapo_tau_neg}"
            )

    def bind(self) -> PolicyLoss:
        """The chosen loss with its own settings bound."""
        return POLICY_LOSSES[self.policy_loss](self)


# One row per policy loss: the function and the settings it reads.
POLICY_LOSSES: dict[str, Callable[[PolicyLossSettings], PolicyLoss]] = {
    "ppo": lambda s: functools.partial(
        ppo_policy_loss, clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip
    ),
    "gspo": lambda s: functools.partial(
        gspo_policy_loss, clip_low=s.gspo_clip_low, clip_high=s.gspo_clip_high
    ),
    "cispo": lambda s: functools.partial(
        cispo_policy_loss, clip_low=s.cispo_clip_low, clip_high=s.cispo_clip_high
    ),
    "sapo": lambda s: functools.partial(
        sapo_policy_loss, tau_pos=s.sapo_tau_pos, tau_neg=s.sapo_tau_neg
    ),
}


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


def _require_terms(
    *, entropy: Tensor | None, entropy_coef: float, ref: Tensor | None, kl: float
) -> None:
    """The inputs the coefficients ask for: the entropy, the reference's log-probs."""
    if entropy is None and entropy_coef != 0.0:
        raise ValueError("entropy_coef is set but no entropy (B, T) was given to actor_loss")
    if ref is None and kl != 0.0:
        raise ValueError("kl_loss_coef is set but no ref_logprobs (B, T) were given to actor_loss")


def actor_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    policy: PolicyLossSettings,
    agg: str,
    entropy_coef: float,
    kl_loss_coef: float,
    kl_loss_kind: str,
    loss_denominator: float | None = None,
    is_weights: Tensor | None = None,
) -> ActorLossOutput:
    """The policy loss ``policy`` chooses (`POLICY_LOSSES`) plus an optional entropy bonus and a
    KL-to-reference loss term.

    entropy (B, T) is needed when entropy_coef ≠ 0 and ref_logprobs (B, T) when
    kl_loss_coef ≠ 0; both terms use the same aggregation and denominator as the policy loss.
    is_weights (B, T) weight the policy loss only (see `ppo_policy_loss`).

    1. The policy loss. 2. Minus ``entropy_coef`` × the entropy. 3. Plus ``kl_loss_coef`` × the
    KL to the reference (``kl_loss_kind``).
    """
    _require_terms(entropy=entropy, entropy_coef=entropy_coef, ref=ref_logprobs, kl=kl_loss_coef)
    masked: dict[str, Any] = dict(
        response_mask=response_mask, agg=agg, loss_denominator=loss_denominator
    )
    term = functools.partial(aggregate_loss, **masked)
    # 1.
    pg = policy.bind()(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        is_weights=is_weights,
        **masked,
    )
    total = pg.loss
    entropy_term = kl_term = torch.zeros((), dtype=total.dtype, device=total.device)
    # 2.
    if entropy is not None:
        entropy_term = term(loss_mat=entropy)
        total = total - entropy_coef * entropy_term
    # 3.
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, kind=kl_loss_kind)
        kl_term = term(loss_mat=kl)
        total = total + kl_loss_coef * kl_term
    return ActorLossOutput(
        loss=total,
        pg_loss=pg.loss.detach(),
        clipfrac=pg.clipfrac,
        approx_kl=pg.approx_kl,
        entropy=entropy_term.detach(),
        kl_loss=kl_term.detach(),
    )
