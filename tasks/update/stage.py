"""update: PPO update of the actor (and critic) on the training workers, then weight sync.

The batch is sharded over the data-parallel training workers; each worker reads its rows
(``update_rows``), runs ``tasks.update.optimize`` on them and sends back its metrics. Losses are
normalised by the batch's global token and sequence counts (summed over the workers with an
all-reduce) and the gradients are summed by the training strategy (``infra.training``: FSDP2's
reduce-scatter), so N workers make the same update as one. After the
update the rollout engine gets the new weights (in-process on a colocated pool; through Ray's
object store when the rollout has its own pool).

Data-parallel workers each see ``1 / world_size`` of every mini-batch, so their mini/micro
batch sizes are the configured (global) ones divided by the world size (``actor_settings``).

The actor's loss is corrected against the behaviour policy's ``rollout_logprobs`` as the step
plan says (``StepPlan.rollout_correction``, ``tasks.update.correction``), and rows the plan
masks (``truncated``, with ``rollout.mask_truncated``) leave the actor's loss mask only: their
advantages were already computed with their group, and the critic still fits them. In a
multi-turn run (``StepPlan.multi_turn``) the stored ``loss_mask`` leaves tool-message tokens out
of both the actor's and the critic's masks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import Tensor

from infra.colocate import TrainableModel
from infra.training import gradient_sync
from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.batching import PackedBatch
from tasks.context import Metrics, StageContext, StageResult, faults_at
from tasks.io import padded
from tasks.logprobs.stage import agree_count, read_packed
from tasks.update.optimize import (
    ActorUpdateSettings,
    CriticUpdateSettings,
    actor_update,
    count_minibatch_units,
    critic_update,
)
from tasks.update.settings import actor_settings, critic_settings


def _global_units(
    worker: ModelWorker, mask: Tensor, mini_batch_size: int, agg: str
) -> list[float] | None:
    """Each mini-batch's loss denominator summed over the data-parallel workers (None: one worker)."""
    if worker.spec.world_size == 1:
        return None
    import torch.distributed as dist

    units = torch.tensor(
        count_minibatch_units(response_mask=mask, mini_batch_size=mini_batch_size, agg=agg),
        dtype=torch.float64,
    )
    dist.all_reduce(units, op=dist.ReduceOp.SUM)
    return list(units.tolist())


def update_rows(
    worker: ModelWorker,
    shard: BatchMeta,
    *,
    step: int,
    fields: dict[str, str],
    actor: ActorUpdateSettings,
    critic: CriticUpdateSettings | None,
) -> Metrics:
    """Worker side, at most once per step (``ModelWorker.once``): read my samples → one PPO
    update of the actor (and critic) → new policy version. ``fields`` maps the store's field
    names to the names the update takes them under (``StepPlan.update_fields``)."""
    return worker.once(
        f"update@{step}", lambda: _update(worker, shard, fields=fields, actor=actor, critic=critic)
    )


def _update(
    worker: ModelWorker,
    shard: BatchMeta,
    *,
    fields: dict[str, str],
    actor: ActorUpdateSettings,
    critic: CriticUpdateSettings | None,
) -> dict[str, float]:
    """1. Read the shard (``_update_inputs``). 2. The actor's update, then the new policy's
    log-probs of the weight-sync probe. 3. The critic's update. 4. Publish the new version."""
    # 1.
    batch, actor_batch, given = _update_inputs(worker, shard, fields)
    metrics: dict[str, float] = {}
    # 2.
    with worker.awake("actor") as model:
        metrics.update(
            actor_update(
                **_trainer_inputs(worker, model, actor, actor_batch),
                old_logprobs=given.get("old_logprobs"),
                advantages=given["advantages"],
                ref_logprobs=given.get("ref_logprobs"),
                rollout_logprobs=given.get("rollout_logprobs"),
                teacher_logprobs=given.get("teacher_logprobs"),
                cfg=actor,
            )
        )
        # The new policy's log-probs of the weight-sync probe, for a colocated rollout engine.
        probe = worker.trainer_probe(model.module)
    # 3.
    if critic is not None:
        with worker.awake("critic") as model:
            metrics.update(
                critic_update(
                    **_trainer_inputs(worker, model, critic, batch),
                    old_values=given["values"],
                    returns=given["returns"],
                    cfg=critic,
                )
            )
    # 4.
    worker.publish_policy(probe)
    return metrics


def _update_inputs(
    worker: ModelWorker, shard: BatchMeta, fields: dict[str, str]
) -> tuple[PackedBatch, PackedBatch, dict[str, torch.Tensor]]:
    """``(batch, actor_batch, given)`` of my samples: the packed batch with the multi-turn
    ``loss_mask`` folded into its response mask (the critic's), the same without truncated
    rows (the actor's), and the per-token fields padded to the batch's (B, T) under the names
    the update takes them by."""
    batch = read_packed(worker, shard)
    data = worker.read(shard, tuple(fields))
    truncated = data.pop("truncated", None)  # (B,) bool: rows left out of the actor's loss
    loss_mask = data.pop("loss_mask", None)  # jagged bool: False on tool tokens (multi-turn)
    width = batch.response_mask.shape[1]
    if loss_mask is not None:
        sampled = batch.response_mask & padded(loss_mask, width).bool()  # (B, T)
        batch = dataclasses.replace(batch, response_mask=sampled)
    given = {fields[name]: padded(value, width).float() for name, value in data.items()}
    actor_batch = batch
    if truncated is not None:
        kept = batch.response_mask & ~truncated.to(torch.bool).unsqueeze(1)  # (B, T)
        actor_batch = dataclasses.replace(batch, response_mask=kept)
    return batch, actor_batch, given


def _trainer_inputs(
    worker: ModelWorker,
    role: TrainableModel,
    settings: ActorUpdateSettings | CriticUpdateSettings,
    batch: PackedBatch,
) -> dict[str, Any]:
    """What the actor's and the critic's updates both take: the model of ``role``, its
    optimizer and scheduler, the batch and the data-parallel reduction."""
    units = _global_units(worker, batch.response_mask, settings.mini_batch_size, settings.agg)
    return {
        "model": role.module,
        "optimizer": role.optimizer,
        "scheduler": role.scheduler,
        "batch": batch,
        "micro_batch_count": functools.partial(agree_count, worker),
        "grad_sync": functools.partial(gradient_sync, role.module),
        "global_tokens": units,
        "global_seqs": units,
    }


# Each data-parallel worker returns its SHARE of these losses (divided by the global token or
# sequence count): the batch's loss is their sum. The MAXIMA are each worker's largest value:
# the batch's is their max. Every other metric is a per-worker mean of equal-sized shards (or
# the same on every worker, like the all-reduced grad norm): averaged.
SHARED_LOSSES = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/distill_loss",
    "actor/entropy",
    "critic/vf_loss",
)
MAXIMA = ("rollout_corr/is_weight_max",)


def combine_worker_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """One batch's metrics from the data-parallel workers' (see ``SHARED_LOSSES``, ``MAXIMA``)."""

    def combine(key: str) -> float:
        values = [r[key] for r in results]
        if key in MAXIMA:
            return max(values)
        return sum(values) / (1 if key in SHARED_LOSSES else len(values))

    return {key: combine(key) for key in results[0]}


def sync_rollout_weights(ctx: StageContext) -> Metrics:
    """Push the actor's weights to a rollout pool that is not the training pool: every training
    worker takes part in gathering them; rank 0's reply carries them, from its worker to the
    rollout workers without passing through this process. Each rollout worker checks them with
    the weight-sync probe at once; returns the ``sync/*`` metrics (the slowest worker's time,
    the largest probe difference)."""
    if ctx.rt.rollout_group is ctx.rt.train_group:
        return {}
    version = ctx.rt.train_group.call(ModelWorker.ping)[0]["version"]
    replies = ctx.rt.train_group.relay(
        ModelWorker.policy_state, ctx.rt.rollout_group, ModelWorker.load_policy, version
    )
    return {key: max(r[key] for r in replies) for key in replies[0]} if replies else {}


@faults_at("update", lambda ctx: ctx.rt.train_group)
def update(ctx: StageContext, meta: BatchMeta, step: int) -> StageResult:
    world = ctx.rt.train_group.size
    # 1. Every training worker updates on its shard (they normalise by global counts), once per
    # step: a retry gets the first attempt's result.
    results = ctx.rt.train_group.run_sharded(
        update_rows,
        meta,
        step=step,
        fields=ctx.plan.update_fields,
        actor=actor_settings(ctx.cfg, world, ctx.plan),
        critic=critic_settings(ctx.cfg, world) if ctx.plan.critic else None,
    )
    # 2. Weight sync; the metrics: losses summed over the workers' shares, the rest averaged.
    synced = sync_rollout_weights(ctx)
    return StageResult(meta, {**combine_worker_metrics(results), **synced})
