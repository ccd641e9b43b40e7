"""The advantage stage is pure: running it again (a retry) gives the same rows and leaves the
adaptive KL controller where it was; the controller moves once, when the step commits."""

from __future__ import annotations

import torch

from infra.config import load_config
from tasks.advantage.stage import compute
from tasks.io import nested
from tasks.kl import AdaptiveKLController
from tasks.plan import StepPlan
from tasks.step import shard_of


def test_a_retried_advantage_leaves_the_kl_controller_unmoved() -> None:
    cfg = load_config(
        None,
        [
            "algorithm.estimator=grpo",
            "algorithm.kl.in_reward=true",
            "algorithm.kl.adaptive=true",
            "algorithm.kl.coef=0.1",
            "algorithm.kl.target=0.01",
            "algorithm.kl.horizon=10",
        ],
    )
    controller = AdaptiveKLController(init_coef=0.1, target=0.01, horizon=10)
    lengths = [3, 1, 2, 2]
    data = {
        "response_ids": nested([torch.ones(n, dtype=torch.int64) for n in lengths]),
        "scores": torch.tensor([1.0, 0.0, 0.5, 0.2]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "old_logprobs": nested([torch.full((n,), -1.0) for n in lengths]),
        "ref_logprobs": nested([torch.full((n,), -2.0) for n in lengths]),
    }
    plan = StepPlan.from_config(cfg)
    first = compute(cfg, shard_of(data, 4), plan=plan, kl_coef=controller.value)
    again = compute(cfg, shard_of(data, 4), plan=plan, kl_coef=controller.value)
    assert controller.value == 0.1  # not moved by either attempt
    for name in ("token_rewards", "advantages", "returns"):
        torch.testing.assert_close(first.tensors[name], again.tensors[name])
    assert first.reward_kl is not None and first.reward_kl > 0  # what the controller moves on
    assert first.metrics["actor/reward_kl_penalty"] == first.reward_kl
