"""A reward function with verl's signature, for the addition example (addition-reward-fn.yaml).

ppoflow calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` once per
sample, in a pool of worker processes; ``solution_str`` is the decoded response (special tokens
skipped). Returning a dict logs every extra number as ``reward_extra/<key>/mean``.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: object,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float | bool]:
    answer = solution_str.strip()
    well_formed = bool(_NUMBER.fullmatch(answer))
    correct = well_formed and int(answer) == int(str(ground_truth).strip())
    return {"score": 1.0 if correct else 0.0, "acc": correct, "well_formed": well_formed}
