"""On-policy distillation's plan, settings and advantage math (``algorithm.distill``), without
workers: which stage reads and writes the teacher's log-probs, the one-line refusals, and the
signal worked out by hand."""

from __future__ import annotations

import pytest
import torch

from infra.config import ConfigError, load_config
from tasks.advantage.stage import compute, distill
from tasks.io import nested
from tasks.plan import StepPlan
from tasks.step import Shard, shard_of

TEACHER = "models.teacher=/models/teacher"


def _cfg(*overrides: str):
    return load_config(None, [TEACHER, "algorithm.distill.coef=1.0", *overrides])


@pytest.mark.parametrize("mode", ["reverse_kl", "kl_loss"])
def test_the_plan_scores_with_the_teacher_and_recomputes_the_students_logprobs(mode: str) -> None:
    plan = StepPlan.from_config(_cfg(f"algorithm.distill.mode={mode}"))
    assert plan.distill == mode
    assert plan.scoring.teacher and "teacher_logprobs" in plan.scoring.writes
    # The default would skip the recompute (one on-policy step): distillation needs it.
    assert plan.old_logprobs == "old_logprobs" and "old_logprobs" in plan.forward_passes
    assert {"old_logprobs", "teacher_logprobs"} <= set(plan.advantage_reads)
    assert ("teacher_logprobs" in plan.update_reads) is (mode == "kl_loss")


def test_without_distillation_nothing_reads_or_writes_teacher_logprobs() -> None:
    plan = StepPlan.from_config(load_config(None, []))
    assert plan.distill is None and not plan.scoring.teacher
    fields = (*plan.scoring.writes, *plan.advantage_reads, *plan.update_reads)
    assert "teacher_logprobs" not in fields


def test_the_rollout_logprobs_can_be_the_students() -> None:
    plan = StepPlan.from_config(_cfg("algorithm.old_logprobs=rollout"))
    assert plan.old_logprobs == "rollout_logprobs"
    assert "old_logprobs" not in plan.forward_passes
    assert "rollout_logprobs" in plan.advantage_reads


def test_distillation_without_a_teacher_is_one_line_naming_the_setting() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["algorithm.distill.coef=0.5"])
    message = str(error.value)
    assert "\n" not in message
    assert "algorithm.distill.coef=0.5 needs a teacher" in message and "models.teacher" in message


def test_pure_distillation_is_a_run_without_any_reward() -> None:
    no_reward = ["warmstart.enabled=false", "reward.model_weight=0", "reward.rule_weight=0"]
    no_reward += ["models.policy=/models/policy"]  # a user's policy: no built-in rule either
    with pytest.raises(ConfigError, match="no reward"):
        load_config(None, no_reward)
    cfg = _cfg(*no_reward)
    assert not cfg.uses_reward_model and not cfg.reward.functions and cfg.algorithm.distills


def _shard(data: dict[str, torch.Tensor]) -> Shard:
    return shard_of(data, len(data["old_logprobs"]))


def _data(student: list[list[float]], teacher: list[list[float]]) -> dict[str, torch.Tensor]:
    return {
        "old_logprobs": nested([torch.tensor(r) for r in student]),
        "teacher_logprobs": nested([torch.tensor(r) for r in teacher]),
    }


def test_reverse_kl_adds_the_discounted_signal_to_the_advantages() -> None:
    cfg = _cfg("algorithm.gamma=0.5", "algorithm.distill.coef=2.0")
    plan = StepPlan.from_config(cfg)
    # One row of 3 sampled tokens and one of 2 (padded to 3).
    data = _data([[-1.0, -2.0, -1.0], [-1.0, -1.0]], [[-0.5, -3.0, -1.0], [-2.0, -1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    base = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    advantages, metrics = distill(cfg, _shard(data), plan=plan, mask=mask, advantages=base)
    # d = teacher - student: row 0 [0.5, -1, 0]; row 1 [-1, 0].
    # Discounted sums (gamma 0.5): row 0 [0.5 - 0.5, -1, 0] = [0, -1, 0]; row 1 [-1, 0].
    expected = base + 2.0 * torch.tensor([[0.0, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    assert torch.allclose(advantages, expected)
    assert metrics["distill/reverse_kl/mean"] == pytest.approx((-0.5 + 1.0 + 0 + 1.0 + 0) / 5)
    assert metrics["distill/teacher_logprob/mean"] == pytest.approx(-7.5 / 5)
    assert metrics["distill/student_logprob/mean"] == pytest.approx(-6.0 / 5)


def test_tool_tokens_carry_no_signal_and_kl_loss_mode_leaves_the_advantages() -> None:
    cfg = _cfg("algorithm.gamma=1.0")
    plan = StepPlan.from_config(cfg)
    data = _data([[-1.0, -5.0, -1.0]], [[-2.0, -1.0, -1.0]])
    mask = torch.tensor([[True, False, True]])  # the middle token is a tool's
    advantages, metrics = distill(
        cfg, _shard(data), plan=plan, mask=mask, advantages=torch.zeros(1, 3)
    )
    assert torch.allclose(advantages, torch.tensor([[-1.0, 0.0, 0.0]]))
    assert metrics["distill/reverse_kl/mean"] == pytest.approx(0.5)
    as_loss = _cfg("algorithm.distill.mode=kl_loss")
    unchanged, _ = distill(
        as_loss,
        _shard(data),
        plan=StepPlan.from_config(as_loss),
        mask=mask,
        advantages=torch.ones(1, 3),
    )
    assert torch.equal(unchanged, torch.ones(1, 3))


def test_the_advantage_stage_with_grpo_and_no_reward_is_the_distillation_signal_alone() -> None:
    cfg = _cfg("algorithm.gamma=1.0", "algorithm.kl.monitor=false")
    plan = StepPlan.from_config(cfg)
    data = {
        **_data([[-1.0, -1.0], [-2.0]], [[-1.5, -0.5], [-1.0]]),
        "response_ids": nested([torch.tensor([5, 6]), torch.tensor([7])]),
        "scores": torch.zeros(2),
        "group_ids": torch.tensor([0, 0]),
    }
    out = compute(cfg, _shard(data), plan=plan, kl_coef=0.0)
    # All scores equal: GRPO's advantages are 0, what is left is the signal's discounted sum.
    assert torch.allclose(out.tensors["advantages"], torch.tensor([[0.0, 0.5], [1.0, 0.0]]))
    assert "distill/reverse_kl/mean" in out.metrics
