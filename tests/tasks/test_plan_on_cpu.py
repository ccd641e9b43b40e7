"""The step plan (tasks.plan): which log-prob passes run and which stored field the update and
the advantage stage read, decided once from the config."""

from __future__ import annotations

import pytest

from infra.config import load_config
from tasks.plan import StepPlan


@pytest.mark.parametrize(
    ("overrides", "recompute"),
    [
        ([], False),  # the default: sync, one epoch, one mini-batch of the whole batch
        (["algorithm.old_logprobs=recompute"], True),
        (["actor.ppo_epochs=2"], True),
        (["actor.mini_batch_size=32", "actor.micro_batch_size=32"], True),
        (["resources.mode=colocate_async"], True),
        (["algorithm.kl.in_reward=true", "algorithm.kl.coef=0.1"], True),
        (["algorithm.estimator=gae"], False),  # a critic does not change the actor's old policy
    ],
)
def test_old_logprobs_are_recomputed_only_when_the_update_is_not_one_on_policy_step(
    overrides: list[str], recompute: bool
) -> None:
    plan = StepPlan.from_config(load_config(None, overrides))
    assert (plan.old_logprobs == "old_logprobs") is recompute
    assert ("old_logprobs" in plan.forward_passes) is recompute
    if not recompute:  # the update's own first forward pass is its old policy
        assert plan.old_logprobs is None and "old_logprobs" not in plan.update_reads


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["resources.mode=colocate_async"],
        ["algorithm.estimator=gae", "algorithm.kl.in_reward=true", "algorithm.kl.coef=0.1"],
    ],
)
def test_rollout_old_logprobs_replace_the_recompute_pass_in_every_reader(
    overrides: list[str],
) -> None:
    """old_logprobs=rollout: the logprobs stage never computes old_logprobs; the update (as
    its old policy) and the in-reward KL read the rollout engine's log-probs instead."""
    cfg = load_config(None, [*overrides, "algorithm.old_logprobs=rollout"])
    plan = StepPlan.from_config(cfg)
    assert plan.old_logprobs == "rollout_logprobs"
    assert "old_logprobs" not in plan.forward_passes
    assert "rollout_logprobs" in plan.update_reads and "old_logprobs" not in plan.update_reads
    assert ("rollout_logprobs" in plan.advantage_reads) is cfg.algorithm.use_reference


def test_kl_to_ref_is_measured_in_one_place() -> None:
    """With a reference held: by the advantage stage when the policy's log-probs are stored,
    else by the update from its first forward pass (then the update reads the reference's)."""
    on_policy = StepPlan.from_config(load_config(None, ["algorithm.kl.monitor=true"]))
    assert on_policy.old_logprobs is None and on_policy.kl_to_ref_at == "update"
    assert "ref_logprobs" in on_policy.update_reads
    assert "ref_logprobs" not in on_policy.advantage_reads
    stored = StepPlan.from_config(
        load_config(None, ["algorithm.kl.monitor=true", "algorithm.old_logprobs=recompute"])
    )
    assert stored.kl_to_ref_at == "advantage"
    assert {"old_logprobs", "ref_logprobs"} <= set(stored.advantage_reads)
    assert "ref_logprobs" not in stored.update_reads  # no KL loss: the update needs none
    off = StepPlan.from_config(load_config(None, ["algorithm.kl.monitor=false"]))
    assert off.kl_to_ref_at is None and "ref_logprobs" not in off.forward_passes


def test_a_kl_loss_makes_the_update_read_the_reference() -> None:
    plan = StepPlan.from_config(
        load_config(None, ["algorithm.kl.loss_coef=0.1", "algorithm.old_logprobs=recompute"])
    )
    assert plan.kl_loss and "ref_logprobs" in plan.update_reads


@pytest.mark.parametrize(
    ("overrides", "resolved"),
    [
        ([], "none"),  # sync, the transformers engine, float32: the trainer's own numbers
        (["rollout.engine=vllm"], "token_truncate"),
        (["models.dtype=bfloat16"], "token_truncate"),
        (["resources.mode=colocate_async"], "token_truncate"),
        (["resources.mode=separate_async", "reward.pool=own"], "token_truncate"),
        (["algorithm.rollout_correction.mode=sequence_mask"], "sequence_mask"),
        (["rollout.engine=vllm", "algorithm.rollout_correction.mode=none"], "none"),
    ],
)
def test_auto_rollout_correction_is_resolved_once_in_the_plan(
    overrides: list[str], resolved: str
) -> None:
    plan = StepPlan.from_config(load_config(None, overrides))
    assert plan.rollout_correction == resolved


@pytest.mark.parametrize("old", ["auto", "recompute"])
def test_the_update_reads_the_behaviour_policy_every_step(old: str) -> None:
    """For the correction and the rollout_corr/* metrics; with old_logprobs=rollout it reads
    them as its old policy too."""
    plan = StepPlan.from_config(load_config(None, [f"algorithm.old_logprobs={old}"]))
    assert "rollout_logprobs" in plan.update_reads
    assert ("old_logprobs" in plan.update_reads) is (plan.old_logprobs == "old_logprobs")


def test_mask_truncated_makes_the_update_read_truncated() -> None:
    off = StepPlan.from_config(load_config(None, []))
    assert not off.mask_truncated and "truncated" not in off.update_reads
    on = StepPlan.from_config(load_config(None, ["rollout.mask_truncated=true"]))
    assert on.mask_truncated and "truncated" in on.update_reads
