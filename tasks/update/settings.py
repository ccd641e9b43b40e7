"""The update's settings for one data-parallel worker, built from the config sections (the config
is the only place their values live). Imports neither Prefect nor Ray, so tools that run the
update on their own (``benchmarks/gpu_check_device.py``) build them the same way.

Data-parallel workers each see ``1 / world_size`` of every mini-batch, so their mini/micro batch
sizes are the configured (global) ones divided by the world size.
"""

from __future__ import annotations

from infra.config import OptimConfig, TrainConfig
from tasks.plan import StepPlan
from tasks.update.core import PolicyLossSettings
from tasks.update.optimize import ActorUpdateSettings, CriticUpdateSettings


def _per_worker(opt: OptimConfig, world: int) -> dict[str, int]:
    """The epochs and the mini/micro batch sizes of one of ``world`` data-parallel workers."""
    mini = max(opt.mini_batch_size // world, 1)
    micro = min(max(opt.micro_batch_size // world, 1), mini)
    return {"ppo_epochs": opt.ppo_epochs, "mini_batch_size": mini, "micro_batch_size": micro}


def actor_settings(
    cfg: TrainConfig, world: int, plan: StepPlan | None = None
) -> ActorUpdateSettings:
    """One worker's actor update, every field from ``cfg``: ``actor.*`` (the policy loss and its
    settings included), the entropy and KL loss of ``algorithm.*``, and the rollout's sampling
    temperature (greedy, 0, divides the logits by 1); the off-policy correction and which field
    is π_old from the step ``plan`` (None: ``cfg``'s). Rows keep their order (no shuffle): each
    mini-batch's loss denominator is summed over the workers, which needs the same rows in it on
    every worker."""
    opt, algo = cfg.actor, cfg.algorithm
    plan = StepPlan.from_config(cfg) if plan is None else plan
    correction = algo.rollout_correction
    return ActorUpdateSettings(
        **_per_worker(opt, world),
        policy=PolicyLossSettings(
            policy_loss=opt.policy_loss,
            clip_low=opt.clip_low,
            clip_high=opt.clip_high,
            dual_clip=opt.dual_clip,
            gspo_clip_low=opt.gspo_clip_low,
            gspo_clip_high=opt.gspo_clip_high,
            cispo_clip_low=opt.cispo_clip_low,
            cispo_clip_high=opt.cispo_clip_high,
            sapo_tau_pos=opt.sapo_tau_pos,
            sapo_tau_neg=opt.sapo_tau_neg,
        ),
        agg=opt.loss_agg,
        entropy_coef=algo.entropy_coef,
        kl_loss_coef=algo.kl.loss_coef,
        kl_loss_kind=algo.kl.loss_kind,
        distill_loss_coef=algo.distill.coef if algo.distill.mode == "kl_loss" else 0.0,
        max_grad_norm=opt.max_grad_norm,
        temperature=cfg.rollout.temperature or 1.0,
        max_tokens_per_micro_batch=opt.max_tokens_per_micro_batch,
        padding_free=opt.padding_free,
        shuffle_seed=None,
        rollout_correction=plan.rollout_correction,
        correction_cap=correction.cap,
        correction_low=correction.low,
        correction_high=correction.high,
        old_is_rollout=plan.old_logprobs == "rollout_logprobs",
    )


def critic_settings(cfg: TrainConfig, world: int) -> CriticUpdateSettings:
    """One worker's critic update, every field from ``critic.*`` (rows in order, as the
    actor's)."""
    opt = cfg.critic
    return CriticUpdateSettings(
        **_per_worker(opt, world),
        clip_range=opt.value_clip,
        agg=opt.loss_agg,
        max_grad_norm=opt.max_grad_norm,
        max_tokens_per_micro_batch=opt.max_tokens_per_micro_batch,
        shuffle_seed=None,
    )
