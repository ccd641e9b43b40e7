"""update: PPO update of the actor (and critic) on the training workers, then weight sync.

Samples are sharded over the data-parallel workers; losses are normalised by the batch's global
token and sequence counts so N workers make the same update as one. After the update the rollout
engine gets the new weights (in-process on a colocated pool; through Ray's object store when the
rollout has its own pool).
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.group import split, take
from infra.workers import PPOWorker
from storage import BatchMeta
from tasks.context import StageContext
from tasks.io import read

BASE_READS = ("prompt_ids", "response_ids", "advantages")


def reads(ctx: StageContext) -> tuple[str, ...]:
    """The old log-probs come from ``TrainConfig.old_logprobs_field``; without one the update
    uses its own first forward pass instead, and logs actor/kl_to_ref from it when a reference
    is held."""
    algo, old = ctx.cfg.algorithm, ctx.cfg.old_logprobs_field
    with_ref = algo.kl.loss_coef > 0 or (algo.use_reference and old is None)
    return (
        BASE_READS
        + ((old,) if old else ())
        + (("ref_logprobs",) if with_ref else ())
        + (("values", "returns") if algo.use_critic else ())
    )


def update_fields(ctx: StageContext, data: Any) -> dict[str, Any]:
    """The per-sample fields the workers' update takes, by the names it takes them under: the
    configured old log-probs field (``TrainConfig.old_logprobs_field``) as ``old_logprobs``."""
    old = ctx.cfg.old_logprobs_field
    return {
        ("old_logprobs" if name == old else name): data[name]
        for name in reads(ctx)
        if name not in ("prompt_ids", "response_ids")
    }


# Each data-parallel worker returns its SHARE of these losses (divided by the global token or
# sequence count): the batch's loss is their sum. Every other metric is a per-worker mean of
# equal-sized shards (or the same on every worker, like the all-reduced grad norm): averaged.
SHARED_LOSSES = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss")


def combine_worker_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """One batch's metrics from the data-parallel workers' (see ``SHARED_LOSSES``)."""
    return {
        key: sum(r[key] for r in results) / (1 if key in SHARED_LOSSES else len(results))
        for key in results[0]
    }


def sync_rollout_weights(ctx: StageContext) -> None:
    """Push the actor's weights to a rollout pool that is not the training pool."""
    if ctx.rollout_group is ctx.train_group:
        return
    version = ctx.train_group.call(PPOWorker.ping)[0]["version"]
    state = ctx.train_group.workers[0].policy_state.remote()
    ctx.rollout_group.call(PPOWorker.load_policy, state, version)


@task(name="update", cache_policy=NO_CACHE, task_run_name="update[step={step}]")
def update(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    # 1. Read.
    data = read(ctx, meta, reads(ctx))
    prompts, responses = data["prompt_ids"], data["response_ids"]
    fields = update_fields(ctx, data)
    # 2. Update on every worker with its shard (workers normalise by global counts themselves).
    group = ctx.train_group
    shards = [
        ((take(prompts, sl), take(responses, sl), {k: take(v, sl) for k, v in fields.items()}), {})
        for sl in split(len(prompts), group.size)
    ]
    results = group.call_sharded(PPOWorker.update, shards)
    # 3. Metrics (losses summed over the workers' shares, the rest averaged), then weight sync.
    ctx.record(step, combine_worker_metrics(results))
    sync_rollout_weights(ctx)
    return meta
