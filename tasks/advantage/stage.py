"""advantage: token rewards (score on the last real token, minus an optional KL penalty) and the
configured estimator's advantages and returns. Pure tensor math, run in the flow process."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from torch import Tensor

from infra.config import AlgorithmConfig
from infra.transport import Jagged
from storage import BatchMeta
from tasks.advantage.core import run_estimator
from tasks.batching import unpad
from tasks.context import StageContext
from tasks.io import read, write
from tasks.kl import apply_kl_penalty, kl_penalty
from tasks.masks import masked_mean
from tasks.score.core import lengths_to_mask, place_scores

WRITES = ("response_mask", "token_rewards", "advantages", "returns")


def reads(algo: AlgorithmConfig, *, old_logprobs: str | None = "old_logprobs") -> tuple[str, ...]:
    """What the stage reads; ``old_logprobs`` names the policy's log-probs field
    (``TrainConfig.old_logprobs_field``); without one the update logs actor/kl_to_ref itself."""
    return (
        ("response_ids", "scores", "group_ids")
        + ((old_logprobs, "ref_logprobs") if old_logprobs and algo.use_reference else ())
        + (("values",) if algo.use_critic else ())
    )


def compute(ctx: StageContext, data: dict[str, Any], step: int) -> dict[str, Tensor]:
    """Padded (B, T) tensors of everything the stage writes."""
    algo = ctx.cfg.algorithm
    lengths = data["response_ids"].lengths  # (B,)
    width = int(lengths.max()) if len(lengths) else 0
    d: dict[str, Tensor] = {
        "scores": data["scores"].float(),
        "group_ids": data["group_ids"],
        "response_mask": lengths_to_mask(lengths, width),  # (B, T)
    }
    d["token_rewards"] = place_scores(d["scores"], lengths, width)  # (B, T)
    field = ctx.cfg.old_logprobs_field  # the policy's log-probs, when the stage reads them
    policy = data.get(field) if field is not None else None
    if policy is not None and "ref_logprobs" in data:  # else the update logs the KL
        kl_ref = kl_penalty(
            logprobs=policy.padded(width=width).float(),
            ref_logprobs=data["ref_logprobs"].padded(width=width).float(),
            kind="k1",
        )  # (B, T)
        mask = d["response_mask"]
        ctx.record(
            step, {"actor/kl_to_ref": float(masked_mean(kl_ref, mask)) if mask.any() else 0.0}
        )
    if algo.kl.in_reward:
        assert ctx.kl_controller is not None
        assert policy is not None  # kl.in_reward always has a policy log-probs field to read
        d["token_rewards"], kl_mean = apply_kl_penalty(
            token_rewards=d["token_rewards"],
            logprobs=policy.padded(width=width).float(),
            ref_logprobs=data["ref_logprobs"].padded(width=width).float(),
            response_mask=d["response_mask"],
            coef=ctx.kl_controller.value,
            kind=algo.kl.kind,
        )
        ctx.record(
            step,
            {
                "actor/reward_kl_penalty": float(kl_mean),
                "actor/reward_kl_penalty_coeff": ctx.kl_controller.value,
            },
        )
        # The controller moves when the step commits (flows.loop), so a retry reads it unmoved.
    if algo.use_critic:
        d["values"] = data["values"].padded(width=width).float()
    out = run_estimator(algo.estimator, tensors=d, settings=algo)
    d["advantages"], d["returns"] = out.advantages, out.returns
    mask = d["response_mask"]
    ctx.record(
        step,
        {
            "critic/advantages/mean": float(masked_mean(d["advantages"], mask))
            if mask.any()
            else 0.0,
            "critic/returns/mean": float(masked_mean(d["returns"], mask)) if mask.any() else 0.0,
        },
    )
    return d


@task(name="advantage", cache_policy=NO_CACHE, task_run_name="advantage[step={step}]")
def advantage(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    # 1. Read, 2. compute, 3. write back unpadded rows.
    data = read(ctx, meta, reads(ctx.cfg.algorithm, old_logprobs=ctx.cfg.old_logprobs_field))
    d = compute(ctx, data, step)
    lengths = data["response_ids"].lengths
    return write(ctx, meta, {name: Jagged.from_rows(unpad(d[name], lengths)) for name in WRITES})
