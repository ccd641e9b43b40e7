"""The step plan: which log-prob passes a training step runs and which stored field plays which
part, decided once from the config and handed to the stages.

- ``old_logprobs``: the stored field the update clips its ratio against (π_old), or None when
  the update takes the detached log-probs of its own first forward pass (one on-policy optimizer
  step per batch: ``algorithm.old_logprobs: auto``, mode ``sync``, one PPO epoch, one
  mini-batch, no KL in the reward — the weights have not moved yet, so they are the same
  numbers). ``old_logprobs`` is recomputed by the logprobs stage; ``rollout_logprobs`` is the
  rollout engine's (``algorithm.old_logprobs: rollout``).
- ``reference``: the logprobs stage computes ``ref_logprobs`` (a KL in the reward, a KL loss, or
  ``algorithm.kl.monitor``).
- ``critic``: the logprobs stage computes ``values`` and the update trains the critic (GAE).
- ``kl_to_ref_at``: where ``actor/kl_to_ref`` is measured — the advantage stage when it reads
  stored policy log-probs, else the update from its own first forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infra.config import TrainConfig

PolicyLogprobs = Literal["old_logprobs", "rollout_logprobs"]
ForwardPass = Literal["old_logprobs", "ref_logprobs", "values"]


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """See the module docstring."""

    old_logprobs: PolicyLogprobs | None
    reference: bool
    critic: bool
    kl_in_reward: bool
    kl_loss: bool

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> StepPlan:
        algo = cfg.algorithm
        return cls(
            old_logprobs=_old_logprobs(cfg),
            reference=algo.use_reference,
            critic=algo.use_critic,
            kl_in_reward=algo.kl.in_reward,
            kl_loss=algo.kl.loss_coef > 0,
        )

    @property
    def forward_passes(self) -> tuple[ForwardPass, ...]:
        """What the logprobs stage computes and writes (empty: the stage does not run)."""
        passes: list[ForwardPass] = []
        if self.old_logprobs == "old_logprobs":
            passes.append("old_logprobs")
        if self.reference:
            passes.append("ref_logprobs")
        if self.critic:
            passes.append("values")
        return tuple(passes)

    @property
    def kl_to_ref_at(self) -> Literal["advantage", "update"] | None:
        """The stage that measures ``actor/kl_to_ref`` (None: no reference, no measure)."""
        if not self.reference:
            return None
        return "advantage" if self.old_logprobs is not None else "update"

    @property
    def advantage_reads(self) -> tuple[str, ...]:
        """The fields the advantage stage reads."""
        policy: tuple[str, ...] = ()
        if self.kl_to_ref_at == "advantage" and self.old_logprobs is not None:
            policy = (self.old_logprobs, "ref_logprobs")
        return (
            ("response_ids", "scores", "group_ids") + policy + (("values",) if self.critic else ())
        )

    @property
    def update_fields(self) -> dict[str, str]:
        """The stored fields the update reads (besides prompts and responses) → the names the
        update takes them under: the policy's log-probs field as ``old_logprobs``."""
        names: dict[str, str] = {"advantages": "advantages"}
        if self.old_logprobs is not None:
            names[self.old_logprobs] = "old_logprobs"
        if self.kl_loss or self.kl_to_ref_at == "update":
            names["ref_logprobs"] = "ref_logprobs"
        if self.critic:
            names.update(values="values", returns="returns")
        return names


def _old_logprobs(cfg: TrainConfig) -> PolicyLogprobs | None:
    """See ``algorithm.old_logprobs`` and the module docstring."""
    choice = cfg.algorithm.old_logprobs
    if choice == "rollout":
        return "rollout_logprobs"
    if choice == "recompute" or cfg.algorithm.kl.in_reward:
        return "old_logprobs"
    one_step = cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size >= cfg.batch_size
    on_policy = cfg.resources.mode == "sync" and one_step
    return None if on_policy else "old_logprobs"
