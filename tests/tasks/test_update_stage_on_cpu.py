"""The update stage's worker side (tasks.update.stage) on a stand-in worker over an in-process
store: truncated rows leave the actor's loss; the data-parallel workers' metrics combine into
the batch's."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from test_optimize_on_cpu import (  # helpers of the fixed-row update tests
    VOCAB,
    actor_settings,
    assert_same_parameters,
    one_torch_thread,  # noqa: F401  (autouse fixture: one torch thread in this module too)
    tiny_policy,
)
from torch import nn

from infra.config import load_config
from storage import BatchMeta, open_store
from tasks.step import run_steps
from tasks.update.stage import MAXIMA, SHARED_LOSSES, combine_worker_metrics, update_steps


def test_worker_metrics_sum_losses_take_the_max_of_maxima_and_average_the_rest() -> None:
    loss, peak = SHARED_LOSSES[0], MAXIMA[0]
    results = [
        {loss: 0.25, peak: 3.0, "rollout_corr/kl_k1": 0.1},
        {loss: 0.5, peak: 5.0, "rollout_corr/kl_k1": 0.3},
    ]
    assert combine_worker_metrics(results) == pytest.approx(
        {loss: 0.75, peak: 5.0, "rollout_corr/kl_k1": 0.2}
    )


@dataclass
class Role:
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: None = None


@dataclass
class Spec:
    world_size: int = 1


class StandInWorker:
    """What ``run_steps`` and the update's steps use of a ``ModelWorker``: a store, one awake
    actor."""

    def __init__(self, store: Any, model: nn.Module) -> None:
        self.store, self.spec, self.pad_id, self.cfg = store, Spec(), 0, load_config(None, [])
        self.actor = Role(model, torch.optim.SGD(model.parameters(), lr=0.5))

    @contextlib.contextmanager
    def awake(self, role: str) -> Iterator[Role]:
        assert role == "actor"
        yield self.actor

    def trainer_probe(self, module: nn.Module) -> None:
        return None  # no rollout engine to check

    def publish_policy(self, probe: torch.Tensor | None = None) -> None:
        pass


def test_truncated_rows_leave_the_actors_loss_as_if_they_were_not_there() -> None:
    """Token-mean over one mini-batch: masking rows 1 and 4 gives the same step as a batch
    without them (their tokens leave both the sum and the denominator)."""
    generator = torch.Generator().manual_seed(3)
    keys = [f"p{i}/0" for i in range(6)]
    store = open_store("memory://")
    response_ids = [
        torch.randint(2, VOCAB, (int(n),), generator=generator) for n in (3, 4, 2, 5, 4, 1)
    ]
    store.kv_batch_put(
        keys,
        "train/step-000001",
        {
            "prompt_ids": [torch.randint(2, VOCAB, (3,), generator=generator) for _ in keys],
            "response_ids": response_ids,
            "advantages": [torch.randn(r.numel(), generator=generator) for r in response_ids],
            "rollout_logprobs": [-torch.rand(r.numel(), generator=generator) for r in response_ids],
            "truncated": torch.tensor([False, True, False, False, True, False]),
        },
    )
    reference = tiny_policy(seed=3)
    settings = actor_settings(
        "token-mean", micro=8, ppo_epochs=1, kl_loss_coef=0.0, rollout_correction="token_truncate"
    )
    reads = ("prompt_ids", "response_ids", "advantages", "rollout_logprobs")

    def update(rows: list[int], masked: bool) -> tuple[nn.Module, dict[str, float]]:
        worker = StandInWorker(store, copy.deepcopy(reference))
        shard = BatchMeta("train/step-000001", tuple(keys[i] for i in rows), ())
        steps = update_steps((*reads, "truncated") if masked else reads, settings, None)
        stored = store.kv_list(shard.partition_id)
        metrics = run_steps(worker, shard, steps).metrics  # type: ignore[arg-type]
        assert store.kv_list(shard.partition_id) == stored  # the update writes nothing
        return worker.actor.module, metrics

    masked, masked_metrics = update(list(range(6)), masked=True)
    dropped, dropped_metrics = update([0, 2, 3, 5], masked=False)
    assert not torch.equal(next(masked.parameters()), next(reference.parameters()))
    assert_same_parameters(masked, dropped, atol=1e-6)  # advantages are stored in float32
    for key in ("actor/pg_loss", "rollout_corr/kl_k1", "rollout_corr/is_weight_max"):
        assert masked_metrics[key] == pytest.approx(dropped_metrics[key], abs=1e-6), key
