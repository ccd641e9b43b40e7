"""The score task's resume path: rows already scored are not scored again."""

from __future__ import annotations

import pytest
import torch

from infra.config import load_config
from infra.runtime import Runtime
from storage import BatchMeta, open_store
from tasks.context import StageContext
from tasks.score.stage import score


def test_rows_scored_before_a_restart_are_not_scored_again() -> None:
    store = open_store("memory://")
    keys, partition = ["u1/0", "u1/1"], "train/step-000003"
    scored = {
        "scores": torch.tensor([0.5, -0.5]),
        "rule_scores": torch.tensor([1.0, 0.0]),
        "rm_scores": [torch.tensor([0.0, 0.5]), torch.tensor([-0.5])],
        "reward_parts": [{"rm": 0.5, "rule": 1.0}, {"rm": -0.5, "rule": 0.0}],
    }
    store.kv_batch_put(keys, partition, scored)
    # Reward workers that only record what they are asked to score.
    workers = AskedToScore()
    rt = Runtime(store=store, train_group=workers, rollout_group=workers, reward_group=workers)
    ctx = StageContext(cfg=load_config(None, ["store.get_timeout_s=0.1"]), rt=rt, tokenizer=None)
    meta = BatchMeta(partition_id=partition, keys=tuple(keys), fields=())
    out = score(ctx, meta, 3)
    writes = ctx.plan.scoring.writes
    assert writes == ("scores", "reward_parts", "rm_scores", "rule_scores")
    assert set(writes) <= set(out.meta.fields)
    assert not out.metrics and not workers.asked  # nothing recomputed, nothing recorded
    # One key without scores: the whole batch goes to the reward workers again.
    partial = BatchMeta(partition_id=partition, keys=(*keys, "u2/0"), fields=())
    with pytest.raises(LookupError, match="asked to score"):
        score(ctx, partial, 3)
    assert workers.asked == [partial.keys]


class AskedToScore:
    """Stands in for a reward ``WorkerGroup``: records the batch it is asked to score."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, ...]] = []

    def run_on_keys(self, step, meta, **kwargs):
        self.asked.append(meta.keys)
        raise LookupError(f"asked to score {len(meta.keys)} samples")
