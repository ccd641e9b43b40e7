"""KL estimators, controllers and the reward penalty."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)


def test_kl_kinds_hand_worked() -> None:
    # Δ = logp − ref = +1 and −1.
    #   k1: Δ → 1, −1.   abs: 1, 1.   k2: ½Δ² → 0.5, 0.5.
    #   k3: e^(−Δ) + Δ − 1 → e^(−1) + 0 = 0.3679 for Δ = 1, e^(1) − 2 = 0.7183 for Δ = −1.
    logprobs = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-2.0, -1.0], dtype=torch.float64)
    expected = {
        "k1": [1.0, -1.0],
        "abs": [1.0, 1.0],
        "k2": [0.5, 0.5],
        "k3": [math.exp(-1.0), math.e - 2.0],
    }
    for kind, values in expected.items():
        out = kl_penalty(logprobs=logprobs, ref_logprobs=ref, kind=kind)
        assert out.tolist() == pytest.approx(values, abs=1e-12), kind
    assert set(KL_PENALTIES) == set(expected)


def test_kl_invariants_and_stability() -> None:
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.randn(200, generator=generator, dtype=torch.float64)
    ref = logprobs + torch.randn(200, generator=generator, dtype=torch.float64) * 0.001
    # Same distribution → 0 for every kind; k3 ≥ 0 always and ≈ k2 for small Δ (2nd order).
    for kind in KL_PENALTIES:
        assert not kl_penalty(logprobs=logprobs, ref_logprobs=logprobs, kind=kind).any()
    k2 = kl_penalty(logprobs=logprobs, ref_logprobs=ref, kind="k2")
    k3 = kl_penalty(logprobs=logprobs, ref_logprobs=ref, kind="k3")
    assert (k3 >= 0).all()
    # Taylor: k3 = Δ²/2 − Δ³/6 + …, so |k3 − k2| ≤ |Δ|³/6 · e^|Δ|.
    delta = (logprobs - ref).abs()
    assert ((k3 - k2).abs() <= delta**3 / 6 * delta.exp() + 1e-15).all()
    # Huge log-ratios stay finite (clamped) instead of overflowing exp.
    extreme = kl_penalty(
        logprobs=torch.tensor([-1000.0, 0.0]), ref_logprobs=torch.tensor([0.0, -1000.0]), kind="k3"
    )
    assert torch.isfinite(extreme).all() and extreme.max() <= 10.0
    with pytest.raises(ValueError, match="choose one of"):
        kl_penalty(logprobs=logprobs, ref_logprobs=ref, kind="k4")


def test_apply_kl_penalty_hand_worked() -> None:
    # k1 with Δ = [1, 2 | masked]: rewards [0, 1, 5] − 0.1·[1, 2, 0] = [−0.1, 0.8, 5];
    # kl_mean over the two real tokens = 1.5.
    out = apply_kl_penalty(
        token_rewards=torch.tensor([[0.0, 1.0, 5.0]], dtype=torch.float64),
        logprobs=torch.tensor([[-1.0, -1.0, 3.0]], dtype=torch.float64),
        ref_logprobs=torch.tensor([[-2.0, -3.0, 0.0]], dtype=torch.float64),
        response_mask=torch.tensor([[True, True, False]]),
        coef=0.1,
        kind="k1",
    )
    rewards, kl_mean = out  # unpacks like a tuple
    assert rewards[0].tolist() == pytest.approx([-0.1, 0.8, 5.0], abs=1e-12)
    assert kl_mean == 1.5 and out.kl_mean == 1.5


def test_fixed_controller() -> None:
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=100.0, n_steps=64)
    assert ctrl.value == 0.05
    restored = FixedKLController(coef=1.0)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == 0.05


def test_adaptive_controller_hand_worked_and_checkpoint() -> None:
    # target 6, horizon 10000, 256 samples: KL 9 → error clip(9/6 − 1) = clip(0.5) = 0.2 →
    # β·(1 + 0.2·256/10000) = 0.1·1.00512.  KL 3 → error −0.5 clipped to −0.2 → ·0.99488.
    ctrl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.1 * 1.00512, abs=1e-15)
    ctrl.update(current_kl=3.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.99488, abs=1e-15)
    # At the target nothing changes.
    before = ctrl.value
    ctrl.update(current_kl=6.0, n_steps=256)
    assert ctrl.value == before
    restored = AdaptiveKLController(0.5, 6.0, 10000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError, match="different algorithm.kl.adaptive setting"):
        FixedKLController(0.1).load_state_dict(ctrl.state_dict())
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=10)
