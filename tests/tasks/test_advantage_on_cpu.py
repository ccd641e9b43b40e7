"""Advantage estimators: hand-worked values, float64 loop references, and invariants."""

from __future__ import annotations

import inspect
import math
from typing import get_args

import pytest
import torch
from torch import Tensor

from infra.config import AlgorithmConfig, Estimator
from tasks.advantage import (
    ESTIMATORS,
    EstimatorSettings,
    gae,
    grpo_advantage,
    reinforce_pp_advantage,
    rloo_advantage,
)
from tasks.advantage.core import discounted_reverse_cumsum, run_estimator

# ----------------------------------------------------------------------------- references


def _real_positions(mask: Tensor, b: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[b, t])]


def _whiten_reference(x: list[list[float]], mask: Tensor) -> list[list[float]]:
    real = [x[b][t] for b in range(mask.shape[0]) for t in _real_positions(mask, b)]
    if len(real) < 2:
        return [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    mean = sum(real) / len(real)
    var = sum((v - mean) ** 2 for v in real) / (len(real) - 1)
    return [
        [
            (x[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
            for t in range(mask.shape[1])
        ]
        for b in range(mask.shape[0])
    ]


def gae_reference(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, whiten: bool
) -> tuple[Tensor, Tensor]:
    """Plain loop over each row's real tokens only (masked ones do not exist for the recursion)."""
    batch, width = mask.shape
    adv = [[0.0] * width for _ in range(batch)]
    ret = [[0.0] * width for _ in range(batch)]
    for b in range(batch):
        real = _real_positions(mask, b)
        last = 0.0
        for k in reversed(range(len(real))):
            t = real[k]
            next_value = float(values[b, real[k + 1]]) if k + 1 < len(real) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + float(values[b, t])
    if whiten:
        adv = _whiten_reference(adv, mask)
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def group_reference(scores: Tensor, groups: Tensor, kind: str, norm_by_std: bool) -> list[float]:
    """Per-sample advantage by looping over samples and their groups."""
    out = []
    for i in range(len(scores)):
        members = [float(scores[j]) for j in range(len(scores)) if groups[j] == groups[i]]
        s = float(scores[i])
        if len(members) < 2:
            out.append(0.0)
        elif kind == "rloo":
            out.append(s - (sum(members) - s) / (len(members) - 1))
        elif max(members) == min(members):
            out.append(0.0)
        else:
            mean = sum(members) / len(members)
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
            out.append((s - mean) / (std + 1e-6) if norm_by_std else s - mean)
    return out


def random_mask(generator: torch.Generator, batch: int, width: int, style: str) -> Tensor:
    """Masks with holes, empty rows, full rows, and left padding."""
    lengths = torch.randint(0, width + 1, (batch,), generator=generator)
    lengths[0], lengths[1] = 0, width  # always one empty and one full row
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    if style == "holes":
        mask &= torch.rand(batch, width, generator=generator) > 0.3
    elif style == "left":
        mask = mask.flip(1)
    return mask


STYLES = ["right", "holes", "left"]

# ----------------------------------------------------------------------------- GAE


def test_gae_hand_worked_skips_masked_token() -> None:
    # One row, mask [1, 0, 1]; the masked middle token's reward 99 and value 77 are ignored.
    # γ = λ = 0.5.  t=2 (last real): δ = 1 + 0 − 0.25 = 0.75, A = 0.75, return = 1.0.
    # t=0: the next real token is t=2, so δ = 0 + 0.5·0.25 − 0.5 = −0.375 and
    # A = −0.375 + γλ·0.75 = −0.375 + 0.1875 = −0.1875, return = −0.1875 + 0.5 = 0.3125.
    out = gae(
        token_rewards=torch.tensor([[0.0, 99.0, 1.0]], dtype=torch.float64),
        values=torch.tensor([[0.5, 77.0, 0.25]], dtype=torch.float64),
        response_mask=torch.tensor([[True, False, True]]),
        gamma=0.5,
        lam=0.5,
        whiten=False,
    )
    assert out.advantages.tolist() == [[-0.1875, 0.0, 0.75]]
    assert out.returns.tolist() == [[0.3125, 0.0, 1.0]]


def test_gae_hole_equals_row_without_it() -> None:
    # "As if absent": a row with a masked hole gives the same numbers as the row with the hole
    # cut out.
    generator = torch.Generator().manual_seed(7)
    rewards = torch.randn(1, 6, generator=generator, dtype=torch.float64)
    values = torch.randn(1, 6, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False, True, True]])
    keep = [0, 1, 4, 5]
    holed = gae(
        token_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8, whiten=False
    )
    compact = gae(
        token_rewards=rewards[:, keep],
        values=values[:, keep],
        response_mask=torch.ones(1, 4, dtype=torch.bool),
        gamma=0.9,
        lam=0.8,
        whiten=False,
    )
    torch.testing.assert_close(holed.advantages[:, keep], compact.advantages, atol=1e-12, rtol=0)
    torch.testing.assert_close(holed.returns[:, keep], compact.returns, atol=1e-12, rtol=0)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("whiten", [False, True])
def test_gae_matches_loop_reference(style: str, seed: int, whiten: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    mask = random_mask(generator, 9, 13, style)
    rewards = torch.randn(9, 13, generator=generator, dtype=torch.float64)
    values = torch.randn(9, 13, generator=generator, dtype=torch.float64)
    rewards[~mask] = float("nan")  # padding garbage must never leak in
    values[~mask] = float("nan")
    gamma, lam = 0.97, 0.9
    out = gae(
        token_rewards=rewards,
        values=values,
        response_mask=mask,
        gamma=gamma,
        lam=lam,
        whiten=whiten,
    )
    adv_ref, ret_ref = gae_reference(rewards, values, mask, gamma, lam, whiten)
    torch.testing.assert_close(out.advantages, adv_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.returns, ret_ref, atol=1e-6, rtol=0)


def test_gae_invariants() -> None:
    generator = torch.Generator().manual_seed(11)
    mask = random_mask(generator, 8, 10, "holes")
    rewards = torch.randn(8, 10, generator=generator, dtype=torch.float64)
    values = torch.randn(8, 10, generator=generator, dtype=torch.float64)
    raw = gae(
        token_rewards=rewards, values=values, response_mask=mask, gamma=1.0, lam=1.0, whiten=False
    )
    # With γ = λ = 1 the return is the sum of the remaining real rewards (values telescope).
    remaining = torch.where(mask, rewards, 0.0).flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(raw.returns, torch.where(mask, remaining, 0.0), atol=1e-12, rtol=0)
    # Masked positions are always 0; whitened advantages have mean 0 over real tokens.
    white = gae(token_rewards=rewards, values=values, response_mask=mask, gamma=0.99, lam=0.95)
    assert not white.advantages[~mask].any() and not white.returns[~mask].any()
    assert abs(float(white.advantages[mask].mean())) < 1e-12
    # λ = 0: the advantage is the one-step TD error.
    td = gae(
        token_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.0, whiten=False
    )
    ref, _ = gae_reference(rewards, values, mask, 0.9, 0.0, False)
    torch.testing.assert_close(td.advantages, ref, atol=1e-12, rtol=0)


def test_gae_float32_and_zero_width() -> None:
    empty = gae(
        token_rewards=torch.zeros(3, 0),
        values=torch.zeros(3, 0),
        response_mask=torch.zeros(3, 0, dtype=torch.bool),
        gamma=1.0,
        lam=0.95,
    )
    assert empty.advantages.shape == (3, 0)
    generator = torch.Generator().manual_seed(5)
    mask = random_mask(generator, 6, 40, "holes")
    rewards = torch.randn(6, 40, generator=generator)
    values = torch.randn(6, 40, generator=generator)
    out = gae(token_rewards=rewards, values=values, response_mask=mask, gamma=1.0, lam=0.95)
    assert out.advantages.dtype == torch.float32
    ref, _ = gae_reference(rewards.double(), values.double(), mask, 1.0, 0.95, True)
    torch.testing.assert_close(out.advantages.double(), ref, atol=1e-4, rtol=0)


def test_gae_rejects_bad_inputs() -> None:
    ok_mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(
            token_rewards=torch.zeros(1, 2),
            values=torch.zeros(1, 2),
            response_mask=ok_mask,
            gamma=1.1,
            lam=1.0,
        )
    with pytest.raises(TypeError, match="bool"):
        gae(
            token_rewards=torch.zeros(1, 2),
            values=torch.zeros(1, 2),
            response_mask=torch.ones(1, 2),
            gamma=1.0,
            lam=1.0,
        )
    with pytest.raises(ValueError, match="values"):
        gae(
            token_rewards=torch.zeros(1, 2),
            values=torch.zeros(1, 3),
            response_mask=torch.ones(1, 2, dtype=torch.bool),
            gamma=1.0,
            lam=1.0,
        )


def test_discounted_reverse_cumsum_hand_worked() -> None:
    # y_t = x_t + 0.5·y_{t+1} with x = [1, 2, 3]: y2 = 3, y1 = 2 + 1.5 = 3.5, y0 = 1 + 1.75 = 2.75.
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    assert discounted_reverse_cumsum(values=x, factor=0.5).tolist() == [[2.75, 3.5, 3.0]]
    assert x.tolist() == [[1.0, 2.0, 3.0]]  # the input is not modified
    # factor 0 leaves x unchanged (0⁰ = 1 on the diagonal), factor 1 is a plain reverse cumsum.
    assert discounted_reverse_cumsum(values=x, factor=0.0).tolist() == [[1.0, 2.0, 3.0]]
    assert discounted_reverse_cumsum(values=x, factor=1.0).tolist() == [[6.0, 5.0, 3.0]]


@pytest.mark.parametrize("width", [1, 5, 64, 65, 200])
@pytest.mark.parametrize("factor", [0.0, 0.5, 0.97, 1.0])
def test_discounted_reverse_cumsum_matches_loop_across_chunks(width: int, factor: float) -> None:
    # Chunk size 7 here makes every width cross several chunk borders (and a ragged last one).
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(width), dtype=torch.float64)
    expected = torch.zeros_like(x)
    for b in range(3):
        running = 0.0
        for t in reversed(range(width)):
            running = float(x[b, t]) + factor * running
            expected[b, t] = running
    for chunk in (7, 64):
        out = discounted_reverse_cumsum(values=x, factor=factor, chunk=chunk)
        torch.testing.assert_close(out, expected, atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------- GRPO / RLOO


def test_grpo_hand_worked() -> None:
    # Group 0: scores 1, 2, 3 → mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1, so the advantages
    # are (−1, 0, 1) / (1 + 1e-6). Group 1: all equal (5, 5) → exactly 0. Group 2: one sample → 0.
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 7.0], dtype=torch.float64)
    group_ids = torch.tensor([10, 10, 10, 4, 4, 99])
    mask = torch.tensor([[True, True]] * 5 + [[True, False]])
    out = grpo_advantage(scores=scores, group_ids=group_ids, response_mask=mask)
    adv = out.advantages
    assert out.returns is adv  # an outcome estimator's returns are its advantages
    k = 1 / (1 + 1e-6)
    expected = [[-k, -k], [0.0, 0.0], [k, k], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    centered = grpo_advantage(
        scores=scores, group_ids=group_ids, response_mask=mask, norm_by_std=False
    ).advantages
    assert centered[:, 0].tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_grpo_equal_scores_never_nan() -> None:
    # 0.1 · 3 / 3 ≠ 0.1 in floating point, so (s − mean) is ~1e-17, not 0; the std is ~0 and a
    # naive division would blow that up. Equal groups must give exactly 0.
    scores = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float32)
    adv = grpo_advantage(
        scores=scores,
        group_ids=torch.zeros(3, dtype=torch.long),
        response_mask=torch.ones(3, 4, dtype=torch.bool),
    ).advantages
    assert torch.equal(adv, torch.zeros(3, 4))


def test_rloo_hand_worked() -> None:
    # Group [1, 2, 3]: baselines are the others' means 2.5, 2, 1.5 → advantages −1.5, 0, 1.5.
    # The singleton group (score 7) gets 0.
    out = rloo_advantage(
        scores=torch.tensor([1.0, 2.0, 3.0, 7.0], dtype=torch.float64),
        group_ids=torch.tensor([0, 0, 0, 1]),
        response_mask=torch.ones(4, 1, dtype=torch.bool),
    )
    assert out.advantages[:, 0].tolist() == [-1.5, 0.0, 1.5, 0.0]
    assert out.returns is out.advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["grpo", "grpo-no-std", "rloo"])
def test_group_estimators_match_loop_reference(seed: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(seed)
    batch = 40
    group_ids = torch.randint(0, 12, (batch,), generator=generator) * 7 - 20  # any labels
    scores = torch.randint(-2, 3, (batch,), generator=generator).double()  # ties and equal groups
    scores += torch.where(
        torch.rand(batch, generator=generator) < 0.5,
        torch.randn(batch, generator=generator, dtype=torch.float64),
        0.0,
    )
    mask = random_mask(generator, batch, 6, "holes")
    if kind == "rloo":
        adv = rloo_advantage(scores=scores, group_ids=group_ids, response_mask=mask).advantages
    else:
        adv = grpo_advantage(
            scores=scores, group_ids=group_ids, response_mask=mask, norm_by_std=kind == "grpo"
        ).advantages
    per_sample = group_reference(
        scores, group_ids, "rloo" if kind == "rloo" else "grpo", kind == "grpo"
    )
    expected = torch.where(mask, torch.tensor(per_sample, dtype=torch.float64).unsqueeze(1), 0.0)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert torch.isfinite(adv).all()


def test_group_estimators_invariants() -> None:
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(24, generator=generator, dtype=torch.float64)
    group_ids = torch.arange(24) // 6
    mask = torch.ones(24, 3, dtype=torch.bool)
    grpo = grpo_advantage(scores=scores, group_ids=group_ids, response_mask=mask).advantages[:, 0]
    rloo = rloo_advantage(scores=scores, group_ids=group_ids, response_mask=mask).advantages[:, 0]
    # Advantages sum to 0 within each group; RLOO = n/(n−1)·(s − mean) = 6/5 · GRPO-without-std.
    assert torch.allclose(grpo.view(4, 6).sum(1), torch.zeros(4, dtype=torch.float64), atol=1e-12)
    centered = grpo_advantage(
        scores=scores, group_ids=group_ids, response_mask=mask, norm_by_std=False
    ).advantages[:, 0]
    torch.testing.assert_close(rloo, centered * 6 / 5, atol=1e-12, rtol=0)
    # Permuting the samples permutes the advantages; shifting every score changes nothing.
    perm = torch.randperm(24, generator=generator)
    permuted = grpo_advantage(
        scores=scores[perm], group_ids=group_ids[perm], response_mask=mask
    ).advantages[:, 0]
    torch.testing.assert_close(permuted, grpo[perm], atol=1e-12, rtol=0)
    shifted = grpo_advantage(
        scores=scores + 3.0, group_ids=group_ids, response_mask=mask
    ).advantages[:, 0]
    torch.testing.assert_close(shifted, grpo, atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand_worked() -> None:
    # Rewards [1, ·, 0, 2] with the second token masked, γ = 0.5: G3 = 2, G2 = 0 + 0.5·2 = 1,
    # G0 = 1 + 0.5·1 = 1.5 (the masked token is skipped, not a break).
    out = reinforce_pp_advantage(
        token_rewards=torch.tensor([[1.0, 50.0, 0.0, 2.0]], dtype=torch.float64),
        response_mask=torch.tensor([[True, False, True, True]]),
        gamma=0.5,
        whiten=False,
    )
    assert out.returns.tolist() == [[1.5, 0.0, 1.0, 2.0]]
    assert out.advantages.tolist() == [[1.5, 0.0, 1.0, 2.0]]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_matches_loop_reference(style: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    mask = random_mask(generator, 7, 11, style)
    rewards = torch.randn(7, 11, generator=generator, dtype=torch.float64)
    out = reinforce_pp_advantage(token_rewards=rewards, response_mask=mask, gamma=0.9)
    # REINFORCE++ is GAE with zero values and λ = 1.
    adv_ref, ret_ref = gae_reference(rewards, torch.zeros_like(rewards), mask, 0.9, 1.0, True)
    torch.testing.assert_close(out.advantages, adv_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.returns, ret_ref, atol=1e-6, rtol=0)


def test_estimator_registry_is_complete_and_matches_the_functions() -> None:
    assert set(ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus"}
    readable = {
        name for name, value in vars(EstimatorSettings).items() if isinstance(value, property)
    }
    for name, spec in ESTIMATORS.items():
        assert spec.name == name
        assert "response_mask" in spec.inputs, name
        # Inputs and settings are distinct keywords of the function and cover every keyword
        # without a default; every setting is an attribute of EstimatorSettings, and so of the
        # run config's algorithm section.
        keywords = inspect.signature(spec.fn).parameters
        assert set(spec.inputs) | set(spec.settings) <= set(keywords), name
        assert not set(spec.inputs) & set(spec.settings), name
        required = {k for k, p in keywords.items() if p.default is inspect.Parameter.empty}
        assert required <= set(spec.inputs) | set(spec.settings), name
        assert set(spec.settings.values()) <= readable, name
    assert readable <= set(AlgorithmConfig.model_fields)


def test_the_config_offers_exactly_the_estimators_of_the_registry() -> None:
    assert set(get_args(Estimator)) == set(ESTIMATORS)


def test_run_estimator_calls_the_registry_with_the_configs_settings() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    tensors = {
        "token_rewards": torch.randn(2, 3, generator=gen),
        "values": torch.randn(2, 3, generator=gen),
        "scores": torch.tensor([1.0, 0.0]),
        "group_ids": torch.tensor([0, 0]),
        "response_mask": mask,
    }
    algo = AlgorithmConfig(gamma=0.9, lam=0.8, whiten_advantages=False)
    out = run_estimator("gae", tensors=tensors, settings=algo)
    direct = gae(
        token_rewards=tensors["token_rewards"], values=tensors["values"], response_mask=mask,
        gamma=0.9, lam=0.8, whiten=False,
    )  # fmt: skip
    torch.testing.assert_close(out.advantages, direct.advantages)
    torch.testing.assert_close(out.returns, direct.returns)
    grpo = run_estimator("grpo", tensors=tensors, settings=algo)
    assert grpo.returns is grpo.advantages
    with pytest.raises(ValueError, match="choose one of"):
        run_estimator("ppo", tensors=tensors, settings=algo)
