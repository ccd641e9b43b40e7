"""The config is the one place a default lives: every settings object is built from it, field for
field, and the `default` preset is `TrainConfig()` with a two-model reward ensemble."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, asdict, fields
from typing import Any

import pytest

from infra import pretrain
from infra.config import TrainConfig, load_config
from infra.pretrain import RewardModelSettings, SFTSettings
from tasks.plan import StepPlan
from tasks.update import (
    ActorUpdateSettings,
    CriticUpdateSettings,
    actor_loss,
    cispo_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    sapo_policy_loss,
    value_loss,
)
from tasks.update.stage import actor_settings, critic_settings

# A value other than the default for every setting the builders read: a builder that passes a
# constant instead of the config's value fails with this config even where the default matches.
CHANGED = [
    "rollout.temperature=0.7",
    "algorithm.entropy_coef=0.01",
    "algorithm.kl.loss_coef=0.1",
    "algorithm.kl.loss_kind=k2",
    "algorithm.rollout_correction.mode=geometric_mask",
    "algorithm.rollout_correction.cap=3.0",
    "algorithm.rollout_correction.low=0.25",
    "algorithm.rollout_correction.high=4.0",
    "algorithm.old_logprobs=rollout",
    "algorithm.distill.coef=0.3",
    "algorithm.distill.mode=kl_loss",
    "models.teacher=/models/teacher",
    "actor.policy_loss=sapo",
    "actor.gspo_clip_low=1e-3",
    "actor.gspo_clip_high=2e-3",
    "actor.cispo_clip_low=0.5",
    "actor.cispo_clip_high=4.0",
    "actor.sapo_tau_pos=0.5",
    "actor.sapo_tau_neg=2.0",
    "actor.padding_free=true",
    "warmstart.sft_steps=11",
    "warmstart.sft_max_seconds=5",
    "warmstart.rm_steps=7",
    "warmstart.rm_max_seconds=3",
] + [
    f"{role}.{key}"
    for role in ("actor", "critic")
    for key in (
        "ppo_epochs=3",
        "mini_batch_size=32",
        "micro_batch_size=16",
        "max_tokens_per_micro_batch=512",
        "clip_low=0.1",
        "clip_high=0.3",
        "dual_clip=2.5",
        "value_clip=0.4",
        "loss_agg=seq-mean-token-sum",
        "max_grad_norm=0.5",
    )
]
CONFIGS = {"default": TrainConfig(), "changed": load_config(None, CHANGED)}


@pytest.fixture(params=sorted(CONFIGS))
def cfg(request: pytest.FixtureRequest) -> TrainConfig:
    return CONFIGS[request.param]


def test_the_changed_config_changes_every_value_it_names() -> None:
    default, changed = (CONFIGS[name].model_dump() for name in ("default", "changed"))
    for override in CHANGED:
        section, *rest = override.partition("=")[0].split(".")
        before, after = default[section], changed[section]
        for key in rest:
            before, after = before[key], after[key]
        assert before != after, override


def test_actor_settings_are_the_configs_values(cfg: TrainConfig) -> None:
    opt, algo = cfg.actor, cfg.algorithm
    correction, plan = algo.rollout_correction, StepPlan.from_config(cfg)
    assert actor_settings(cfg, 1) == actor_settings(cfg, 1, plan)  # no plan: the config's
    assert asdict(actor_settings(cfg, 1, plan)) == {
        "ppo_epochs": opt.ppo_epochs,
        "mini_batch_size": opt.mini_batch_size,
        "micro_batch_size": opt.micro_batch_size,
        "max_tokens_per_micro_batch": opt.max_tokens_per_micro_batch,
        "padding_free": opt.padding_free,
        "policy": {
            "policy_loss": opt.policy_loss,
            "clip_low": opt.clip_low,
            "clip_high": opt.clip_high,
            "dual_clip": opt.dual_clip,
            "gspo_clip_low": opt.gspo_clip_low,
            "gspo_clip_high": opt.gspo_clip_high,
            "cispo_clip_low": opt.cispo_clip_low,
            "cispo_clip_high": opt.cispo_clip_high,
            "sapo_tau_pos": opt.sapo_tau_pos,
            "sapo_tau_neg": opt.sapo_tau_neg,
        },
        "agg": opt.loss_agg,
        "entropy_coef": algo.entropy_coef,
        "kl_loss_coef": algo.kl.loss_coef,
        "kl_loss_kind": algo.kl.loss_kind,
        "distill_loss_coef": algo.distill.coef if algo.distill.mode == "kl_loss" else 0.0,
        "max_grad_norm": opt.max_grad_norm,
        "temperature": cfg.rollout.temperature,
        "shuffle_seed": None,  # rows in order: the workers sum each mini-batch's denominator
        "rollout_correction": plan.rollout_correction,  # the config's mode, auto resolved
        "correction_cap": correction.cap,
        "correction_low": correction.low,
        "correction_high": correction.high,
        "old_is_rollout": algo.old_logprobs == "rollout",
    }


def test_critic_settings_are_the_configs_values(cfg: TrainConfig) -> None:
    opt = cfg.critic
    assert asdict(critic_settings(cfg, 1)) == {
        "ppo_epochs": opt.ppo_epochs,
        "mini_batch_size": opt.mini_batch_size,
        "micro_batch_size": opt.micro_batch_size,
        "max_tokens_per_micro_batch": opt.max_tokens_per_micro_batch,
        "clip_range": opt.value_clip,
        "agg": opt.loss_agg,
        "max_grad_norm": opt.max_grad_norm,
        "shuffle_seed": None,
    }


def test_warm_start_settings_are_the_configs_budgets_and_the_named_recipe(
    cfg: TrainConfig,
) -> None:
    ws = cfg.warmstart
    assert asdict(SFTSettings.from_config(ws)) == {
        "steps": ws.sft_steps,
        "max_seconds": ws.sft_max_seconds,
        "batch_size": pretrain.SFT_BATCH_SIZE,
        "lr": pretrain.SFT_LR,
        "warmup_fraction": pretrain.SFT_WARMUP_FRACTION,
        "min_lr_ratio": pretrain.SFT_MIN_LR_RATIO,
        "correct_fraction": pretrain.SFT_CORRECT_FRACTION,
        "max_new_tokens": pretrain.WARMSTART_MAX_NEW_TOKENS,
        "eval_rows": pretrain.SFT_EVAL_ROWS,
    }
    assert asdict(RewardModelSettings.from_config(ws)) == {
        "steps": ws.rm_steps,
        "max_seconds": ws.rm_max_seconds,
        "pairs_per_step": pretrain.RM_PAIRS_PER_STEP,
        "lr": pretrain.RM_LR,
        "warmup_fraction": pretrain.RM_WARMUP_FRACTION,
        "min_lr_ratio": pretrain.RM_MIN_LR_RATIO,
        "score_l2": pretrain.RM_SCORE_L2,
        "sampled_fraction": pretrain.RM_SAMPLED_FRACTION,
        "malformed_fraction": pretrain.RM_MALFORMED_FRACTION,
        "samples_per_prompt": pretrain.RM_SAMPLES_PER_PROMPT,
        "max_new_tokens": pretrain.WARMSTART_MAX_NEW_TOKENS,
        "eval_rejected_per_prompt": pretrain.RM_EVAL_REJECTED_PER_PROMPT,
    }


@pytest.mark.parametrize(
    "settings", [ActorUpdateSettings, CriticUpdateSettings, SFTSettings, RewardModelSettings]
)
def test_settings_classes_have_no_defaults_of_their_own(settings: type) -> None:
    defaulted = [
        f.name
        for f in fields(settings)
        if f.default is not MISSING or f.default_factory is not MISSING
    ]
    assert defaulted == []


@pytest.mark.parametrize(
    "loss",
    [
        ppo_policy_loss,
        gspo_policy_loss,
        cispo_policy_loss,
        sapo_policy_loss,
        value_loss,
        actor_loss,
    ],
)
def test_loss_settings_are_required_keywords(loss: Callable[..., Any]) -> None:
    optional = {
        name
        for name, parameter in inspect.signature(loss).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    # Optional inputs, not settings: the entropy and reference terms, the global denominator,
    # the off-policy correction's importance weights.
    assert optional <= {"entropy", "ref_logprobs", "loss_denominator", "is_weights"}


def test_the_default_preset_is_the_default_config_but_for_the_ensemble_and_its_rl() -> None:
    # Field for field, paths included: load_config keeps paths as written (assets_dir stays the
    # relative .ppoflow/assets, run_dir None), so nothing differs by where the preset lives. The
    # main job trains two reward models and penalises their spread (the fields default to one
    # model and the plain mean), and runs 100 steps with a cosine learning rate and advantages
    # not divided by their group's std.
    main_job = load_config("default")
    assert (main_job.warmstart.rm_ensemble, main_job.reward.uncertainty_penalty) == (2, 1.0)
    defaults = TrainConfig()
    assert (defaults.warmstart.rm_ensemble, defaults.reward.uncertainty_penalty) == (1, 0.0)
    changed = [
        "warmstart.rm_ensemble=2",
        "reward.uncertainty_penalty=1.0",
        "algorithm.norm_by_std=false",
        "actor.lr_schedule=cosine",
        "trainer.total_steps=100",
    ]
    assert main_job.model_dump() == load_config(None, changed).model_dump()
