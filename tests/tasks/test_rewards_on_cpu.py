"""Rule rewards and the weighted sum of reward components."""

from __future__ import annotations

import pytest
import torch

from tasks.rewards import RULES, exact_match, hash_answer_match, parse_hash_answer, weighted_sum


def test_exact_match_strips_whitespace() -> None:
    assert exact_match("  42\n", "42") == 1.0
    assert exact_match("42 ", " 42") == 1.0
    assert exact_match("4 2", "42") == 0.0
    assert exact_match("", "") == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 72 left\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("####-3.5", "-3.5"),
        ("#### +7", "7"),
        ("first #### 5, then #### 8", "8"),  # the last answer counts
        ("#### .5", ".5"),
        ("no marker 12", None),
        ("#### twelve", None),
        ("", None),
    ],
)
def test_parse_hash_answer(text: str, expected: str | None) -> None:
    assert parse_hash_answer(text) == expected


def test_hash_answer_match() -> None:
    assert hash_answer_match("work...\n#### 1,000", "1000") == 1.0
    assert hash_answer_match("#### 72.0", "#### 72") == 1.0  # same value
    assert hash_answer_match("#### 71", "72") == 0.0
    assert hash_answer_match("72", "72") == 0.0  # no #### answer in the response
    assert set(RULES) == {"exact_match", "hash_answer_match"}


def test_weighted_sum_hand_worked() -> None:
    # 0.5·[2, 4] + 1·[1, 0] + 0·[100, 100] = [2, 2]; a weight of 0 keeps a component logged only.
    total = weighted_sum(
        {
            "rm": torch.tensor([2.0, 4.0]),
            "rule": torch.tensor([1, 0]),
            "log_only": torch.tensor([100.0, 100.0]),
        },
        {"rm": 0.5, "rule": 1.0, "log_only": 0.0},
    )
    assert total.tolist() == [2.0, 2.0]
    assert total.dtype == torch.float32
    assert (
        weighted_sum({"a": torch.ones(2, dtype=torch.float64)}, {"a": 2.0}).dtype == torch.float64
    )


def test_weighted_sum_errors_name_what_is_missing() -> None:
    with pytest.raises(KeyError, match=r"without a weight \['rule'\]"):
        weighted_sum({"rm": torch.ones(2), "rule": torch.ones(2)}, {"rm": 1.0})
    with pytest.raises(KeyError, match=r"weights without a component \['length'\]"):
        weighted_sum({"rm": torch.ones(2)}, {"rm": 1.0, "length": 0.1})
    with pytest.raises(ValueError, match="one shape"):
        weighted_sum({"a": torch.ones(2), "b": torch.ones(3)}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match="at least one"):
        weighted_sum({}, {})
