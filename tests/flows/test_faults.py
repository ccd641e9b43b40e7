"""Injected faults (the ``faults`` config) are survived: a late reply to ``update``, a stage that
raises, a store shard that is lost and a worker that dies end with the weights of a fault-free
run; without restarts left
the run fails naming the dead worker; a flow process that exits mid-checkpoint resumes to the
same weights (tests/flows/test_kill_resume*.py; tiny config, real Prefect, real Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runs import final_weights

from infra.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
STEPS = 4
COMMON = [
    f"trainer.total_steps={STEPS}",
    "trainer.checkpoint_every=1",
    "trainer.eval_every=100",
    "orchestration.retry_delay_seconds=0",
]


def _assert_same_weights(a: Path, b: Path) -> None:
    ref, got = final_weights(a, STEPS), final_weights(b, STEPS)
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-6, msg=key)


def _flow(overrides: list[str], run_dir: Path, *extra: str):
    from flows.train import ppo_train

    cfg = load_config(TINY, [*overrides, *COMMON, f"run_dir={run_dir}", *extra])
    return ppo_train(cfg, return_state=True)


@pytest.fixture(scope="module")
def fault_free(prefect_harness, ray_local, assets, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fault-free") / "run"
    overrides = [
        f"models.assets_dir={assets.root}",
        "warmstart.enabled=false",
        f"models.reward_model={assets.reward_model}",
        "resources.num_cpus=4",
    ]
    state = _flow(overrides, run_dir)
    assert state.is_completed(), state.message
    return run_dir


def test_a_late_reply_a_raising_stage_a_lost_store_shard_and_a_dead_worker_end_with_the_fault_free_weights(
    fault_free: Path, tiny_overrides, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "faulty"
    faults = (
        "faults=["
        "{stage: update, step: 1, action: delay, seconds: 20},"
        "{stage: score, step: 2, action: raise},"
        "{stage: advantage, step: 2, action: kill_store_shard},"
        "{stage: update, step: 3, action: kill_worker}]"
    )
    state = _flow(
        tiny_overrides, run_dir, faults, "orchestration.call_timeout_s=12", "trainer.max_restarts=2"
    )
    assert state.is_completed(), state.message
    _assert_same_weights(fault_free, run_dir)
    assert len(json.loads((run_dir / "faults-fired.json").read_text())) == 4  # each fired once
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))  # the killed steps are logged once
    assert rows[-1]["trainer/restarts"] == 2.0
    # the stage that needed the lost shard's rows named the partition and its keys
    lost = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    assert len(lost) == 2 and "shard 0 is lost" in lost[0], lost
    assert "partition 'train/step-000002'" in lost[0] and "16 key(s)" in lost[0], lost[0]


def test_a_dead_worker_with_no_restart_left_fails_the_run_naming_it(
    fault_free: Path, tiny_overrides, tmp_path: Path
) -> None:
    state = _flow(
        tiny_overrides,
        tmp_path / "dies",
        "faults=[{stage: update, step: 1, action: kill_worker}]",
        "trainer.max_restarts=0",
    )
    assert state.is_failed()
    message = state.message
    assert "worker 0 of pool 'train'" in message and "update" in message, message
    assert "at step 1" in message and "trainer.max_restarts=0" in message, message


def test_a_bad_fault_entry_is_a_config_error_naming_faults() -> None:
    from infra.config import ConfigError

    with pytest.raises(ConfigError, match=r"faults\.0\.action"):
        load_config(TINY, ["faults=[{stage: update, step: 1, action: explode}]"])
    with pytest.raises(ConfigError, match=r"faults\.0.*seconds > 0"):
        load_config(TINY, ["faults=[{stage: update, step: 1, action: delay}]"])
