"""Overlong shaping: the soft overlong penalty and truncated responses (tasks.score.core), and the
score task that applies them to a training batch (stand-in scoring workers, in-process store)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from infra.config import ConfigError, load_config
from infra.runtime import Runtime
from storage import BatchMeta, open_store
from tasks.context import StageContext
from tasks.score.core import overlong_penalty, truncated_rows
from tasks.score.stage import ShardScores, compute_scores, score


def test_overlong_penalty_grows_linearly_over_the_buffer() -> None:
    # Cap 8, buffer 4: responses up to 8 − 4 = 4 tokens lose nothing; past that each extra token
    # costs penalty / 4 = 0.5 / 4 = 0.125: 5 tokens → 0.125, 6 → 0.25, 8 (the cap) → 0.5.
    lost = overlong_penalty(
        response_lengths=torch.tensor([0, 3, 4, 5, 6, 8]),
        max_new_tokens=8,
        buffer_length=4,
        penalty=0.5,
    )
    torch.testing.assert_close(lost, torch.tensor([0.0, 0.0, 0.0, 0.125, 0.25, 0.5]))
    off = overlong_penalty(
        response_lengths=torch.tensor([8, 8]), max_new_tokens=8, buffer_length=0, penalty=1.0
    )
    assert off.tolist() == [0.0, 0.0]


def test_truncated_means_at_the_cap_without_eos() -> None:
    # Cap 3, EOS ids {1, 9}: [5, 6, 7] was cut; [5, 6, 1] and [5, 6, 9] ended on an EOS at the cap;
    # [5, 1] and the empty response ended before it.
    rows = [[5, 6, 7], [5, 6, 1], [5, 6, 9], [5, 1], []]
    cut = truncated_rows(
        response_ids=[torch.tensor(r, dtype=torch.int64) for r in rows],
        eos_ids=(1, 9),
        max_new_tokens=3,
    )
    assert cut.tolist() == [True, False, False, False, False]


def test_the_buffer_must_be_shorter_than_the_cap() -> None:
    with pytest.raises(
        ConfigError, match="reward.overlong_buffer.length=8.*rollout.max_new_tokens"
    ):
        load_config(None, ["reward.overlong_buffer.length=8", "rollout.max_new_tokens=8"])


class StandInScorers:
    """Stands in for the scoring ``WorkerGroup``: every sample scored 1 by the reward model."""

    def __init__(self, lengths: list[int], cut: list[bool]) -> None:
        self.lengths, self.cut = lengths, cut

    def run_on_keys(self, step: Any, meta: BatchMeta, **kwargs: Any) -> list[ShardScores]:
        n = len(meta.keys)
        return [
            ShardScores(
                response_lengths=self.lengths,
                response_truncated=self.cut,
                rm=[1.0] * n,
                rule=[0.0] * n,
            )
        ]


def test_the_score_task_subtracts_the_penalty_and_writes_truncated() -> None:
    cfg = load_config(
        None,
        [
            "store.get_timeout_s=0.1",
            "reward.overlong_buffer.length=4",
            "reward.overlong_buffer.penalty=0.5",
            "rollout.mask_truncated=true",
        ],
    )
    store = open_store("memory://")
    keys = tuple(f"u{i}/0" for i in range(5))
    # Cap 8, buffer 4: lengths 2, 4, 5, 8, 8 lose 0, 0, 0.125, 0.5, 0.5 (mean 1.125 / 5); the
    # fourth was cut, the fifth ended on EOS at the cap.
    workers = StandInScorers([2, 4, 5, 8, 8], [False, False, False, True, False])
    rt = Runtime(store=store, train_group=workers, rollout_group=workers, reward_group=workers)
    ctx = StageContext(cfg=cfg, rt=rt, tokenizer=None)
    out = score(ctx, BatchMeta("train/step-000001", keys, ()), 1)
    assert {"scores", "truncated"} <= set(out.meta.fields)
    written = store.get_fields(out.meta, ("scores", "truncated"), timeout=1.0)
    torch.testing.assert_close(written["scores"], torch.tensor([1.0, 1.0, 0.875, 0.5, 0.5]))
    assert written["truncated"].tolist() == [False, False, False, True, False]
    assert out.metrics["reward/overlong_penalty/mean"] == pytest.approx(1.125 / 5)
    assert out.metrics["response/truncated_fraction"] == pytest.approx(1 / 5)
    assert out.metrics["critic/score/mean"] == pytest.approx(3.875 / 5)


def test_validation_loses_no_penalty_and_every_part_is_named_alike_where_it_is_read() -> None:
    """The rewards of ``tasks.score.stage.REWARDS``: a training batch's scoring holds the
    overlong penalty as one more part, validation's holds none; the saved ``reward_parts`` name
    the same parts as the batch's scores."""
    cfg = load_config(
        None, ["reward.overlong_buffer.length=4", "reward.overlong_buffer.penalty=0.5"]
    )
    store = open_store("memory://")
    keys = tuple(f"u{i}/0" for i in range(5))
    workers = StandInScorers([2, 4, 5, 8, 8], [False] * 5)
    rt = Runtime(store=store, train_group=workers, rollout_group=workers, reward_group=workers)
    ctx = StageContext(cfg=cfg, rt=rt, tokenizer=None)
    meta = BatchMeta("train/step-000001", keys, ())
    training = ctx.plan.scoring
    trained = compute_scores(ctx, meta, training)
    validated = compute_scores(ctx, meta, replace(training, overlong=False))
    assert list(trained.named) == ["rm", "rule", "overlong_penalty"]  # the rule at weight 0
    assert list(validated.named) == ["rm", "rule"]
    torch.testing.assert_close(trained.total, torch.tensor([1.0, 1.0, 0.875, 0.5, 0.5]))
    torch.testing.assert_close(validated.total, torch.ones(5))
    out = score(ctx, meta, 1)
    saved = store.get_fields(out.meta, ("reward_parts",), timeout=1.0)["reward_parts"]
    assert [set(parts) for parts in saved] == [set(trained.named)] * 5
    assert saved[3]["overlong_penalty"] == 0.5 and saved[3]["rm"] == 1.0
