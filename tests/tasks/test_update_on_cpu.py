"""PPO losses: hand-worked values, float64 loop references, and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from tasks.update import (
    AGGREGATIONS,
    PolicyLossSettings,
    actor_loss,
    aggregate_loss,
    count_loss_units,
    entropy_from_logits,
    ppo_policy_loss,
    value_loss,
)

# The symmetric clip of the hand-worked examples (PPO's 0.2) with a dual clip of 3.
CLIP = {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}
# actor_loss's policy loss: PPO with CLIP (the other losses' settings are not read).
PPO = PolicyLossSettings(
    policy_loss="ppo",
    **CLIP,
    gspo_clip_low=3e-4,
    gspo_clip_high=4e-4,
    cispo_clip_low=None,
    cispo_clip_high=0.2,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
)

# ----------------------------------------------------------------------------- references


def aggregate_reference(loss: list[list[float]], mask: Tensor, agg: str) -> float:
    rows = [[loss[b][t] for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
    non_empty = [r for r in rows if r]
    if agg == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / max(n, 1)
    if agg == "seq-mean-token-sum":
        return sum(sum(r) for r in non_empty) / max(len(non_empty), 1)
    return sum(sum(r) / len(r) for r in non_empty) / max(len(non_empty), 1)


def policy_reference(
    logp: Tensor,
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual: float,
    agg: str,
) -> tuple[float, float, float]:
    loss = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    clipped_count, kl_sum, n = 0, 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            a, lr = float(adv[b, t]), float(logp[b, t]) - float(old[b, t])
            ratio = math.exp(lr)
            pg1 = -a * ratio
            pg2 = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            value = max(pg1, pg2)
            if a < 0:
                value = min(value, -a * dual)
            loss[b][t] = value
            if mask[b, t]:
                n += 1
                clipped_count += pg2 > pg1
                kl_sum += -lr
    return aggregate_reference(loss, mask, agg), clipped_count / max(n, 1), kl_sum / max(n, 1)


def random_inputs(seed: int, batch: int = 6, width: int = 8) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (batch,), generator=generator)
    lengths[0] = 0
    mask = torch.arange(width) < lengths.unsqueeze(1)
    mask[2] &= torch.rand(width, generator=generator) > 0.4  # a row with holes
    old = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 3
    return {
        "logprobs": old + torch.randn(batch, width, generator=generator, dtype=torch.float64) * 0.6,
        "old_logprobs": old,
        "advantages": torch.randn(batch, width, generator=generator, dtype=torch.float64) * 2,
        "response_mask": mask,
    }


# ----------------------------------------------------------------------------- aggregation


def test_aggregation_hand_worked() -> None:
    # Rows of length 2, 1 and 0 with real losses [1, 2], [3], []; 99 sits under the mask.
    # token-mean: (1 + 2 + 3) / 3 = 2.  seq-mean-token-sum: (3 + 3) / 2 non-empty rows = 3.
    # seq-mean-token-mean: (1.5 + 3) / 2 = 2.25.  The empty row is not counted as a sequence.
    loss = torch.tensor(
        [[1.0, 2.0, 99.0], [3.0, 99.0, 99.0], [99.0, 99.0, 99.0]], dtype=torch.float64
    )
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    expected = {"token-mean": 2.0, "seq-mean-token-sum": 3.0, "seq-mean-token-mean": 2.25}
    for agg, value in expected.items():
        assert aggregate_loss(loss_mat=loss, response_mask=mask, agg=agg).item() == value
    assert count_loss_units(response_mask=mask, agg="token-mean") == 3.0
    assert count_loss_units(response_mask=mask, agg="seq-mean-token-mean") == 2.0
    # An explicit denominator replaces the batch's own count: 6 / 12 = 0.5.
    assert (
        aggregate_loss(
            loss_mat=loss, response_mask=mask, agg="token-mean", loss_denominator=12
        ).item()
        == 0.5
    )
    # No real token at all: 0, not NaN.
    none = aggregate_loss(loss_mat=loss, response_mask=torch.zeros_like(mask), agg="token-mean")
    assert none.item() == 0.0
    with pytest.raises(ValueError, match="choose one of"):
        aggregate_loss(loss_mat=loss, response_mask=mask, agg="mean")


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_split_denominator_invariant(agg: str) -> None:
    # Summing the parts of any row split, each divided by the whole batch's count, gives the
    # whole batch's loss: the property gradient accumulation relies on.
    inputs = random_inputs(5, batch=8)
    loss, mask = inputs["advantages"], inputs["response_mask"]
    whole = aggregate_loss(loss_mat=loss, response_mask=mask, agg=agg)
    denominator = count_loss_units(response_mask=mask, agg=agg)
    parts = sum(
        aggregate_loss(
            loss_mat=loss[i : i + 3],
            response_mask=mask[i : i + 3],
            agg=agg,
            loss_denominator=denominator,
        )
        for i in range(0, 8, 3)
    )
    torch.testing.assert_close(parts, whole, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- policy loss


def test_policy_loss_hand_worked() -> None:
    # Four tokens, clip 0.2, dual clip 3:
    #   A=+1, ratio 1.5: max(−1.5, −1.2) = −1.2            (clipped term wins → clipfrac)
    #   A=−1, ratio 0.5: max(0.5, 0.8) = 0.8; min(0.8, 3) = 0.8   (clipped term wins)
    #   A=−1, ratio 4:   max(4, 1.2) = 4; dual clip min(4, 3) = 3
    #   A=+2, ratio 1:   −2 (no clipping)
    # token-mean = (−1.2 + 0.8 + 3 − 2) / 4 = 0.15; clipfrac = 2/4;
    # approx_kl = mean(old − new) = −(ln 1.5 + ln 0.5 + ln 4 + 0) / 4 = −ln 3 / 4.
    ratios = torch.tensor([[1.5, 0.5, 4.0, 1.0]], dtype=torch.float64)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    out = ppo_policy_loss(
        logprobs=old + ratios.log(),
        old_logprobs=old,
        advantages=torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 4, dtype=torch.bool),
        **CLIP,
        agg="token-mean",
    )
    assert out.loss.item() == pytest.approx(0.15, abs=1e-12)
    assert out.clipfrac.item() == 0.5
    assert out.approx_kl.item() == pytest.approx(-math.log(3) / 4, abs=1e-12)


def test_policy_loss_asymmetric_clip_and_no_dual_clip() -> None:
    # clip_high 0.28: A=+1 and ratio 1.5 → max(−1.5, −1.28) = −1.28.
    # Without dual clip, A=−1 and ratio 4 keeps its full loss 4.
    old = torch.zeros(1, 2, dtype=torch.float64)
    out = ppo_policy_loss(
        logprobs=torch.tensor([[math.log(1.5), math.log(4.0)]], dtype=torch.float64),
        old_logprobs=old,
        advantages=torch.tensor([[1.0, -1.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 2, dtype=torch.bool),
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=None,
        agg="seq-mean-token-sum",
    )
    assert out.loss.item() == pytest.approx(-1.28 + 4.0, abs=1e-12)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(
            logprobs=old,
            old_logprobs=old,
            advantages=old,
            response_mask=torch.ones(1, 2, dtype=torch.bool),
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=1.0,
            agg="token-mean",
        )


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_matches_loop_reference(agg: str, seed: int) -> None:
    inputs = random_inputs(seed)
    out = ppo_policy_loss(**inputs, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg)
    loss, clipfrac, kl = policy_reference(
        inputs["logprobs"],
        inputs["old_logprobs"],
        inputs["advantages"],
        inputs["response_mask"],
        0.2,
        0.28,
        3.0,
        agg,
    )
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    assert out.clipfrac.item() == pytest.approx(clipfrac, abs=1e-12)
    assert out.approx_kl.item() == pytest.approx(kl, abs=1e-9)


def test_policy_loss_gradient_invariants() -> None:
    # At ratio 1 the clipped objective's gradient is −A/N per real token (token-mean), and
    # masked tokens get no gradient even if they hold NaN.
    old = torch.tensor([[-1.0, -2.0, float("nan")]], dtype=torch.float64)
    logprobs = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -3.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    out = ppo_policy_loss(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=adv,
        response_mask=mask,
        **CLIP,
        agg="token-mean",
    )
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == [[-0.5, 1.5, 0.0]]


# ----------------------------------------------------------------------------- value loss


def test_value_loss_hand_worked() -> None:
    # Token 1: V=1.0, V_old=0.5, R=2, clip 0.2 → unclipped (1−2)² = 1; V_clip = 0.7 →
    # (0.7−2)² = 1.69 wins; ½·1.69 = 0.845 (clipped).  Token 2: V=0.6 within the clip of
    # V_old=0.5 → both 0.36; ½·0.36 = 0.18.  token-mean (0.845 + 0.18) / 2 = 0.5125, clipfrac ½.
    out = value_loss(
        values=torch.tensor([[1.0, 0.6]], dtype=torch.float64),
        old_values=torch.tensor([[0.5, 0.5]], dtype=torch.float64),
        returns=torch.tensor([[2.0, 0.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 2, dtype=torch.bool),
        clip_range=0.2,
        agg="token-mean",
    )
    assert out.loss.item() == pytest.approx(0.5125, abs=1e-12)
    assert out.clipfrac.item() == 0.5


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_matches_loop_reference(agg: str, seed: int) -> None:
    inputs = random_inputs(seed)
    values, old, returns = inputs["logprobs"], inputs["old_logprobs"], inputs["advantages"]
    mask = inputs["response_mask"]
    out = value_loss(
        values=values, old_values=old, returns=returns, response_mask=mask, clip_range=0.3, agg=agg
    )
    loss = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            v, o, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
            clipped = o + min(max(v - o, -0.3), 0.3)
            loss[b][t] = 0.5 * max((v - r) ** 2, (clipped - r) ** 2)
    assert out.loss.item() == pytest.approx(aggregate_reference(loss, mask, agg), abs=1e-6)
    plain = value_loss(
        values=values, old_values=old, returns=returns, response_mask=mask, clip_range=None, agg=agg
    )
    assert plain.clipfrac.item() == 0.0
    assert plain.loss.item() <= out.loss.item() + 1e-12  # clipping only ever raises the loss


# ----------------------------------------------------------------------------- entropy and the actor loss


def test_entropy_from_logits() -> None:
    # Two equal logits: ln 2.  One-hot-ish logits: near 0.  Four equal: ln 4.
    logits = torch.tensor([[0.0, 0.0], [50.0, -50.0]], dtype=torch.float64)
    entropy = entropy_from_logits(logits=logits)
    assert entropy[0].item() == pytest.approx(math.log(2), abs=1e-12)
    assert entropy[1].item() == pytest.approx(0.0, abs=1e-12)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=generator, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    reference = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits=logits), reference, atol=1e-12, rtol=0)


def test_actor_loss_combines_terms() -> None:
    inputs = random_inputs(3)
    generator = torch.Generator().manual_seed(9)
    entropy = torch.rand(inputs["logprobs"].shape, generator=generator, dtype=torch.float64)
    ref = inputs["old_logprobs"] + 0.1
    out = actor_loss(
        **inputs,
        entropy=entropy,
        ref_logprobs=ref,
        policy=PPO,
        entropy_coef=0.01,
        kl_loss_coef=0.5,
        kl_loss_kind="k2",
        agg="seq-mean-token-mean",
    )
    mask = inputs["response_mask"]
    pg = ppo_policy_loss(**inputs, **CLIP, agg="seq-mean-token-mean").loss
    ent = aggregate_loss(loss_mat=entropy, response_mask=mask, agg="seq-mean-token-mean")
    kl = aggregate_loss(
        loss_mat=0.5 * (inputs["logprobs"] - ref) ** 2,
        response_mask=mask,
        agg="seq-mean-token-mean",
    )
    torch.testing.assert_close(out.loss, pg - 0.01 * ent + 0.5 * kl, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.entropy, ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.kl_loss, kl, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="entropy_coef"):
        actor_loss(
            **inputs,
            policy=PPO,
            agg="token-mean",
            entropy_coef=0.1,
            kl_loss_coef=0.0,
            kl_loss_kind="k3",
        )
    with pytest.raises(ValueError, match="ref_logprobs"):
        actor_loss(
            **inputs,
            policy=PPO,
            agg="token-mean",
            entropy_coef=0.0,
            kl_loss_coef=0.1,
            kl_loss_kind="k3",
        )
