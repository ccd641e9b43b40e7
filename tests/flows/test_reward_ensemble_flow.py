"""A tiny training flow with a two-member reward-model ensemble trained by the warm start, the
members side by side in processes of their own: both are trained and reported, each is the
model it would be trained alone, and every step scores mean − penalty × std over them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_warm_start_trains_two_members_and_the_run_scores_with_both(
    prefect_harness, ray_local, assets, tmp_path: Path
) -> None:
    from flows.train import ppo_train

    run_dir = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [
            f"models.assets_dir={assets.root}",
            f"run_dir={run_dir}",
            "resources.num_cpus=4",
            "warmstart.rm_ensemble=2",
            "reward.uncertainty_penalty=0.5",
            "warmstart.rm_workers=2",  # side by side, each member in a process of its own
        ],
    )
    state = ppo_train(cfg, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    # 1. The warm start trained two members, each with its report, and reported both.
    warm = run_dir / "warmstart"
    assert (warm / "reward_model" / "report.json").exists()
    assert (warm / "reward_model_1" / "report.json").exists()
    report = json.loads((warm / "report.json").read_text())
    assert [m["member"] for m in report["reward_models"]] == [0, 1]
    assert all(0.0 <= m["heldout_pair_accuracy"] <= 1.0 for m in report["reward_models"])
    assert len(summary["rm_pair_accuracies"]) == 2
    # 2. Every step logged the ensemble's mean and spread, and the members disagree.
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["reward/rm_std/mean"] > 0
        assert row["reward/rm/mean"] == pytest.approx(
            row["reward/rm_mean/mean"] - 0.5 * row["reward/rm_std/mean"], abs=1e-5
        )
    # 3. The saved samples carry the parts: rm is the penalised score.
    sample = json.loads((run_dir / "samples" / "step_0.jsonl").read_text().splitlines()[0])
    parts = sample["rewards"]
    assert parts["rm"] == pytest.approx(parts["rm_mean"] - 0.5 * parts["rm_std"], abs=1e-5)
    # 4. A member trained side by side with the other is the model it would be trained alone.
    from infra.pretrain import RewardModelSettings, train_reward_model

    alone = tmp_path / "member_1_alone"
    train_reward_model(
        init_path=warm / "sft",
        tokenizer_path=assets.tokenizer,
        train_path=assets.train_data,
        heldout_path=assets.heldout_data,
        out_path=alone,
        settings=RewardModelSettings.from_config(cfg.warmstart),
        seed=cfg.seed,
        member=1,
    )
    side_by_side = load_file(warm / "reward_model_1" / "model.safetensors")
    for name, tensor in load_file(alone / "model.safetensors").items():
        assert torch.equal(tensor, side_by_side[name]), name
