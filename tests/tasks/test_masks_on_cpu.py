"""Masked reductions: hand-worked values, a float64 loop reference, and invariants."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.masks import lengths_to_mask, masked_mean, masked_sum, masked_var, masked_whiten


def test_lengths_to_mask_hand_worked() -> None:
    # lengths 0, 2, 3 in width 3: True where position < length.
    mask = lengths_to_mask(torch.tensor([0, 2, 3]), 3)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[False, False, False], [True, True, False], [True, True, True]]


def test_lengths_to_mask_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="width"):
        lengths_to_mask(torch.tensor([4]), 3)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        lengths_to_mask(torch.tensor([-1]), 3)


def test_masked_reductions_hand_worked() -> None:
    # Real values 1, 2, 3, 6 (the NaN and 100 sit under the mask and must not leak in).
    # sum 12, mean 3, unbiased var ((−2)² + (−1)² + 0² + 3²) / 3 = 14 / 3.
    values = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 6.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    assert masked_sum(values, mask).item() == 12.0
    assert masked_mean(values=values, mask=mask).item() == 3.0
    assert masked_mean(values, mask, dim=1).tolist() == [1.5, 4.5]
    assert masked_var(values, mask).item() == pytest.approx(14 / 3, abs=1e-12)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14 / 4, abs=1e-12)
    whitened = masked_whiten(values, mask)
    scale = 1 / math.sqrt(14 / 3 + 1e-8)
    expected = [[-2 * scale, -1 * scale, 0.0], [0.0, 3 * scale, 0.0]]
    torch.testing.assert_close(whitened, torch.tensor(expected, dtype=torch.float64))


def test_all_masked_reduces_to_zero_not_nan() -> None:
    values = torch.full((2, 3), float("nan"), dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(values, mask).item() == 0.0
    assert masked_var(values, mask).item() == 0.0
    assert torch.equal(masked_whiten(values, mask), torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whiten_matches_loop_reference(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=generator) < 0.6
    real = [float(values[b, t]) for b in range(5) for t in range(7) if mask[b, t]]
    mean = sum(real) / len(real)
    var = sum((x - mean) ** 2 for x in real) / (len(real) - 1)
    expected = [
        [
            (float(values[b, t]) - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
            for t in range(7)
        ]
        for b in range(5)
    ]
    torch.testing.assert_close(
        masked_whiten(values, mask), torch.tensor(expected, dtype=torch.float64), atol=1e-10, rtol=0
    )
    # Invariants: whitened real values have mean 0 and unbiased variance ≈ 1.
    whitened = masked_whiten(values, mask)
    assert abs(masked_mean(whitened, mask).item()) < 1e-12
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-6)
    shifted = masked_whiten(values, mask, shift_mean=False)
    assert masked_mean(shifted, mask).item() == pytest.approx(mean, abs=1e-10)
