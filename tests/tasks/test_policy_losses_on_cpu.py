"""The policy losses (GSPO, CISPO, SAPO beside PPO): hand-worked values, and invariants every loss
keeps: the plain policy gradient on-policy, masked tokens ignored, importance weights, splits."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, get_args

import pytest
import torch
from torch import Tensor

from infra.config import PolicyLossKind
from tasks.update import (
    AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossOutput,
    PolicyLossSettings,
    actor_loss,
    cispo_policy_loss,
    count_loss_units,
    gspo_policy_loss,
    ppo_policy_loss,
    sapo_policy_loss,
)

# Every loss's settings (the config's defaults but for a wider GSPO clip, which a random ratio
# would otherwise leave almost nowhere unclipped).
SETTINGS: dict[str, Any] = {
    "clip_low": 0.2,
    "clip_high": 0.28,
    "dual_clip": 3.0,
    "gspo_clip_low": 0.05,
    "gspo_clip_high": 0.08,
    "cispo_clip_low": None,
    "cispo_clip_high": 0.2,
    "sapo_tau_pos": 1.0,
    "sapo_tau_neg": 1.05,
}


def bound(name: str, **changes: Any) -> Callable[..., PolicyLossOutput]:
    """The loss ``name`` with `SETTINGS` (and ``changes``) bound, as `actor_loss` calls it."""
    return PolicyLossSettings(policy_loss=name, **{**SETTINGS, **changes}).bind()


def random_inputs(seed: int, batch: int = 6, width: int = 7) -> dict[str, Tensor]:
    """float64 inputs with an empty row, a row with holes and per-token advantages."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    lengths[0] = 0
    mask = torch.arange(width) < lengths.unsqueeze(1)  # (B, T)
    mask[2] &= torch.rand(width, generator=generator) > 0.4  # a row with holes
    old = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 3  # (B, T)
    return {
        "logprobs": old + torch.randn(batch, width, generator=generator, dtype=torch.float64) * 0.3,
        "old_logprobs": old,
        "advantages": torch.randn(batch, width, generator=generator, dtype=torch.float64),
        "response_mask": mask,
    }


def loss_and_grad(
    loss: Callable[..., PolicyLossOutput], inputs: dict[str, Tensor], **kwargs: Any
) -> tuple[PolicyLossOutput, Tensor]:
    """The loss's output and its gradient with respect to ``logprobs``."""
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    out = loss(**{**inputs, "logprobs": logprobs}, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    return out, grad


# ----------------------------------------------------------------------------- hand-worked


def test_gspo_hand_worked_one_ratio_per_row() -> None:
    # Clip [0.9, 1.1]. Row 0: log-ratios 0.3, 0.1, 0.2 → log s = 0.2, s = e^0.2 = 1.2214; A = +1
    #   on every token: max(−1.2214, −1.1) = −1.1, the clip wins on all 3 tokens (no gradient).
    # Row 1: log-ratios −0.05, 0.15 and a padded third token (log-ratio 5, not counted) →
    #   log s = 0.05, s = e^0.05 = 1.05127, inside the clip; A = −2: ℓ = 2·1.05127 = 2.10254.
    # token-mean over 5 real tokens: (3·(−1.1) + 2·2.10254) / 5 = 0.181017; clipfrac 3/5;
    # approx_kl = −(0.3 + 0.1 + 0.2 − 0.05 + 0.15) / 5 = −0.14.
    # Gradient: 0 on row 0 (clipped), −A·s / 5 = 2·1.05127 / 5 on row 1's real tokens.
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[0.3, 0.1, 0.2], [-0.05, 0.15, 5.0]], dtype=torch.float64)
    inputs = {
        "logprobs": old + log_ratio,
        "old_logprobs": old,
        "advantages": torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64),
        "response_mask": torch.tensor([[True, True, True], [True, True, False]]),
    }
    out, grad = loss_and_grad(
        gspo_policy_loss, inputs, clip_low=0.1, clip_high=0.1, agg="token-mean"
    )
    s1 = math.exp(0.05)
    assert out.loss.item() == pytest.approx((3 * -1.1 + 2 * 2 * s1) / 5, abs=1e-12)
    assert out.clipfrac.item() == pytest.approx(3 / 5, abs=1e-12)
    assert out.approx_kl.item() == pytest.approx(-0.14, abs=1e-12)
    expected = torch.tensor([[0.0, 0.0, 0.0], [2 * s1 / 5, 2 * s1 / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def test_cispo_hand_worked_every_token_keeps_a_gradient() -> None:
    # log π = −1, −2, −0.5 with ratios 1.5, 0.5, 1 and A = +1, +1, −1; weight cap 1 + 0.2.
    # No lower bound: weights 1.2 (clipped), 0.5, 1.  ℓ = −ŵ·A·log π = 1.2, 1.0, −0.5;
    # token-mean 1.7 / 3; clipfrac 1/3; gradient −ŵ·A / 3 = −1.2/3, −0.5/3, +1/3 (the clipped
    # token keeps one).
    # A lower bound of 0.2 clips 0.5 up to 0.8: ℓ = 1.2, 1.6, −0.5; clipfrac 2/3.
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    inputs = {
        "logprobs": logprobs,
        "old_logprobs": logprobs
        - torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], dtype=torch.float64),
        "advantages": torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64),
        "response_mask": torch.ones(1, 3, dtype=torch.bool),
    }
    out, grad = loss_and_grad(
        cispo_policy_loss, inputs, clip_low=None, clip_high=0.2, agg="token-mean"
    )
    assert out.loss.item() == pytest.approx(1.7 / 3, abs=1e-12)
    assert out.clipfrac.item() == pytest.approx(1 / 3, abs=1e-12)
    expected = torch.tensor([[-1.2 / 3, -0.5 / 3, 1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    bounded = cispo_policy_loss(**inputs, clip_low=0.2, clip_high=0.2, agg="token-mean")
    assert bounded.loss.item() == pytest.approx((1.2 + 1.6 - 0.5) / 3, abs=1e-12)
    assert bounded.clipfrac.item() == pytest.approx(2 / 3, abs=1e-12)


def test_sapo_hand_worked_soft_gate() -> None:
    # Token 0: ratio 1, A = +1, τ_pos = 1: ℓ = −1·(4/1)·σ(0) = −2; gate g = 4·½·½ = 1.
    # Token 1: ratio 2, A = −1, τ_neg = 2: σ(2·1) = 0.880797, ℓ = +1·(4/2)·0.880797 = 1.761594;
    #   g = 4·0.880797·0.119203 = 0.419974.
    # token-mean (−2 + 1.761594) / 2; clipfrac = mean(1 − g) = (0 + 0.580026) / 2;
    # gradient −A·g·ratio / 2 = −0.5 and +0.419974·2 / 2.
    logprobs = torch.tensor([[-0.4, -1.0]], dtype=torch.float64)
    inputs = {
        "logprobs": logprobs,
        "old_logprobs": logprobs - torch.tensor([[0.0, math.log(2.0)]], dtype=torch.float64),
        "advantages": torch.tensor([[1.0, -1.0]], dtype=torch.float64),
        "response_mask": torch.ones(1, 2, dtype=torch.bool),
    }
    out, grad = loss_and_grad(sapo_policy_loss, inputs, tau_pos=1.0, tau_neg=2.0, agg="token-mean")
    sigma = 1 / (1 + math.exp(-2.0))
    gate = 4 * sigma * (1 - sigma)
    assert out.loss.item() == pytest.approx((-2 + 2 * sigma) / 2, abs=1e-12)
    assert out.clipfrac.item() == pytest.approx((1 - gate) / 2, abs=1e-12)
    expected = torch.tensor([[-0.5, gate * 2 / 2]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- invariants


def aggregation_weights(mask: Tensor, agg: str, denominator: float) -> Tensor:
    """d(aggregate)/d(ℓ_bt): 1/N (token-mean), 1/S (seq-mean-token-sum), 1/(n_b·S)."""
    real = mask.to(torch.float64)  # (B, T)
    if agg == "seq-mean-token-mean":
        return real / real.sum(dim=1, keepdim=True).clamp(min=1) / denominator
    return real / denominator


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("denominator", [None, 37.0])
def test_on_policy_every_loss_is_the_policy_gradient(
    name: str, agg: str, denominator: float | None
) -> None:
    # Ratio 1: every loss's gradient is −A times the aggregation's weight of the token.
    inputs = random_inputs(0)
    inputs["old_logprobs"] = inputs["logprobs"].clone()
    mask = inputs["response_mask"]
    out, grad = loss_and_grad(bound(name), inputs, agg=agg, loss_denominator=denominator)
    n = count_loss_units(response_mask=mask, agg=agg) if denominator is None else denominator
    expected = -inputs["advantages"] * aggregation_weights(mask, agg, n)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    assert out.clipfrac.item() == pytest.approx(0.0, abs=1e-12)
    assert out.approx_kl.item() == 0.0


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_gspo_on_one_token_responses_is_ppo(agg: str) -> None:
    inputs = {k: v[:, :1] for k, v in random_inputs(1).items()}
    inputs["response_mask"][1:, 0] = True  # every row but the first has its one token
    inputs["logprobs"] = inputs["old_logprobs"] + torch.linspace(-0.4, 0.4, 6).unsqueeze(1)
    weights = torch.linspace(0.5, 1.5, 6, dtype=torch.float64).unsqueeze(1)  # (B, 1)
    clip = {"clip_low": 0.2, "clip_high": 0.28}
    gspo, gspo_grad = loss_and_grad(gspo_policy_loss, inputs, **clip, agg=agg, is_weights=weights)
    ppo, ppo_grad = loss_and_grad(
        ppo_policy_loss, inputs, **clip, dual_clip=None, agg=agg, is_weights=weights
    )
    torch.testing.assert_close(gspo.loss, ppo.loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(gspo_grad, ppo_grad, atol=1e-12, rtol=0)
    assert gspo.clipfrac.item() == ppo.clipfrac.item() > 0  # the clip was exercised
    assert gspo.approx_kl.item() == ppo.approx_kl.item()


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_tokens_contribute_nothing(name: str) -> None:
    # Other values at masked positions (GSPO: they must not enter the row's ratio either).
    inputs = random_inputs(2)
    mask = inputs["response_mask"]
    other = dict(inputs)
    for key, scale in (("logprobs", 5.0), ("old_logprobs", -3.0), ("advantages", 7.0)):
        other[key] = torch.where(mask, inputs[key], scale)
    loss = bound(name)
    out, grad = loss_and_grad(loss, inputs, agg="token-mean")
    out_other, grad_other = loss_and_grad(loss, other, agg="token-mean")
    for field in ("loss", "clipfrac", "approx_kl"):
        torch.testing.assert_close(
            getattr(out, field), getattr(out_other, field), atol=1e-12, rtol=0
        )
    torch.testing.assert_close(grad, grad_other, atol=1e-12, rtol=0)
    assert not grad[~mask].any()


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_importance_weights_scale_each_tokens_loss(name: str) -> None:
    inputs = random_inputs(3)
    loss = bound(name)
    out, grad = loss_and_grad(loss, inputs, agg="seq-mean-token-mean")
    # A constant weight scales the loss and its gradient; the metrics do not move.
    scaled, scaled_grad = loss_and_grad(
        loss, inputs, agg="seq-mean-token-mean", is_weights=torch.full_like(grad, 2.5)
    )
    torch.testing.assert_close(scaled.loss, 2.5 * out.loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(scaled_grad, 2.5 * grad, atol=1e-12, rtol=0)
    assert (scaled.clipfrac, scaled.approx_kl) == (out.clipfrac, out.approx_kl)
    # A zero weight removes the token's own term, as a zero advantage does, and keeps the
    # denominator (and, for GSPO, the token's place in its row's ratio).
    zero = torch.zeros_like(grad, dtype=torch.bool)
    zero[3, :2] = zero[4, 1] = True
    weighted, weighted_grad = loss_and_grad(
        loss, inputs, agg="seq-mean-token-mean", is_weights=(~zero).to(torch.float64)
    )
    no_advantage = {**inputs, "advantages": inputs["advantages"].masked_fill(zero, 0.0)}
    plain, plain_grad = loss_and_grad(loss, no_advantage, agg="seq-mean-token-mean")
    torch.testing.assert_close(weighted.loss, plain.loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(weighted_grad, plain_grad, atol=1e-12, rtol=0)
    assert weighted.loss.item() != pytest.approx(out.loss.item())


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_micro_batches_with_the_mini_batch_denominator_sum_to_the_whole(
    name: str, agg: str
) -> None:
    # Rows never span micro-batches, so GSPO's row ratio is the same in any split of the rows.
    inputs = random_inputs(4)
    loss = bound(name)
    n = count_loss_units(response_mask=inputs["response_mask"], agg=agg)
    whole, whole_grad = loss_and_grad(loss, inputs, agg=agg)
    parts = [{k: v[rows] for k, v in inputs.items()} for rows in (slice(0, 2), slice(2, None))]
    split = [loss_and_grad(loss, part, agg=agg, loss_denominator=n) for part in parts]
    torch.testing.assert_close(whole.loss, split[0][0].loss + split[1][0].loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        whole_grad, torch.cat([split[0][1], split[1][1]]), atol=1e-12, rtol=0
    )


def test_clipfrac_counts_each_losss_own_clip() -> None:
    # One row of four tokens, all A = +1, token ratios 1.3, 1.0, 1.0, 1.0.
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    inputs = {
        "logprobs": logprobs,
        "old_logprobs": logprobs
        - torch.tensor([[math.log(1.3), 0.0, 0.0, 0.0]], dtype=torch.float64),
        "advantages": torch.ones(1, 4, dtype=torch.float64),
        "response_mask": torch.ones(1, 4, dtype=torch.bool),
    }
    # PPO and CISPO (cap 1.2): the one token above the cap; GSPO: its row's ratio
    # 1.3^(1/4) = 1.068 is above 1 + 0.05, so all four tokens; SAPO: mean(1 − g), g < 1 only
    # for the first token.
    ppo = ppo_policy_loss(**inputs, clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean")
    cispo = cispo_policy_loss(**inputs, clip_low=None, clip_high=0.2, agg="token-mean")
    gspo = gspo_policy_loss(**inputs, clip_low=0.05, clip_high=0.05, agg="token-mean")
    sapo = sapo_policy_loss(**inputs, tau_pos=1.0, tau_neg=1.05, agg="token-mean")
    sigma = 1 / (1 + math.exp(-0.3))
    assert ppo.clipfrac.item() == cispo.clipfrac.item() == 0.25
    assert gspo.clipfrac.item() == 1.0
    assert sapo.clipfrac.item() == pytest.approx((1 - 4 * sigma * (1 - sigma)) / 4, abs=1e-12)


# ----------------------------------------------------------------------------- the table


def test_the_config_names_exactly_the_registered_losses() -> None:
    assert set(get_args(PolicyLossKind)) == set(POLICY_LOSSES)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_actor_loss_runs_the_chosen_loss_with_its_own_settings(name: str) -> None:
    inputs = random_inputs(5)
    direct = {
        "ppo": lambda: ppo_policy_loss(
            **inputs, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="token-mean"
        ),
        "gspo": lambda: gspo_policy_loss(**inputs, clip_low=0.05, clip_high=0.08, agg="token-mean"),
        "cispo": lambda: cispo_policy_loss(
            **inputs, clip_low=None, clip_high=0.2, agg="token-mean"
        ),
        "sapo": lambda: sapo_policy_loss(**inputs, tau_pos=1.0, tau_neg=1.05, agg="token-mean"),
    }[name]()
    out = actor_loss(
        **inputs,
        policy=PolicyLossSettings(policy_loss=name, **SETTINGS),
        agg="token-mean",
        entropy_coef=0.0,
        kl_loss_coef=0.0,
        kl_loss_kind="k3",
    )
    torch.testing.assert_close(out.loss, direct.loss, atol=1e-12, rtol=0)
    assert (out.clipfrac, out.approx_kl) == (direct.clipfrac, direct.approx_kl)


def test_bad_policy_loss_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="policy_loss 'grpo'"):
        PolicyLossSettings(policy_loss="grpo", **SETTINGS)
    with pytest.raises(ValueError, match="sapo_tau_neg"):
        PolicyLossSettings(policy_loss="sapo", **{**SETTINGS, "sapo_tau_neg": 0.0})
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossSettings(policy_loss="ppo", **{**SETTINGS, "dual_clip": 0.5})
