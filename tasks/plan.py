"""The step plan: which rewards score a batch, which log-prob passes a training step runs and
which stored field plays which part — decided once from the config (``StepPlan.from_config``)
and handed to the stages.

- ``scoring``: the rewards of a training batch and their weights (``Scoring``).
- ``old_logprobs``: the stored field the update clips its ratio against (π_old), or None when
  the update takes the detached log-probs of its own first forward pass (one on-policy optimizer
  step per batch: ``algorithm.old_logprobs: auto``, mode ``sync``, one PPO epoch, one
  mini-batch, no KL in the reward, no distillation — the weights have not moved yet, so they
  are the same numbers). ``old_logprobs`` is recomputed by the logprobs stage; ``rollout_logprobs`` is the
  rollout engine's (``algorithm.old_logprobs: rollout``).
- ``forward_passes``: what the logprobs stage computes — the actor's ``old_logprobs`` when the
  update clips against them; the reference's ``ref_logprobs`` when the run holds a reference (a
  KL in the reward, a KL loss, or ``algorithm.kl.monitor``); the critic's ``values`` (GAE).
  Empty: the stage does not run.
- ``kl_to_ref_at``: where ``actor/kl_to_ref`` is measured — the advantage stage when it reads
  stored policy log-probs, else the update from its own first forward pass.
- ``rollout_correction``: the off-policy correction of the actor's loss
  (``algorithm.rollout_correction.mode``, ``tasks.update.correction``) with ``auto`` resolved:
  ``token_truncate`` when the rollout's log-probs can differ from the trainer's (the vLLM engine;
  ``models.dtype`` other than float32, which the rollout engine holds while the trainer computes
  from float32 master weights; an async mode, whose batches lag the trainer's policy), else
  ``none``.
- ``mask_truncated``: responses cut at ``rollout.max_new_tokens`` without EOS leave the actor's
  loss (``rollout.mask_truncated``): the score stage writes ``truncated``, the update reads it.
- ``multi_turn``: rollouts run the agent loop (``rollout.tools`` or ``rollout.max_turns`` > 1)
  and store a ``loss_mask`` (False on tool-message tokens): the training steps read it as the
  shard's ``response_mask`` (``tasks.step``), which the estimators, the KL penalty, the losses
  and the metrics all take; the advantage stage logs ``agent/*``.
- ``distill``: on-policy distillation's mode (``algorithm.distill``; None: off). The score
  stage writes the teacher's ``teacher_logprobs`` (``Scoring.teacher``); the student's are the
  policy's stored log-probs (recomputed unless ``algorithm.old_logprobs: rollout``). The
  advantage stage logs ``distill/*`` and, in ``reverse_kl`` mode, adds the signal to the
  advantages; in ``kl_loss`` mode the update reads ``teacher_logprobs`` for its loss term.
- ``advantage_reads`` and ``update_reads``: what those two stages read (the update clips against
  ``old_logprobs``, or ``rollout_logprobs`` when ``old_logprobs`` says so, and takes the
  behaviour policy's ``rollout_logprobs`` for the correction and the ``rollout_corr/*``
  metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infra.config import TrainConfig

AGENT_READS = ("loss_mask", "num_turns", "tool_calls", "tool_errors", "truncated_tool_responses")
PolicyLogprobs = Literal["old_logprobs", "rollout_logprobs"]
ForwardPass = Literal["old_logprobs", "ref_logprobs", "values"]
TeacherPass = Literal["teacher_logprobs"]  # the score stage's, on the scoring workers
Correction = Literal[
    "none", "token_truncate", "sequence_truncate", "token_mask", "sequence_mask", "geometric_mask"
]


@dataclass(frozen=True)
class Scoring:
    """Which rewards score a batch, and their weights in the per-sample total."""

    model_weight: float | None  # the reward model's (None: not scored by it)
    functions: bool  # the reward functions (``reward.functions``, their own weights)
    rule: str | None  # a ``tasks.rewards.RULES`` name (None: no rule)
    rule_weight: float
    judge_weight: float | None = None  # the LLM judge's (None: not judged; ``reward.judge``)
    teacher: bool = False  # the distillation teacher's log-probs (``algorithm.distill``)
    overlong: bool = False  # the overlong penalty (``reward.overlong_buffer``): training only

    @property
    def writes(self) -> tuple[str, ...]:
        """The fields scoring a training batch writes."""
        return (
            ("scores", "reward_parts")
            + (("rm_scores",) if self.model_weight is not None else ())
            + (("rule_scores",) if self.rule else ())
            + (("judge_verdicts",) if self.judge_weight is not None else ())
            + (("teacher_logprobs",) if self.teacher else ())
        )

    @classmethod
    def for_training(cls, cfg: TrainConfig) -> Scoring:
        """The run's rewards (``reward.*``, the judge's ``reward.judge``); the rule is computed as
        the built-in task's honest metric even at weight 0."""
        reward = cfg.reward
        uses_rule = cfg.data.builtin or reward.rule_weight != 0
        return cls(
            model_weight=reward.model_weight if cfg.uses_reward_model else None,
            functions=bool(reward.functions),
            rule=reward.rule if uses_rule else None,
            rule_weight=reward.rule_weight,
            judge_weight=reward.judge.weight if reward.judge is not None else None,
            teacher=cfg.algorithm.distills,
            overlong=True,
        )


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """See the module docstring; every field is computed once, by ``from_config``."""

    scoring: Scoring
    old_logprobs: PolicyLogprobs | None
    critic: bool
    kl_in_reward: bool
    kl_loss: bool
    forward_passes: tuple[ForwardPass, ...]
    kl_to_ref_at: Literal["advantage", "update"] | None
    rollout_correction: Correction
    mask_truncated: bool
    multi_turn: bool
    distill: Literal["reverse_kl", "kl_loss"] | None
    advantage_reads: tuple[str, ...]
    update_reads: tuple[str, ...]

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> StepPlan:
        algo = cfg.algorithm
        old = _old_logprobs(cfg)
        reference, critic, kl_loss = algo.use_reference, algo.use_critic, algo.kl.loss_coef > 0
        # 1. The logprobs stage's passes.
        passes: list[ForwardPass] = []
        if old == "old_logprobs":
            passes.append("old_logprobs")
        if reference:
            passes.append("ref_logprobs")
        if critic:
            passes.append("values")
        # 2. Where actor/kl_to_ref is measured, and what the advantage stage reads for it.
        kl_at: Literal["advantage", "update"] | None = None
        if reference:
            kl_at = "advantage" if old is not None else "update"
        policy: tuple[str, ...] = (
            (old, "ref_logprobs") if kl_at == "advantage" and old is not None else ()
        )
        # 3. The update's fields.
        multi_turn = cfg.rollout.multi_turn
        distill = algo.distill.mode if algo.distills else None
        update = (
            ("prompt_ids", "response_ids", "advantages", "rollout_logprobs")
            + (("old_logprobs",) if old == "old_logprobs" else ())
            + (("ref_logprobs",) if kl_loss or kl_at == "update" else ())
            + (("truncated",) if cfg.rollout.mask_truncated else ())
            + (("values", "returns") if critic else ())
            + (("loss_mask",) if multi_turn else ())
            + (("teacher_logprobs",) if distill == "kl_loss" else ())
        )
        if distill is not None and old is not None:  # old is never None when distilling
            policy = tuple(dict.fromkeys((*policy, old, "teacher_logprobs")))
        return cls(
            scoring=Scoring.for_training(cfg),
            old_logprobs=old,
            critic=critic,
            kl_in_reward=algo.kl.in_reward,
            kl_loss=kl_loss,
            forward_passes=tuple(passes),
            kl_to_ref_at=kl_at,
            rollout_correction=_rollout_correction(cfg),
            mask_truncated=cfg.rollout.mask_truncated,
            multi_turn=multi_turn,
            distill=distill,
            advantage_reads=("response_ids", "scores", "group_ids")
            + policy
            + (("values",) if critic else ())
            + (AGENT_READS if multi_turn else ()),
            update_reads=update,
        )


def _old_logprobs(cfg: TrainConfig) -> PolicyLogprobs | None:
    """See ``algorithm.old_logprobs`` and the module docstring."""
    choice = cfg.algorithm.old_logprobs
    if choice == "rollout":
        return "rollout_logprobs"
    if choice == "recompute" or cfg.algorithm.kl.in_reward or cfg.algorithm.distills:
        return "old_logprobs"
    one_step = cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size >= cfg.batch_size
    on_policy = cfg.resources.mode == "sync" and one_step
    return None if on_policy else "old_logprobs"


def _rollout_correction(cfg: TrainConfig) -> Correction:
    """See ``algorithm.rollout_correction.mode`` and the module docstring."""
    mode = cfg.algorithm.rollout_correction.mode
    if mode != "auto":
        return mode
    differs = (
        cfg.rollout.engine == "vllm"
        or cfg.models.dtype != "float32"
        or cfg.resources.mode in ("colocate_async", "separate_async")
    )
    return "token_truncate" if differs else "none"
