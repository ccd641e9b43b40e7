"""The training flow with ``rollout.engine=vllm`` (the real CPU build): every mode, dynamic
sampling's refill rounds, a vLLM judge, the weight-sync probe catching a broken sync, and a
SIGKILL + resume ending with the same weights.

Marked ``vllm``: `make test-vllm` runs them (see ``tests/infra/test_vllm_engine.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import env, kill_everything_under, kill_once_logged  # noqa: E402
from test_filter_groups import _check_steps  # noqa: E402
from test_filter_groups import _run as _run_filtered  # noqa: E402
from test_judge import _assert_judged  # noqa: E402

from infra.config import load_config  # noqa: E402
from infra.engines.probe import WeightSyncError  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# Eager: nothing for torch.compile to compile on a cold cache (the benchmarks run vLLM's
# compiled default).
VLLM = ("rollout.engine=vllm", "rollout.cpu_kv_cache_gib=0.25", "rollout.enforce_eager=true")
STEPS = 4


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "mode",
    [
        (*VLLM, "resources.mode=sync"),
        (*VLLM, "resources.mode=colocate_async", "resources.max_staleness=1"),
        (*VLLM, "resources.mode=separate_async", "resources.max_staleness=1"),
    ],
    ids=["sync", "colocate_async", "separate_async"],
)
def test_a_tiny_run_with_vllm_completes_and_every_sync_passes_the_probe(
    require_vllm, prefect_harness, ray_local, tiny_overrides, mode
) -> None:
    from flows.train import ppo_train

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [*tiny_overrides, *mode])
    state = ppo_train(cfg, return_state=True)
    assert state.is_completed(), state.message
    rows = _rows(Path(state.result()["run_dir"]))
    assert [r["step"] for r in rows] == [0, 1, 2]
    checked = [r["sync/probe_max_abs_diff"] for r in rows if "sync/probe_max_abs_diff" in r]
    assert len(checked) >= 2, rows  # the weights of at least two versions were probed
    assert max(checked) <= cfg.sync_tolerance
    assert all(r["sync/bytes"] > 0 and r["sync/seconds"] > 0 for r in rows)


def test_dynamic_sampling_refills_through_vllm(
    require_vllm, prefect_harness, ray_local, tiny_overrides, tmp_path
) -> None:
    cfg, run_dir, rows, _ = _run_filtered([*tiny_overrides, *VLLM], tmp_path)
    _check_steps(cfg, run_dir, rows)


def test_a_vllm_judge_scores_beside_the_vllm_rollout(
    require_vllm, prefect_harness, ray_local, assets, tiny_overrides, judge_overrides
) -> None:
    from flows.train import ppo_train

    extra = ("reward.judge.engine=vllm", "trainer.total_steps=2")
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml", [*tiny_overrides, *VLLM, *judge_overrides, *extra]
    )
    state = ppo_train(cfg, return_state=True)
    assert state.is_completed(), state.message
    # The judge's vLLM engine gave each sample the verdict its response and ground truth call for.
    _assert_judged(cfg, _rows(cfg.resolved_run_dir), 2, assets.train_data)


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_broken_sync_fails_the_run_with_weight_sync_error(
    require_vllm, prefect_harness, ray_local, tiny_overrides, mode
) -> None:
    """sync: the next generate's wake finds it; separate_async: the rollout pool checks the
    weights it was sent inside the update. Neither is retried into a clean sync."""
    from flows.train import ppo_train

    fault = "faults=[{stage: update, step: 0, action: corrupt_sync}]"
    overrides = [*tiny_overrides, *VLLM, fault, f"resources.mode={mode}"]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    state = ppo_train(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(WeightSyncError, match="policy version 1: .* differ from the trainer's"):
        state.result()
    metrics = cfg.run_dir / "metrics.jsonl"
    logged = [r["step"] for r in _rows(cfg.run_dir)] if metrics.exists() else []
    assert logged == ([0] if mode == "sync" else [])  # separate_async: step 0's update failed


def _command(assets, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
        f"models.assets_dir={assets.root}", "warmstart.enabled=false", f"run_dir={run_dir}",
        f"models.reward_model={assets.reward_model}", *VLLM,
        f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=1", "trainer.eval_every=100",
        "resources.num_cpus=2",
    ]  # fmt: skip


def _actor(run_dir: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    step = run_dir / "checkpoints" / f"step-{STEPS - 1:06d}" / "workers" / "actor"
    return dict(load_file(step / "model.safetensors"))


def test_sigkill_then_resume_with_vllm_ends_with_the_uninterrupted_weights(
    require_vllm, prefect_harness, ray_local, assets, tmp_path: Path
) -> None:
    import tempfile

    import torch

    from flows.cli import main

    # The uninterrupted reference: the same command in this process (on the session's Ray and
    # Prefect); the killed and resumed runs are processes of their own, as a user's are.
    reference = tmp_path / "reference"
    assert main(_command(assets, reference)[3:]) == 0
    tmp = Path(tempfile.mkdtemp(prefix="kv", dir="/tmp"))
    try:
        run_dir = tmp_path / "killed"
        kill_once_logged(_command(assets, run_dir), tmp, run_dir / "metrics.jsonl", steps=2)
        done = subprocess.run(
            _command(assets, run_dir), env=env(tmp), timeout=600, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert '"first_step": 0' not in done.stdout, done.stdout[-2000:]  # it resumed
        expected, got = _actor(reference), _actor(run_dir)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(expected[name], got[name]), name  # type: ignore[arg-type]
    finally:
        kill_everything_under(tmp)
