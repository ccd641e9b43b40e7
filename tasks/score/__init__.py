"""Score assembly (pure math). The Prefect stage lives in `tasks/score/stage.py`."""

from tasks.score.core import (
    assemble_rm_scores,
    find_nonfinite,
    lengths_to_mask,
    place_scores,
    score_metrics,
)

__all__ = [
    "assemble_rm_scores",
    "find_nonfinite",
    "lengths_to_mask",
    "place_scores",
    "score_metrics",
]
