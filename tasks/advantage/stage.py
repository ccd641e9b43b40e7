"""advantage: token rewards (score on the last real token, minus an optional KL penalty) and the
configured estimator's advantages and returns.

Group estimators need whole prompt groups and batch whitening needs the whole batch, so one
training worker (rank 0) takes the partition (``advantage_rows``): it reads the fields, runs the
pure tensor math of ``compute`` and writes the rows back. The KL coefficient comes in as an
argument and nothing here moves the controller: it moves when the step commits (flows.loop),
so a retried task computes the same rows.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from torch import Tensor

from infra.config import AlgorithmConfig, TrainConfig
from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.advantage.core import run_estimator
from tasks.context import StageContext
from tasks.io import from_padded, lengths, padded
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


def _mean(x: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x, mask)) if mask.any() else 0.0


def compute(
    cfg: TrainConfig, data: dict[str, Tensor], *, kl_coef: float
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Padded (B, T) tensors of everything the stage writes, and the batch's metrics."""
    algo = cfg.algorithm
    n = lengths(data["response_ids"])  # (B,)
    width = int(n.max()) if len(n) else 0
    mask = lengths_to_mask(n, width)  # (B, T)
    d: dict[str, Tensor] = {
        "scores": data["scores"].float(),
        "group_ids": data["group_ids"],
        "response_mask": mask,
    }
    d["token_rewards"] = place_scores(d["scores"], n, width)  # (B, T)
    metrics: dict[str, float] = {}
    field = cfg.old_logprobs_field  # the policy's log-probs, when the stage reads them
    policy = data.get(field) if field is not None else None
    if policy is not None and "ref_logprobs" in data:  # else the update logs the KL
        logprobs = padded(policy, width).float()
        ref = padded(data["ref_logprobs"], width).float()
        metrics["actor/kl_to_ref"] = _mean(
            kl_penalty(logprobs=logprobs, ref_logprobs=ref, kind="k1"), mask
        )
        if algo.kl.in_reward:
            d["token_rewards"], kl_mean = apply_kl_penalty(
                token_rewards=d["token_rewards"],
                logprobs=logprobs,
                ref_logprobs=ref,
                response_mask=mask,
                coef=kl_coef,
                kind=algo.kl.kind,
            )
            metrics["actor/reward_kl_penalty"] = float(kl_mean)
            metrics["actor/reward_kl_penalty_coeff"] = kl_coef
    if algo.use_critic:
        d["values"] = padded(data["values"], width).float()
    out = run_estimator(algo.estimator, tensors=d, settings=algo)
    d["advantages"], d["returns"] = out.advantages, out.returns
    metrics["critic/advantages/mean"] = _mean(d["advantages"], mask)
    metrics["critic/returns/mean"] = _mean(d["returns"], mask)
    return d, metrics


def advantage_rows(worker: ModelWorker, meta: BatchMeta, *, kl_coef: float) -> dict[str, float]:
    """Worker side: read the batch → ``compute`` → write its rows; returns the metrics."""
    cfg = worker.cfg
    data = worker.read(meta, reads(cfg.algorithm, old_logprobs=cfg.old_logprobs_field))
    d, metrics = compute(cfg, data, kl_coef=kl_coef)
    n = lengths(data["response_ids"])
    worker.write(meta, {name: from_padded(d[name], n) for name in WRITES})
    return metrics


@task(name="advantage", cache_policy=NO_CACHE, task_run_name="advantage[step={step}]")
def advantage(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    ctx.inject("advantage", step, ctx.train_group)
    coef = ctx.kl_controller.value if ctx.kl_controller is not None else 0.0
    ctx.record(step, ctx.train_group.run_on(0, advantage_rows, meta, kl_coef=coef))
    return meta.with_fields(*WRITES)
