"""score: the reward model and/or reward functions, one score per sample.

Reads ``prompt_ids``, ``response_ids``, ``raw_prompt``, ``ground_truth``, ``data_source`` and
``extra_info``. The per-sample score is

    scores = reward.model_weight * rm_score + Σ weight_i * function_i (+ reward.rule_weight * rule)

- the reward model (only when one is configured): its worker rebuilds right-padded masks from
  the lengths, re-renders the conversation from ``raw_prompt`` with the RM's own chat template
  when its tokenizer differs, and scores the last real token; ``rm_scores`` (jagged) holds that
  score on the last real response token, and an empty response has an empty row (never a score
  at index -1). The reward model sleeps again whatever happens (the worker's wake/sleep block).
- reward functions (verl's ``compute_score`` signature) run in a bounded pool of processes,
  each call bounded by ``reward.function_timeout_s`` (``infra.reward_functions``).
- the built-in task's rule (``reward.rule``) is computed as the honest metric.

A NaN/inf reward-model score or a failing reward function fails the stage naming the sample
keys, and nothing is written. Rows already scored (a partition checkpointed in flight by
``separate_async``'s producer, then resumed) are not scored again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.group import split, take
from infra.transport import Jagged
from infra.workers import PPOWorker
from storage import BatchMeta
from tasks.context import StageContext
from tasks.io import read, write
from tasks.rewards import RULES
from tasks.score.core import assemble_rm_scores, find_nonfinite, score_metrics

READS = ("prompt_ids", "response_ids", "raw_prompt", "ground_truth", "data_source", "extra_info")


class NonFiniteScoreError(ValueError):
    """The reward model returned NaN or inf; nothing was written for the batch."""


def uses_rule(ctx: StageContext) -> bool:
    """The rule reward is computed on the built-in task (its honest metric) or when weighted."""
    return ctx.cfg.data.builtin or ctx.cfg.reward.rule_weight != 0


def writes(ctx: StageContext) -> tuple[str, ...]:
    return (
        ("scores",)
        + (("rm_scores",) if ctx.reward_group is not None else ())
        + (("rule_scores",) if uses_rule(ctx) else ())
    )


def decode_responses(ctx: StageContext, responses: Jagged) -> list[str]:
    """The responses as text, special tokens skipped (what rules and reward functions read)."""
    texts: list[str] = ctx.tokenizer.batch_decode(
        [r.tolist() for r in responses.rows()], skip_special_tokens=True
    )
    return texts


def rule_scores(ctx: StageContext, responses: Jagged, ground_truth: list[object]) -> torch.Tensor:
    return rule_on_texts(ctx, decode_responses(ctx, responses), ground_truth)


def rule_on_texts(ctx: StageContext, texts: list[str], ground_truth: list[object]) -> torch.Tensor:
    """``reward.rule`` of each decoded response against its ground truth, (B,) float32."""
    rule = RULES[ctx.cfg.reward.rule]
    return torch.tensor(
        [rule(t, str(g)) for t, g in zip(texts, ground_truth, strict=True)], dtype=torch.float32
    )


@dataclass
class Scores:
    """Per-sample scores of one batch: the weighted total and each part (None: not computed)."""

    total: torch.Tensor  # (B,)
    rm: torch.Tensor | None = None  # (B,)
    rule: torch.Tensor | None = None  # (B,)
    metrics: dict[str, float] = field(default_factory=dict)


def _reward_model_scores(
    ctx: StageContext, keys: tuple[str, ...], partition: str, data: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (B,), truncated (B,)) from the reward workers, sharded by sample."""
    prompts, responses = data["prompt_ids"], data["response_ids"]
    group = ctx.reward_group
    shards = [sl for sl in split(len(prompts), group.size) if sl.stop > sl.start]
    outs = group.call_sharded(
        PPOWorker.score,
        [((take(prompts, sl), take(responses, sl), data["raw_prompt"][sl]), {}) for sl in shards],
    )
    rm = torch.from_numpy(np.concatenate([o[0] for o in outs])).float()  # (B,)
    truncated = torch.from_numpy(np.concatenate([o[1] for o in outs]))  # (B,)
    bad = find_nonfinite(rm)
    if bad:
        named = [keys[i] for i in bad]
        raise NonFiniteScoreError(
            f"reward model returned non-finite scores for {len(named)} sample(s) in {partition}: "
            f"{named[:8]}{' …' if len(named) > 8 else ''}; nothing was written"
        )
    return rm, truncated


def _function_scores(
    ctx: StageContext, keys: tuple[str, ...], texts: list[str], data: dict[str, Any]
) -> Any:
    from infra.reward_functions import RewardSample

    samples = [
        RewardSample(
            key=key,
            data_source=str(source),
            solution_str=text,
            ground_truth=truth,
            extra_info=dict(extra or {}),
        )
        for key, text, truth, source, extra in zip(
            keys, texts, data["ground_truth"], data["data_source"], data["extra_info"], strict=True
        )
    ]
    return ctx.reward_pool.score(samples)


def compute_scores(
    ctx: StageContext, keys: tuple[str, ...], partition: str, data: dict[str, Any]
) -> Scores:
    """Every configured reward for one batch (see the module docstring); raises before anything
    is written when one of them fails."""
    weights = ctx.cfg.reward
    batch = len(keys)
    out = Scores(total=torch.zeros(batch, dtype=torch.float32))
    texts = (
        decode_responses(ctx, data["response_ids"]) if weights.functions or uses_rule(ctx) else []
    )
    # 1. The reward model, if any.
    if ctx.reward_group is not None:
        out.rm, truncated = _reward_model_scores(ctx, keys, partition, data)
        out.total += weights.model_weight * out.rm
        out.metrics["reward/rm_score/mean"] = float(out.rm.mean())
        out.metrics["reward/rm_truncated_ratio"] = float(truncated.float().mean())
    # 2. Reward functions, in their process pool.
    if weights.functions:
        from infra.reward_functions import metrics as function_metrics

        fs = _function_scores(ctx, keys, texts, data)
        out.total += torch.tensor(fs.total, dtype=torch.float32)
        out.metrics.update(function_metrics(fs))
    # 3. The rule.
    if uses_rule(ctx):
        out.rule = rule_on_texts(ctx, texts, data["ground_truth"])
        out.total += weights.rule_weight * out.rule
        out.metrics["reward/rule/mean"] = float(out.rule.mean())
    return out


@task(name="score", cache_policy=NO_CACHE, task_run_name="score[step={step}]")
def score(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    names = writes(ctx)
    # 0. Scored before a restart (a partition checkpointed in flight): nothing to redo.
    done = ctx.store.kv_list(meta.partition_id)
    if meta.keys and all(set(names) <= set(done.get(k, ())) for k in meta.keys):
        return meta.with_fields(*names)
    # 1. Read the declared fields.
    data = read(ctx, meta, READS)
    # 2. Score (raises, writing nothing, when a reward fails).
    scores = compute_scores(ctx, meta.keys, meta.partition_id, data)
    lengths = data["response_ids"].lengths
    ctx.record(
        step, {**score_metrics(scores=scores.total, response_lengths=lengths), **scores.metrics}
    )
    # 3. Write.
    fields: dict[str, Any] = {"scores": scores.total}
    if scores.rm is not None:
        fields["rm_scores"] = Jagged.from_rows(assemble_rm_scores(scores.rm, lengths))
    if scores.rule is not None:
        fields["rule_scores"] = scores.rule
    return write(ctx, meta, fields)
