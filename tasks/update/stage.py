"""update: PPO update of the actor (and critic) on the training workers, then weight sync.

The batch is sharded over the data-parallel training workers; each worker runs the update's
declared steps on its rows (``update_steps``, ``tasks.step``: the critic's, then the actor's,
each ``tasks.update.optimize`` on the shard) and sends back its metrics. Losses are
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
advantages were already computed with their group, and the critic still fits them. Both
train on the shard's ``response_mask``: in a multi-turn run the stored ``loss_mask`` folded in
(``tasks.step``), which leaves tool-message tokens out.
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
from tasks.logprobs.stage import agree_count
from tasks.step import Shard, WorkerStep, run_steps
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


def _batches(worker: ModelWorker, shard: Shard) -> tuple[PackedBatch, PackedBatch]:
    """``(batch, actor_batch)``: the packed batch with the shard's ``response_mask`` (the
    sampled tokens: the critic's), and the same without the truncated rows when the shard holds
    ``truncated`` (the actor's)."""
    packed = shard.packed(worker.pad_id)
    width = packed.response_mask.shape[1]
    batch = dataclasses.replace(packed, response_mask=shard.padded("response_mask", width))
    if shard.truncated is None:
        return batch, batch
    kept = batch.response_mask & ~shard.truncated.to(torch.bool).unsqueeze(1)  # (B, T)
    return batch, dataclasses.replace(batch, response_mask=kept)


def _optional(field: Tensor | None, width: int) -> Tensor | None:
    """A jagged float field of the shard padded to (B, ``width``), None when it holds none."""
    return None if field is None else padded(field, width).float()


def _actor_step(
    worker: ModelWorker,
    module: torch.nn.Module | None,
    shard: Shard,
    *,
    settings: ActorUpdateSettings,
) -> tuple[Shard, Metrics]:
    """The actor's update on the shard, then the new policy version published.

    1. π_old is the stored ``old_logprobs``, the rollout's ``rollout_logprobs`` when the
       settings say so (``old_is_rollout``), or None (the update's own first forward pass).
    2. The update (``tasks.update.optimize.actor_update``).
    3. The new policy's log-probs of the weight-sync probe, with the actor still awake, and the
       new version published: its weights go into a colocated rollout engine, which checks
       them against the probe when it next wakes.
    """
    assert module is not None, "the actor's update runs with the actor awake"
    _, batch = _batches(worker, shard)
    width = batch.response_mask.shape[1]
    # 1.
    rollout = _optional(shard.rollout_logprobs, width)
    old = rollout if settings.old_is_rollout else _optional(shard.old_logprobs, width)
    # 2.
    metrics = actor_update(
        **_trainer_inputs(worker, worker.actor, settings, batch),
        old_logprobs=old,
        advantages=shard.padded("advantages", width),
        ref_logprobs=_optional(shard.ref_logprobs, width),
        rollout_logprobs=None if settings.old_is_rollout else rollout,
        teacher_logprobs=_optional(shard.teacher_logprobs, width),
        cfg=settings,
    )
    # 3.
    worker.publish_policy(worker.trainer_probe(module))
    return Shard(batch_size=shard.batch_size), metrics


def _critic_step(
    worker: ModelWorker,
    module: torch.nn.Module | None,
    shard: Shard,
    *,
    settings: CriticUpdateSettings,
) -> tuple[Shard, Metrics]:
    """The critic's update on the shard (every sampled token, truncated rows included)."""
    batch, _ = _batches(worker, shard)
    width = batch.response_mask.shape[1]
    metrics = critic_update(
        **_trainer_inputs(worker, worker.critic, settings, batch),
        old_values=shard.padded("values", width),
        returns=shard.padded("returns", width),
        cfg=settings,
    )
    return Shard(batch_size=shard.batch_size), metrics


def update_steps(
    reads: tuple[str, ...], actor: ActorUpdateSettings, critic: CriticUpdateSettings | None
) -> tuple[WorkerStep, ...]:
    """The update's worker steps: the critic's (when the run has one) and then the actor's,
    whose step publishes the new policy. Both read ``reads`` (``StepPlan.update_reads``) and
    write nothing to the store."""
    actor_step = WorkerStep(
        "update/actor", reads, "actor", functools.partial(_actor_step, settings=actor), ()
    )
    if critic is None:
        return (actor_step,)
    critic_step = functools.partial(_critic_step, settings=critic)
    return (WorkerStep("update/critic", reads, "critic", critic_step, ()), actor_step)


def update_rows(
    worker: ModelWorker,
    shard: BatchMeta,
    *,
    step: int,
    reads: tuple[str, ...],
    actor: ActorUpdateSettings,
    critic: CriticUpdateSettings | None,
) -> Metrics:
    """Worker side, at most once per step (``run_steps``'s ``once``): the update's steps
    (``update_steps``) on my samples; returns their metrics."""
    return run_steps(
        worker, shard, update_steps(reads, actor, critic), once=f"update@{step}"
    ).metrics


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
        reads=ctx.plan.update_reads,
        actor=actor_settings(ctx.cfg, world, ctx.plan),
        critic=critic_settings(ctx.cfg, world) if ctx.plan.critic else None,
    )
    # 2. Weight sync; the metrics: losses summed over the workers' shares, the rest averaged.
    synced = sync_rollout_weights(ctx)
    return StageResult(meta, {**combine_worker_metrics(results), **synced})
