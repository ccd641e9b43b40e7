"""Map the run config onto the torch-only update settings of ``tasks.update.optimize``.

Data-parallel workers each see ``1 / world_size`` of every mini-batch, so the per-worker
mini/micro batch sizes are the configured (global) ones divided by the world size.
"""

from __future__ import annotations

from typing import Any

from tasks.update.optimize import ActorUpdateSettings, CriticUpdateSettings


def _local(size: int, world: int) -> int:
    return max(size // world, 1)


def actor_settings(spec: Any) -> ActorUpdateSettings:
    opt, algo, world = spec.actor_optim, spec.algorithm, spec.world_size
    return ActorUpdateSettings(
        ppo_epochs=opt.ppo_epochs,
        mini_batch_size=_local(opt.mini_batch_size, world),
        micro_batch_size=min(
            _local(opt.micro_batch_size, world), _local(opt.mini_batch_size, world)
        ),
        clip_low=opt.clip_low,
        clip_high=opt.clip_high,
        dual_clip=opt.dual_clip,
        agg=opt.loss_agg,
        entropy_coef=algo.entropy_coef,
        kl_loss_coef=algo.kl.loss_coef,
        kl_loss_kind=algo.kl.loss_kind,
        max_grad_norm=opt.max_grad_norm,
        temperature=spec.rollout.temperature or 1.0,
    )


def critic_settings(spec: Any) -> CriticUpdateSettings:
    opt, world = spec.critic_optim, spec.world_size
    return CriticUpdateSettings(
        ppo_epochs=opt.ppo_epochs,
        mini_batch_size=_local(opt.mini_batch_size, world),
        micro_batch_size=min(
            _local(opt.micro_batch_size, world), _local(opt.mini_batch_size, world)
        ),
        clip_range=opt.value_clip,
        agg=opt.loss_agg,
        max_grad_norm=opt.max_grad_norm,
    )
