"""The learning-rate schedule of the actor and critic (``actor.lr_schedule``)."""

from __future__ import annotations

import math

import pytest
import torch

from infra.config import ConfigError, load_config
from infra.workers import lr_factor, optimizer_steps


def _cfg(*overrides: str):
    return load_config(None, ["trainer.total_steps=10", *overrides])


def test_constant_keeps_the_rate_after_the_warmup():
    cfg = _cfg("actor.warmup_steps=4")
    factor = lr_factor(cfg.actor, optimizer_steps(cfg, cfg.actor))
    assert [factor(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_falls_from_the_rate_to_the_floor_at_the_runs_last_optimizer_step():
    cfg = _cfg(
        "actor.lr_schedule=cosine",
        "actor.min_lr_ratio=0.1",
        "actor.warmup_steps=2",
        "actor.ppo_epochs=2",
        "actor.mini_batch_size=32",
        "actor.micro_batch_size=32",
    )
    total = optimizer_steps(cfg, cfg.actor)
    # 10 iterations × 2 epochs × (8 prompts × 8 samples / 32 per mini-batch)
    assert total == 10 * 2 * 2
    factor = lr_factor(cfg.actor, total)
    assert factor(0) == 0.5 and factor(1) == 1.0
    assert factor(2) == pytest.approx(1.0)
    middle = 2 + (total - 1 - 2) / 2
    assert factor(int(middle)) < 0.6 and factor(int(middle)) > 0.5
    assert factor(total - 1) == pytest.approx(0.1)
    assert factor(total + 5) == pytest.approx(0.1)  # a run extended past its plan holds the floor
    values = [factor(s) for s in range(2, total)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_the_scheduler_steps_the_optimizers_rate():
    cfg = _cfg("actor.lr_schedule=cosine", "actor.lr=1e-3")
    total = optimizer_steps(cfg, cfg.actor)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=cfg.actor.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg.actor, total))
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(0.0, abs=1e-12)
    assert rates[total // 2] == pytest.approx(
        1e-3 * 0.5 * (1 + math.cos(math.pi * (total // 2) / (total - 1)))
    )


def test_a_bad_schedule_is_one_config_error():
    with pytest.raises(ConfigError, match="lr_schedule"):
        _cfg("actor.lr_schedule=linear")
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        _cfg("actor.min_lr_ratio=2")
