"""advantage: token rewards (score on the last real token, minus an optional KL penalty) and the
configured estimator's advantages and returns.

Group estimators need whole prompt groups and batch whitening needs the whole batch, so one
training worker (rank 0) takes the partition and runs the stage's declared step
(``advantage_step``, ``tasks.step``): the pure tensor math of ``compute`` over the shard. The KL coefficient comes in as an
argument and nothing here moves the controller: the task returns the batch's KL penalty
(``AdvantageResult.reward_kl``) and the controller moves on it when the step commits
(flows.loop), so a retried task computes the same rows. What the stage reads, and whether it
measures ``actor/kl_to_ref``, is the step plan's (``tasks.plan``). In a multi-turn run the
shard's ``response_mask`` is True on sampled tokens only (``tasks.step``), the score sits on
the last sampled token, and the stage logs the ``agent/*`` metrics of the batch. With on-policy
distillation (``algorithm.distill``) it reads the teacher's and the student's log-probs, logs
``distill/*`` and, in ``reverse_kl`` mode, adds the distillation signal to the advantages
(``distill``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from infra.agent_loop import agent_metrics
from infra.config import TrainConfig
from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.advantage.core import discounted_reverse_cumsum, run_estimator
from tasks.context import Metrics, StageContext, StageResult, faults_at
from tasks.io import from_padded, lengths
from tasks.kl import apply_kl_penalty, kl_penalty
from tasks.masks import last_true, masked_mean
from tasks.plan import StepPlan
from tasks.score.core import place_scores
from tasks.step import Shard, WorkerStep, run_steps

WRITES = ("advantages", "returns")


@dataclass(frozen=True)
class AdvantageResult(StageResult):
    """The stage's output, and the batch's mean KL penalty when the reward holds one (the KL
    controller's input)."""

    reward_kl: float | None = None


@dataclass(frozen=True)
class Computed:
    """Padded (B, T) tensors of the estimator's inputs and outputs (the stage writes those named
    in ``WRITES``), the metrics and the mean KL penalty (None: no KL in the reward)."""

    tensors: dict[str, Tensor]
    metrics: Metrics
    reward_kl: float | None


def _mean(x: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x, mask)) if mask.any() else 0.0


def compute(cfg: TrainConfig, shard: Shard, *, plan: StepPlan, kl_coef: float) -> Computed:
    """Everything the stage writes for one batch (see ``Computed``)."""
    algo = cfg.algorithm
    n = lengths(shard.need("response_ids"))  # (B,)
    width = int(n.max()) if len(n) else 0
    mask = shard.padded("response_mask", width)  # (B, T) the sampled tokens
    metrics: Metrics = {}
    scored_at = n  # (B,) the score goes on token scored_at - 1
    if plan.multi_turn:
        scored_at = last_true(mask)  # (B,) the last sampled token, not a tool token
        metrics.update(
            agent_metrics(
                num_turns=shard.need("num_turns"),
                tool_calls=shard.need("tool_calls"),
                tool_errors=shard.need("tool_errors"),
                truncated_tool_responses=shard.need("truncated_tool_responses"),
            )
        )
    d: dict[str, Tensor] = {
        "scores": shard.need("scores").float(),
        "group_ids": shard.need("group_ids"),
        "response_mask": mask,
    }
    d["token_rewards"] = place_scores(d["scores"], scored_at, width)  # (B, T)
    reward_kl = None
    if plan.kl_to_ref_at == "advantage" and plan.old_logprobs is not None:
        logprobs = shard.padded(plan.old_logprobs, width)
        ref = shard.padded("ref_logprobs", width)
        metrics["actor/kl_to_ref"] = _mean(
            kl_penalty(logprobs=logprobs, ref_logprobs=ref, kind="k1"), mask
        )
        if plan.kl_in_reward:
            d["token_rewards"], kl_mean = apply_kl_penalty(
                token_rewards=d["token_rewards"],
                logprobs=logprobs,
                ref_logprobs=ref,
                response_mask=mask,
                coef=kl_coef,
                kind=algo.kl.kind,
            )
            reward_kl = float(kl_mean)
            metrics["actor/reward_kl_penalty"] = reward_kl
            metrics["actor/reward_kl_penalty_coeff"] = kl_coef
    if plan.critic:
        d["values"] = shard.padded("values", width)
    out = run_estimator(algo.estimator, tensors=d, settings=algo)
    d["advantages"], d["returns"] = out.advantages, out.returns
    if plan.distill is not None:
        d["advantages"], distilled = distill(
            cfg, shard, plan=plan, mask=mask, advantages=out.advantages
        )
        metrics.update(distilled)
    metrics["critic/advantages/mean"] = _mean(d["advantages"], mask)
    metrics["critic/returns/mean"] = _mean(d["returns"], mask)
    return Computed(tensors=d, metrics=metrics, reward_kl=reward_kl)


def distill(
    cfg: TrainConfig, shard: Shard, *, plan: StepPlan, mask: Tensor, advantages: Tensor
) -> tuple[Tensor, Metrics]:
    """On-policy distillation (``algorithm.distill``): the advantages and the ``distill/*``
    metrics.

    1. d_t = log π_teacher(y_t) − log π_student(y_t) on the sampled tokens (``mask``, which
       leaves tool tokens out), the student's being the policy's stored log-probs.
    2. ``reverse_kl`` mode: A_t += coef · Σ_{k ≥ t} γ^(k − t) d_k (γ = ``algorithm.gamma``,
       counted in token positions), after the estimator, so group normalisation and whitening
       leave it as it is. ``kl_loss`` mode: the advantages are the estimator's; the update adds
       the loss term.
    3. Metrics: the mean reverse KL estimate (−d), the teacher's and the student's mean
       log-probs over the sampled tokens.
    """
    assert plan.old_logprobs is not None, "a distilling plan stores the student's log-probs"
    width = mask.shape[1]
    student = shard.padded(plan.old_logprobs, width)  # (B, T)
    teacher = shard.padded("teacher_logprobs", width)  # (B, T)
    # 1.
    signal = (teacher - student).masked_fill(~mask, 0.0)  # (B, T)
    # 2.
    if plan.distill == "reverse_kl":
        settings = cfg.algorithm
        discounted = discounted_reverse_cumsum(values=signal, factor=settings.gamma)  # (B, T)
        advantages = advantages + settings.distill.coef * discounted.masked_fill(~mask, 0.0)
    # 3.
    metrics: Metrics = {
        "distill/reverse_kl/mean": _mean(-signal, mask),
        "distill/teacher_logprob/mean": _mean(teacher, mask),
        "distill/student_logprob/mean": _mean(student, mask),
    }
    return advantages, metrics


def _advantage(
    worker: ModelWorker,
    module: torch.nn.Module | None,
    shard: Shard,
    *,
    plan: StepPlan,
    kl_coef: float,
) -> tuple[Shard, Metrics]:
    """The declared step's compute: ``compute``, its advantages and returns as jagged rows."""
    out = compute(worker.cfg, shard, plan=plan, kl_coef=kl_coef)
    n = lengths(shard.need("response_ids"))
    rows = Shard(
        advantages=from_padded(out.tensors["advantages"], n),
        returns=from_padded(out.tensors["returns"], n),
        batch_size=shard.batch_size,
    )
    return rows, out.metrics


def advantage_step(plan: StepPlan, kl_coef: float) -> WorkerStep:
    """The stage's worker step: reads the plan's ``advantage_reads``, no model awake."""
    compute_rows = functools.partial(_advantage, plan=plan, kl_coef=kl_coef)
    return WorkerStep("advantage", plan.advantage_reads, None, compute_rows, WRITES)


def advantage_rows(
    worker: ModelWorker, meta: BatchMeta, *, plan: StepPlan, kl_coef: float
) -> Metrics:
    """Worker side: the batch's advantage step (``advantage_step``); returns its metrics."""
    return run_steps(worker, meta, (advantage_step(plan, kl_coef),)).metrics


@faults_at("advantage", lambda ctx: ctx.rt.train_group)
def advantage(ctx: StageContext, meta: BatchMeta, step: int) -> AdvantageResult:
    metrics = ctx.rt.train_group.run_on(
        0, advantage_rows, meta, plan=ctx.plan, kl_coef=ctx.kl.value
    )
    reward_kl = metrics.get("actor/reward_kl_penalty") if ctx.plan.kl_in_reward else None
    return AdvantageResult(meta.with_fields(*WRITES), metrics, reward_kl=reward_kl)
