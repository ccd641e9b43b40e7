"""Dynamic sampling: the pure choice of groups (hand-worked values, a loop reference) and the
filter task on a real store (rows removed once, a retried task deciding the same)."""

from __future__ import annotations

import pytest
import torch

from infra.config import ConfigError, load_config
from infra.runtime import Runtime
from storage import BatchMeta, open_store
from tasks.context import StageContext
from tasks.filter.core import choose_groups, refill_size, varying_groups
from tasks.filter.stage import FilterJob, filter_groups


def test_varying_groups_by_hand() -> None:
    # group 7: 1, 1 → no spread; group 3: 0, 1 → spread; group 5: a single sample → none.
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([7, 3, 7, 3, 5])
    assert varying_groups(values=values, group_ids=groups).tolist() == [
        False,
        True,
        False,
        True,
        False,
    ]


def test_varying_groups_matches_a_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 3, (200,), generator=gen).double()  # (B,)
    groups = torch.randint(0, 40, (200,), generator=gen)  # (B,)
    got = varying_groups(values=values, group_ids=groups)
    for i in range(200):
        same = values[groups == groups[i]]
        assert bool(got[i]) == bool(same.max() > same.min())


def test_choose_groups_keeps_the_first_spread_groups_in_order() -> None:
    # groups in order 4, 1, 9, 2 (two samples each); 1 has no spread.
    values = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.2, 0.3, 5.0, 4.0])
    groups = torch.tensor([4, 4, 1, 1, 9, 9, 2, 2])
    choice = choose_groups(values=values, group_ids=groups, want=2)
    assert choice.kept == (4, 9) and choice.dropped == (1,) and choice.surplus == (2,)
    everything = choose_groups(values=values, group_ids=groups, want=10)
    assert everything.kept == (4, 9, 2) and everything.surplus == ()


def test_refill_size_follows_the_keep_rate_within_bounds() -> None:
    assert refill_size(missing=0, kept=8, judged=8, cap=8) == 0
    assert refill_size(missing=4, kept=4, judged=8, cap=8) == 8  # half kept: 4 / 0.5
    assert refill_size(missing=2, kept=6, judged=8, cap=8) == 3  # ceil(2 / 0.75)
    assert refill_size(missing=3, kept=0, judged=8, cap=8) == 8  # nothing kept yet: the cap
    assert refill_size(missing=5, kept=1, judged=8, cap=8) == 8  # capped


def _ctx(store, *extra: str) -> StageContext:
    cfg = load_config(None, ["algorithm.filter_groups.enabled=true", *extra])
    rt = Runtime(store=store, train_group=None, rollout_group=None)  # type: ignore[arg-type]
    return StageContext(cfg=cfg, rt=rt, tokenizer=None)


def _put(store, partition: str) -> BatchMeta:
    # Three groups of two: g0 spreads on score, g1 does not, g2 spreads on score.
    keys = ["a/0", "a/1", "b/0", "b/1", "c/0", "c/1"]
    store.kv_batch_put(
        keys,
        partition,
        {
            "scores": torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 2.0]),
            "group_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
            "reward_parts": [{"fn/f": v} for v in (1.0, 1.0, 0.0, 1.0, 3.0, 3.0)],
        },
    )
    return BatchMeta(partition, tuple(keys), ("scores", "group_ids"))


def test_filter_task_removes_dropped_and_surplus_rows_once() -> None:
    store, partition = open_store("memory://"), "train/step-000002"
    meta = _put(store, partition)
    ctx = _ctx(store)
    out = filter_groups(ctx, FilterJob(meta, want=1, round=0), 2)
    assert out.meta.keys == ("a/0", "a/1")
    assert (out.choice.kept, out.choice.dropped, out.choice.surplus) == ((0,), (1,), (2,))
    assert out.removed == 4 and sorted(store.kv_list(partition)) == ["a/0", "a/1"]
    again = filter_groups(ctx, FilterJob(meta, want=1, round=0), 2)  # a retried try
    assert again.meta.keys == out.meta.keys and again.removed == 0


def test_filter_task_reads_a_reward_function_part() -> None:
    store, partition = open_store("memory://"), "train/step-000000"
    meta = _put(store, partition)
    ctx = _ctx(
        store, "algorithm.filter_groups.metric=f", "reward.functions=[{path: m.py, name: f}]"
    )
    out = filter_groups(ctx, FilterJob(meta, want=3, round=0), 0)
    assert out.choice.kept == (1,) and out.meta.keys == ("b/0", "b/1")


def test_filter_metric_must_be_computed_by_the_run() -> None:
    with pytest.raises(ConfigError, match="filter_groups.metric='nope'.*reward.functions"):
        load_config(
            None, ["algorithm.filter_groups.enabled=true", "algorithm.filter_groups.metric=nope"]
        )
    with pytest.raises(ConfigError, match="rollout.n=1"):
        load_config(None, ["algorithm.filter_groups.enabled=true", "rollout.n=1"])
