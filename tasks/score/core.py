"""Score assembly: a reward-model ensemble's members → one score per sample (mean − penalty ×
std); one score per sample → token-level rows; response truncation and the overlong penalty.

A sample's score belongs to its last real response token. An EMPTY response (length 0) has no
such token: its dense row is all zeros and its jagged row is empty — never index −1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tasks.masks import lengths_to_mask

__all__ = [
    "EnsembleScores",
    "assemble_rm_scores",
    "ensemble_scores",
    "find_nonfinite",
    "lengths_to_mask",
    "overlong_penalty",
    "place_scores",
    "score_metrics",
    "truncated_rows",
]


@dataclass(frozen=True)
class EnsembleScores:
    """A reward-model ensemble's view of B samples, each (B,) float32: ``score`` = ``mean`` −
    penalty × ``std`` is the reward; ``mean`` and ``std`` are over the members."""

    score: Tensor
    mean: Tensor
    std: Tensor


def ensemble_scores(member_scores: Tensor, *, uncertainty_penalty: float) -> EnsembleScores:
    """Combine ``member_scores`` (B, M), one column per member, into one score per sample:
    ``mean − uncertainty_penalty × std`` over the members, where std is the population standard
    deviation (divided by M, so one member has std 0 and scores exactly its own score).
    """
    if member_scores.dim() != 2 or member_scores.shape[1] < 1:
        raise ValueError(
            f"member_scores must be (B, M) with M >= 1, got {tuple(member_scores.shape)}"
        )
    if uncertainty_penalty < 0:
        raise ValueError(f"uncertainty_penalty must be >= 0, got {uncertainty_penalty}")
    scores = member_scores.float()  # (B, M)
    mean = scores.mean(dim=1)  # (B,)
    std = scores.std(dim=1, correction=0)  # (B,)
    return EnsembleScores(score=mean - uncertainty_penalty * std, mean=mean, std=std)


def _check_scores_and_lengths(scores: Tensor, response_lengths: Tensor) -> None:
    if scores.dim() != 1 or response_lengths.dim() != 1:
        raise ValueError(
            f"scores and response_lengths must be 1-D (B,), got {tuple(scores.shape)} "
            f"and {tuple(response_lengths.shape)}"
        )
    if scores.shape[0] != response_lengths.shape[0]:
        raise ValueError(
            f"scores has {scores.shape[0]} rows but response_lengths has "
            f"{response_lengths.shape[0]}"
        )


def place_scores(scores: Tensor, response_lengths: Tensor, width: int) -> Tensor:
    """Dense (B, width) float rows: the score at index length − 1, zeros elsewhere.

    An empty response (length 0) gets an all-zero row.
    """
    _check_scores_and_lengths(scores, response_lengths)
    mask = lengths_to_mask(response_lengths, width)  # (B, width), also checks the lengths
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    placed = torch.zeros(mask.shape, dtype=dtype, device=scores.device)  # (B, width)
    has_token = response_lengths > 0  # (B,)
    rows = torch.nonzero(has_token).squeeze(1)  # (B',)
    last = response_lengths[rows] - 1  # (B',)
    placed[rows, last] = scores[rows].to(dtype)
    return placed


def assemble_rm_scores(scores: Tensor, response_lengths: Tensor) -> list[Tensor]:
    """Jagged rows (one per sample, length = response length): the score on the last token.

    An empty response gives an empty row.
    """
    _check_scores_and_lengths(scores, response_lengths)
    width = int(response_lengths.max()) if response_lengths.numel() else 0
    placed = place_scores(scores, response_lengths, width)  # (B, T)
    return [row[: int(length)] for row, length in zip(placed, response_lengths.tolist())]


def find_nonfinite(scores: Tensor) -> list[int]:
    """Indices (in row order) of NaN or ±inf scores; empty when all are finite."""
    bad = ~torch.isfinite(scores)
    if bad.dim() > 1:
        bad = bad.flatten(1).any(dim=1)
    return [int(i) for i in torch.nonzero(bad).flatten().tolist()]


def score_metrics(*, scores: Tensor, response_lengths: Tensor) -> dict[str, float]:
    """`critic/score/mean|max|min` and `response/empty_ratio` for one batch."""
    _check_scores_and_lengths(scores, response_lengths)
    if scores.numel() == 0:
        raise ValueError("score_metrics needs at least one sample, got an empty batch")
    as_float = scores.double()
    return {
        "critic/score/mean": float(as_float.mean()),
        "critic/score/max": float(as_float.max()),
        "critic/score/min": float(as_float.min()),
        "response/empty_ratio": float((response_lengths == 0).double().mean()),
    }


def truncated_rows(
    *, response_ids: Sequence[Tensor], eos_ids: Sequence[int], max_new_tokens: int
) -> Tensor:
    """(B,) bool: True for a response cut at the cap, i.e. ``max_new_tokens`` tokens long with a
    last token that is not one of ``eos_ids`` (a response that ends on EOS at the cap is whole)."""
    eos = torch.tensor(list(eos_ids), dtype=torch.int64)  # (E,)
    return torch.tensor(
        [
            int(row.numel()) >= max_new_tokens and not bool((eos == int(row[-1])).any())
            for row in response_ids
        ],
        dtype=torch.bool,
    )  # (B,)


def overlong_penalty(
    *, response_lengths: Tensor, max_new_tokens: int, buffer_length: int, penalty: float
) -> Tensor:
    """(B,) float32: what each response loses from its score (DAPO's soft overlong punishment).

    A response longer than ``max_new_tokens − buffer_length`` loses ``penalty · excess /
    buffer_length``, growing linearly to ``penalty`` at the cap; ``buffer_length`` 0 is off.
    """
    if buffer_length == 0:
        return torch.zeros(response_lengths.shape, dtype=torch.float32)  # (B,)
    if not 0 < buffer_length < max_new_tokens:
        raise ValueError(
            f"buffer_length ({buffer_length}) must lie in (0, max_new_tokens={max_new_tokens})"
        )
    excess = (response_lengths - (max_new_tokens - buffer_length)).clamp(min=0)  # (B,)
    return penalty * excess.to(torch.float32) / buffer_length  # (B,)
