"""logprobs: ``old_logprobs`` (actor), ``ref_logprobs`` (reference) and ``values`` (critic).

The training workers recompute the actor's log-probabilities of the sampled tokens (at the
rollout temperature), the frozen reference's when a KL term is configured, and the critic's
values when the estimator is GAE — each model woken in turn. The actor's pass is skipped when
the update is one on-policy optimizer step (``TrainConfig.recompute_old_logprobs``): the update
then takes its own forward pass, made before any weight changes, as ``old_logprobs``.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.group import concat, split, take
from infra.workers import PPOWorker
from storage import BatchMeta
from tasks.context import StageContext
from tasks.io import read, write

READS = ("prompt_ids", "response_ids")


def writes(ctx: StageContext) -> tuple[str, ...]:
    algo = ctx.cfg.algorithm
    return (
        (("old_logprobs",) if ctx.cfg.recompute_old_logprobs else ())
        + (("ref_logprobs",) if algo.use_reference else ())
        + (("values",) if algo.use_critic else ())
    )


@task(name="logprobs", cache_policy=NO_CACHE, task_run_name="logprobs[step={step}]")
def logprobs(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    # 1. Read.
    data = read(ctx, meta, READS)
    prompts, responses = data["prompt_ids"], data["response_ids"]
    # 2. Forward passes on the training workers, sharded by sample.
    names = writes(ctx)  # never empty here: the training loop leaves the task out then
    group = ctx.train_group
    actor = {"actor": "old_logprobs" in names}
    outs = group.call_sharded(
        PPOWorker.forward,
        [
            ((take(prompts, sl), take(responses, sl)), actor)
            for sl in split(len(prompts), group.size)
        ],
    )
    # 3. Write the fields this configuration produces.
    return write(ctx, meta, {name: concat([o[name] for o in outs]) for name in names})
