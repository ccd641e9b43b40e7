"""Score assembly: the score lands on the last real token; an empty response never indexes −1."""

from __future__ import annotations

import pytest
import torch

from tasks.score import (
    assemble_rm_scores,
    find_nonfinite,
    lengths_to_mask,
    place_scores,
    score_metrics,
)


def test_place_scores_hand_worked_with_empty_response() -> None:
    # Lengths 2, 0, 3 in width 3: row 0 gets 0.5 at index 1; row 1 (empty) stays all zero — a
    # naive scores[length − 1] would have written −1.0 into its last column; row 2 gets 2.0 at 2.
    scores = torch.tensor([0.5, -1.0, 2.0])
    placed = place_scores(scores, torch.tensor([2, 0, 3]), 3)
    assert placed.tolist() == [[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0]]
    assert placed.dtype == torch.float32


def test_place_scores_matches_loop_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 6, (16,), generator=generator)
    scores = torch.randn(16, generator=generator, dtype=torch.float64)
    placed = place_scores(scores, lengths, 6)
    expected = torch.zeros(16, 6, dtype=torch.float64)
    for b in range(16):
        if lengths[b] > 0:
            expected[b, int(lengths[b]) - 1] = scores[b]
    assert torch.equal(placed, expected)
    # Invariant: the row sums give the scores back except for empty responses.
    torch.testing.assert_close(placed.sum(1), torch.where(lengths > 0, scores, 0.0))
    assert not placed[~lengths_to_mask(lengths, 6)].any()


def test_place_scores_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="width"):
        place_scores(torch.tensor([1.0]), torch.tensor([4]), 3)
    with pytest.raises(ValueError, match="rows"):
        place_scores(torch.tensor([1.0, 2.0]), torch.tensor([1]), 3)


def test_assemble_rm_scores_jagged_rows() -> None:
    rows = assemble_rm_scores(torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2, 0, 1]))
    assert [r.tolist() for r in rows] == [[0.0, 0.5], [], [2.0]]


def test_find_nonfinite() -> None:
    scores = torch.tensor([0.0, float("nan"), 1.0, float("inf"), -float("inf")])
    assert find_nonfinite(scores) == [1, 3, 4]
    assert find_nonfinite(torch.tensor([1.0, 2.0])) == []


def test_score_metrics_hand_worked() -> None:
    metrics = score_metrics(
        scores=torch.tensor([1.0, -2.0, 4.0, 1.0]), response_lengths=torch.tensor([3, 0, 1, 0])
    )
    assert metrics == {
        "critic/score/mean": 1.0,
        "critic/score/max": 4.0,
        "critic/score/min": -2.0,
        "response/empty_ratio": 0.5,
    }
