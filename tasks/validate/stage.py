"""validate: the policy answers the ``data.val_files`` prompts and every reward scores them.

``rollout.val_n`` samples per prompt, greedy unless ``rollout.val_temperature`` is set. The
prompts go through the store like a training step's (partition ``val/step-<N>``, cleared at
the end): submit → generate → the score stage's ``compute_scores`` (reward functions and the
reward model, if any). Metrics use verl's names, per data source:
``val-core/<data_source>/reward/mean@<n>``, and ``val-aux/<data_source>/<name>/mean@<n>`` for
each reward part (``reward/fn/...``, ``reward_extra/...``, the reward model's score).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import StageContext
from tasks.generate.stage import generate_partition, submit_prompts
from tasks.io import read
from tasks.score.stage import compute_scores

VALIDATION_SEED = 0


def partition_id(step: int) -> str:
    return f"val/step-{step:06d}"


def per_source_means(
    sources: list[str], values: list[float], name: str, n: int
) -> dict[str, float]:
    """``{f"{prefix}/{source}/{name}/mean@{n}": mean}`` over the samples of each data source."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for source, value in zip(sources, values, strict=True):
        sums[source] += float(value)
        counts[source] += 1
    return {f"{source}/{name}/mean@{n}": sums[source] / counts[source] for source in sums}


@task(name="validate", cache_policy=NO_CACHE, task_run_name="validate[step={step}]")
def validate(ctx: StageContext, rows: list[Any], step: int) -> dict[str, float]:
    cfg = ctx.cfg
    n = cfg.rollout.val_n
    partition = partition_id(step)
    ctx.store.kv_clear(partition)  # a retried validation starts from nothing
    try:
        # 1. Submit the prompts, 2. generate n answers each, 3. score them.
        meta = submit_prompts(ctx, partition_id=partition, rows=rows, n=n)
        meta = generate_partition(
            ctx, meta, seed=VALIDATION_SEED, n=n, temperature=cfg.rollout.val_temperature
        )
        scores = compute_scores(ctx, meta)
        # 4. Means per data source.
        sources = [str(s) for s in read(ctx, meta, ("data_source",))["data_source"]]
        metrics = {
            f"val-core/{k}": v
            for k, v in per_source_means(sources, scores.total.tolist(), "reward", n).items()
        }
        parts = {"rm_score": scores.rm.tolist()} if scores.rm is not None else {}
        for name, values in parts.items():
            metrics.update(
                {f"val-aux/{k}": v for k, v in per_source_means(sources, values, name, n).items()}
            )
        return metrics
    finally:
        ctx.store.kv_clear(partition)
