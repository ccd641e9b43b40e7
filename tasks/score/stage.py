"""score: the colocated reward model (the V1-trainer design of verl PR 6818, without its holes).

Reads ``prompt_ids``, ``response_ids``, ``raw_prompt`` (and ``ground_truth`` for rule rewards),
scores every sample with the reward model (the worker rebuilds right-padded masks from the
lengths and re-tokenises with the RM's own chat template when its tokenizer differs), and writes
``scores`` (dense, one per sample: model and rule rewards weighted), ``rule_scores`` and
``rm_scores`` (jagged: the RM score on the last real response token; an empty response has an
empty row, never a score at index -1). A NaN/inf score fails the stage naming the keys, and
nothing is written. The reward model sleeps again whatever happens (the worker's wake/sleep
context). Rows already scored (a partition checkpointed in flight by ``separate_async``'s
producer, then resumed) are not scored again.
"""

from __future__ import annotations

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.group import split, take
from infra.transport import Jagged
from storage import BatchMeta
from tasks.context import StageContext
from tasks.io import read, write
from tasks.rewards import RULES
from tasks.score.core import assemble_rm_scores, find_nonfinite, score_metrics

READS = ("prompt_ids", "response_ids", "raw_prompt", "ground_truth")
WRITES = ("scores", "rm_scores", "rule_scores")


class NonFiniteScoreError(ValueError):
    """The reward model returned NaN or inf; nothing was written for the batch."""


def rule_scores(ctx: StageContext, responses: Jagged, ground_truth: list[object]) -> torch.Tensor:
    rule = RULES[ctx.cfg.reward.rule]
    texts = ctx.tokenizer.batch_decode(
        [r.tolist() for r in responses.rows()], skip_special_tokens=True
    )
    return torch.tensor(
        [rule(t, str(g)) for t, g in zip(texts, ground_truth, strict=True)], dtype=torch.float32
    )


@task(name="score", cache_policy=NO_CACHE, task_run_name="score[step={step}]")
def score(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    # 0. Scored before a restart (a partition checkpointed in flight): nothing to redo.
    done = ctx.store.kv_list(meta.partition_id)
    if meta.keys and all(set(WRITES) <= set(done.get(k, ())) for k in meta.keys):
        return meta.with_fields(*WRITES)
    # 1. Read the declared fields.
    data = read(ctx, meta, READS)
    prompts, responses = data["prompt_ids"], data["response_ids"]
    # 2. Score with the reward model, sharded over the reward workers.
    group = ctx.reward_group
    shards = split(len(prompts), group.size)
    outs = group.call_sharded(
        "score",
        [((take(prompts, sl), take(responses, sl), data["raw_prompt"][sl]), {}) for sl in shards],
    )
    rm = torch.from_numpy(np.concatenate([o[0] for o in outs])).float()  # (B,)
    truncated = torch.from_numpy(np.concatenate([o[1] for o in outs]))  # (B,)
    bad = find_nonfinite(rm)
    if bad:
        keys = [meta.keys[i] for i in bad]
        raise NonFiniteScoreError(
            f"reward model returned non-finite scores for {len(keys)} sample(s) in {meta.partition_id}: "
            f"{keys[:8]}{' …' if len(keys) > 8 else ''}; nothing was written"
        )
    # 3. Combine with the rule reward and write.
    rule = rule_scores(ctx, responses, data["ground_truth"])
    weights = ctx.cfg.reward
    scores = weights.model_weight * rm + weights.rule_weight * rule  # (B,)
    lengths = responses.lengths
    ctx.record(
        step,
        {
            **score_metrics(scores=scores, response_lengths=lengths),
            "reward/rm_score/mean": float(rm.mean()),
            "reward/rule/mean": float(rule.mean()),
            "reward/rm_truncated_ratio": float(truncated.float().mean()),
        },
    )
    return write(
        ctx,
        meta,
        {
            "scores": scores,
            "rule_scores": rule,
            "rm_scores": Jagged.from_rows(assemble_rm_scores(rm, lengths)),
        },
    )
