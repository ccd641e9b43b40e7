"""validate: the policy answers a set of prompts and the chosen rewards score them.

A ``Validation`` names the prompts, the samples per prompt, the sampling temperature and the
rewards (``tasks.plan.Scoring``). The run evaluates two kinds: the user's
``data.val_files`` (``rollout.val_n`` samples per prompt at ``rollout.val_temperature``, every
reward of the run) and the built-in task's held-out prompts (one greedy answer each, the rule
alone). The prompts go through the store like a training step's (partition ``val/step-<N>``,
cleared at the start and the end): submit → generate → the score stage's ``compute_scores``,
reporting ``progress`` over the two long parts (generated, scored).

Metrics use verl's names, per data source: ``val-core/<data_source>/reward/mean@<n>`` (the
weighted total), and ``val-aux/<data_source>/<part>/mean@<n>`` for each reward part that
scored, named as in ``Scores.named_parts``: ``rm`` (and an ensemble's ``rm_mean``, ``rm_std``),
``judge`` (the parsed verdicts; the run's judge scores validation whenever it scores training,
as ``data.val_files`` use every reward of the run), ``rule``, and ``fn/<name>`` per reward
function. When the rule scored, ``eval/rule_accuracy`` is its mean
over every sample.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from infra.data import PromptRow
from infra.progress import Parts, Progress
from tasks.context import Metrics, StageContext
from tasks.generate.stage import generate_partition, submit_prompts
from tasks.io import read
from tasks.plan import Scoring
from tasks.score.stage import compute_scores

VALIDATION_SEED = 0


@dataclass(frozen=True)
class Validation:
    """One evaluation: ``n`` answers to each of ``rows`` at ``temperature`` (0: greedy), scored
    by ``scoring``."""

    rows: list[PromptRow]
    n: int
    temperature: float
    scoring: Scoring


def partition_id(step: int) -> str:
    return f"val/step-{step:06d}"


def per_source_means(sources: list[str], values: list[float], name: str, n: int) -> Metrics:
    """``{f"{source}/{name}/mean@{n}": mean}`` over the samples of each data source."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for source, value in zip(sources, values, strict=True):
        sums[source] += float(value)
        counts[source] += 1
    return {f"{source}/{name}/mean@{n}": sums[source] / counts[source] for source in sums}


def validate(
    ctx: StageContext, job: Validation, step: int, progress: Progress | None = None
) -> Metrics:
    partition = partition_id(step)
    ctx.rt.store.kv_clear(partition)  # a retried validation starts from nothing
    try:
        # 1. Submit the prompts, 2. generate n answers each, 3. score them.
        stages = Parts(progress, total=2)  # generated, scored
        meta = submit_prompts(ctx, partition_id=partition, rows=job.rows, n=job.n)
        meta = generate_partition(
            ctx, meta, seed=VALIDATION_SEED, n=job.n, temperature=job.temperature
        )
        stages.done()
        scores = compute_scores(ctx, meta, job.scoring)
        stages.done()
        # 4. Means per data source.
        sources = [str(s) for s in read(ctx, meta, ("data_source",))["data_source"]]
        total = per_source_means(sources, scores.total.tolist(), "reward", job.n)
        metrics = {f"val-core/{k}": v for k, v in total.items()}
        for name, values in scores.named_parts().items():
            means = per_source_means(sources, values, name, job.n)
            metrics.update({f"val-aux/{k}": v for k, v in means.items()})
        if "rule" in scores.named:
            metrics["eval/rule_accuracy"] = float(scores.named["rule"].mean())
        return metrics
    finally:
        ctx.rt.store.kv_clear(partition)
