"""Advantage estimators: GAE, GRPO, RLOO and REINFORCE++ (pure torch, no autograd).

Shapes: B samples, T response tokens, G groups. Masks are bool, True = real token.

Masked tokens are *skipped*, not treated as episode ends: a masked position between two real
tokens is as if absent, so the recursion links each real token to the next real one (the real
tokens of each row are packed to the left before the discounted sums, then put back). Values,
rewards and advantages at masked positions are ignored on input and are 0 on output.

Every estimator returns `AdvantageOutput`. Each is registered once, as an `EstimatorSpec` in
`ESTIMATORS` (by name): its function, the fields it reads (vocabulary of DESIGN.md) and the run
config settings it takes; `run_estimator` runs one by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tasks.masks import masked_whiten

__all__ = [
    "ESTIMATORS",
    "AdvantageOutput",
    "EstimatorSettings",
    "EstimatorSpec",
    "discounted_reverse_cumsum",
    "gae",
    "grpo_advantage",
    "reinforce_pp_advantage",
    "rloo_advantage",
    "run_estimator",
]


@dataclass(frozen=True)
class AdvantageOutput:
    """advantages (B, T) — whitened when asked; returns (B, T) — the regression target.

    Both are 0 at masked positions. Outcome estimators (GRPO, RLOO) have no value baseline to
    add back: their returns are their advantages (the same tensor).
    """

    advantages: Tensor
    returns: Tensor


def _check_token_tensors(response_mask: Tensor, **tensors: Tensor) -> None:
    if response_mask.dtype != torch.bool:
        raise TypeError(
            f"response_mask must be bool (True = real token), got {response_mask.dtype}"
        )
    for name, tensor in tensors.items():
        if tensor.shape != response_mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, response_mask has "
                f"{tuple(response_mask.shape)}: they must match (B, T)"
            )


def _check_discount(*, gamma: float, lam: float) -> None:
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")


def discounted_reverse_cumsum(*, values: Tensor, factor: float, chunk: int = 64) -> Tensor:
    """y[:, t] = Σ_{s ≥ t} factor^(s − t) · values[:, s], i.e. y_t = x_t + factor · y_{t+1}.

    A chunked matrix form instead of T sequential steps:
    1. Split T into C chunks of K; within a chunk y = x @ Mᵀ with M[t, s] = factor^(s − t), s ≥ t.
    2. Each chunk's first entry also collects factor^K · (next chunk's first entry): a scan
       over the C chunks only.
    3. Every position t of chunk c adds factor^(K − t) · (chunk c + 1's first entry).
    Powers stay below factor^K, so nothing over- or underflows for factor in [0, 1].
    """
    batch, width = values.shape
    if width == 0:
        return values.clone()
    size = min(chunk, width)
    n_chunks = -(-width // size)
    if n_chunks * size != width:
        values = torch.nn.functional.pad(values, (0, n_chunks * size - width))  # (B, C·K)
    x = values.reshape(batch, n_chunks, size)  # (B, C, K)
    # 1.
    offsets = torch.arange(size, device=values.device)
    gap = (offsets.unsqueeze(0) - offsets.unsqueeze(1)).to(values.dtype)  # (K, K): s − t
    base = torch.tensor(factor, dtype=values.dtype, device=values.device)
    powers = torch.where(gap >= 0, base.pow(gap.clamp(min=0)), 0.0)  # (K, K)
    out = x @ powers.t()  # (B, C, K)
    # 2.
    heads = out[:, :, 0].t().contiguous()  # (C, B)
    span = float(base.pow(size))
    for c in range(n_chunks - 2, -1, -1):
        heads[c].add_(heads[c + 1], alpha=span)
    next_heads = torch.cat([heads[1:], heads.new_zeros(1, batch)]).t()  # (B, C)
    # 3.
    tail = base.pow((size - offsets).to(values.dtype))  # (K,): factor^(K − t)
    out.addcmul_(next_heads.unsqueeze(2), tail)  # (B, C, K)
    return out.reshape(batch, n_chunks * size)[:, :width]


@dataclass(frozen=True)
class _Compaction:
    """Where each real token goes when a row's real tokens are packed to the left."""

    index: Tensor  # (B, T) long: packed column of a real token; T (a discarded column) if masked
    packed_mask: Tensor  # (B, T) bool: the first `length` columns of each row
    identity: bool  # the mask is already packed (right padding only)


def _compaction(response_mask: Tensor) -> _Compaction:
    width = response_mask.shape[1]
    lengths = torch.count_nonzero(response_mask, dim=1)  # (B,)
    positions = torch.arange(width, device=response_mask.device)
    packed_mask = positions.unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
    if torch.equal(packed_mask, response_mask):
        return _Compaction(
            index=positions.expand_as(response_mask), packed_mask=packed_mask, identity=True
        )
    index = torch.where(response_mask, response_mask.cumsum(dim=1) - 1, width)  # (B, T)
    return _Compaction(index=index, packed_mask=packed_mask, identity=False)


def _pack(x: Tensor, plan: _Compaction) -> Tensor:
    """(B, T) → (B, T) with each row's real tokens moved to the left, in order."""
    if plan.identity:
        return x
    dump = x.new_zeros(x.shape[0], x.shape[1] + 1)  # (B, T + 1); column T collects masked ones
    return dump.scatter_(1, plan.index, x)[:, : x.shape[1]]


def _unpack(x: Tensor, plan: _Compaction, response_mask: Tensor) -> Tensor:
    """Inverse of `_pack` for an x that is 0 beyond each row's real tokens; masked positions 0."""
    if plan.identity or x.shape[1] == 0:
        return x
    back = x.gather(1, plan.index.clamp(max=x.shape[1] - 1))  # (B, T)
    return back.masked_fill_(~response_mask, 0.0)


def gae(
    *,
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> AdvantageOutput:
    """Generalised advantage estimation over the real tokens of each row.

    1. Pack each row's real tokens to the left (skips holes; a no-op for right padding).
    2. δ_t = r_t + γ·V_{t+1} − V_t over the packed tokens (V after the last one is 0).
    3. A_t = Σ_{s ≥ t} (γλ)^(s − t) δ_s (`discounted_reverse_cumsum`), unpacked back.
    4. returns = A + V (unwhitened); A optionally whitened over all real tokens of the batch.
    """
    _check_token_tensors(response_mask, token_rewards=token_rewards, values=values)
    _check_discount(gamma=gamma, lam=lam)
    with torch.no_grad():
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        # 1.
        plan = _compaction(response_mask)
        rewards = _pack(token_rewards, plan)  # (B, T)
        packed_values = _pack(values, plan)  # (B, T)
        real = plan.packed_mask  # (B, T)
        # 2.
        packed_values = torch.where(real, packed_values, zero)  # (B, T); 0 past the end
        deltas = rewards.masked_fill(~real, 0.0).sub_(packed_values)  # (B, T): r_t − V_t
        deltas[:, :-1].add_(packed_values[:, 1:], alpha=gamma)  # + γ·V_{t+1}
        # 3.
        packed_advantages = discounted_reverse_cumsum(values=deltas, factor=gamma * lam)
        advantages = _unpack(packed_advantages, plan, response_mask)  # (B, T)
        # 4.
        returns = torch.where(response_mask, advantages + values, zero)  # (B, T)
        if whiten:
            advantages = masked_whiten(advantages, response_mask)
        return AdvantageOutput(advantages=advantages, returns=returns)


@dataclass(frozen=True)
class _GroupStats:
    inverse: Tensor  # (B,) group index of each sample
    count: Tensor  # (G,)
    mean: Tensor  # (G,)
    degenerate: Tensor  # (G,) bool: one sample, or all scores equal


def _group_stats(*, scores: Tensor, group_ids: Tensor) -> _GroupStats:
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must both be (B,), got {tuple(scores.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)  # (G,)
    count.index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, inverse, scores)  # (G,)
    high = torch.full_like(count, -torch.inf).scatter_reduce_(0, inverse, scores, "amax")  # (G,)
    low = torch.full_like(count, torch.inf).scatter_reduce_(0, inverse, scores, "amin")  # (G,)
    return _GroupStats(
        inverse=inverse, count=count, mean=total / count, degenerate=(count < 2) | (high == low)
    )


def _broadcast_over_tokens(per_sample: Tensor, response_mask: Tensor) -> Tensor:
    zero = torch.zeros((), dtype=per_sample.dtype, device=per_sample.device)
    return torch.where(response_mask, per_sample.unsqueeze(1), zero)  # (B, T)


def grpo_advantage(
    *,
    scores: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """(score − group mean) [/ (group std + eps)], broadcast over real tokens (B, T); the
    returns are the advantages.

    std is the unbiased sample std of the group. A group of one, or one whose scores are all
    equal, gets exactly 0 (never NaN). group_ids (B,) are any integer labels.
    """
    _check_token_tensors(response_mask)
    with torch.no_grad():
        stats = _group_stats(scores=scores, group_ids=group_ids)
        centered = scores - stats.mean[stats.inverse]  # (B,)
        if norm_by_std:
            squares = torch.zeros_like(stats.count).index_add_(0, stats.inverse, centered**2)
            std = (squares / (stats.count - 1).clamp(min=1)).sqrt()  # (G,)
            centered = centered / (std[stats.inverse] + eps)
        per_sample = torch.where(stats.degenerate[stats.inverse], 0.0, centered)  # (B,)
        advantages = _broadcast_over_tokens(per_sample, response_mask)  # (B, T)
        return AdvantageOutput(advantages=advantages, returns=advantages)


def rloo_advantage(*, scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> AdvantageOutput:
    """score − mean of the *other* samples of its group, broadcast over real tokens (B, T); the
    returns are the advantages.

    Equals n/(n−1)·(score − group mean); a group of one gets 0.
    """
    _check_token_tensors(response_mask)
    with torch.no_grad():
        stats = _group_stats(scores=scores, group_ids=group_ids)
        count = stats.count[stats.inverse]  # (B,)
        others_total = stats.mean[stats.inverse] * count - scores  # (B,)
        baseline = others_total / (count - 1).clamp(min=1)  # (B,)
        per_sample = torch.where(count < 2, 0.0, scores - baseline)  # (B,)
        advantages = _broadcast_over_tokens(per_sample, response_mask)  # (B, T)
        return AdvantageOutput(advantages=advantages, returns=advantages)


def reinforce_pp_advantage(
    *, token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0, whiten: bool = True
) -> AdvantageOutput:
    """REINFORCE++: discounted return G_t = r_t + γ·G_next(t) over real tokens (masked ones are
    skipped), whitened over all real tokens of the batch. returns = G (unwhitened)."""
    _check_token_tensors(response_mask, token_rewards=token_rewards)
    _check_discount(gamma=gamma, lam=1.0)
    with torch.no_grad():
        plan = _compaction(response_mask)
        rewards = _pack(token_rewards, plan).masked_fill(~plan.packed_mask, 0.0)  # (B, T)
        packed_returns = discounted_reverse_cumsum(values=rewards, factor=gamma)
        returns = _unpack(packed_returns, plan, response_mask)  # (B, T)
        advantages = masked_whiten(returns, response_mask) if whiten else returns
        return AdvantageOutput(advantages=advantages, returns=returns)


class EstimatorSettings(Protocol):
    """The run config attributes estimators read: `infra.config.AlgorithmConfig` satisfies it."""

    @property
    def gamma(self) -> float: ...
    @property
    def lam(self) -> float: ...
    @property
    def whiten_advantages(self) -> bool: ...
    @property
    def norm_by_std(self) -> bool: ...


@dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator, registered once in `ESTIMATORS`.

    name: the run config's `algorithm.estimator` value.
    fn: the keyword-only estimator function; it returns `AdvantageOutput`.
    inputs: the fields it reads (vocabulary of DESIGN.md), passed as keywords of the same name.
    settings: its other keywords, each mapped to the `EstimatorSettings` attribute that gives
        it (`{"whiten": "whiten_advantages"}`: `whiten` is `algorithm.whiten_advantages`).
    """

    name: str
    fn: Callable[..., AdvantageOutput]
    inputs: tuple[str, ...]
    settings: Mapping[str, str]


ESTIMATORS: dict[str, EstimatorSpec] = {
    spec.name: spec
    for spec in (
        EstimatorSpec(
            name="gae",
            fn=gae,
            inputs=("token_rewards", "values", "response_mask"),
            settings={"gamma": "gamma", "lam": "lam", "whiten": "whiten_advantages"},
        ),
        EstimatorSpec(
            name="grpo",
            fn=grpo_advantage,
            inputs=("scores", "group_ids", "response_mask"),
            settings={"norm_by_std": "norm_by_std"},
        ),
        EstimatorSpec(
            name="rloo",
            fn=rloo_advantage,
            inputs=("scores", "group_ids", "response_mask"),
            settings={},
        ),
        EstimatorSpec(
            name="reinforce_plus_plus",
            fn=reinforce_pp_advantage,
            inputs=("token_rewards", "response_mask"),
            settings={"gamma": "gamma", "whiten": "whiten_advantages"},
        ),
    )
}


def run_estimator(
    name: str, *, tensors: Mapping[str, Tensor], settings: EstimatorSettings
) -> AdvantageOutput:
    """The estimator `name` on its `inputs` from `tensors`, with its keyword settings read from
    `settings` (the run config's `algorithm` section)."""
    spec = ESTIMATORS.get(name)
    if spec is None:
        raise ValueError(f"unknown estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    kwargs = {field: tensors[field] for field in spec.inputs}
    kwargs.update({arg: getattr(settings, key) for arg, key in spec.settings.items()})
    return spec.fn(**kwargs)
