"""A run folder belongs to one run, end to end (real Prefect test harness, real local Ray, the
tiny config with its warm start): seed 0, then seed 1 into the same run_dir is refused in one
line, by the flow and by ``ppoflow train`` (exit 2, before anything starts); with
``trainer.resume=never`` seed 1 runs with its own warm start and seed 0's run is whole in
``<run_dir>.old-1``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.run_record import RunDirError
from infra.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_another_seed_is_refused_and_resume_never_starts_over_keeping_the_old_run(
    prefect_harness, ray_local, tiny_overrides, tmp_path: Path
) -> None:
    from flows.train import ppo_train

    overrides = [
        *tiny_overrides,
        "warmstart.enabled=true",  # the tiny warm start: its parts carry their own records
        "models.reward_model=null",
        "trainer.total_steps=2",
    ]
    run_dir = load_config(TINY, overrides).resolved_run_dir
    # 1. Seed 0 runs to the end.
    first = ppo_train(load_config(TINY, [*overrides, "seed=0"]))
    assert (first["first_step"], first["last_step"]) == (0, 1)
    seed0 = _files(run_dir)
    assert json.loads(seed0["warmstart/sft/settings.json"])["seed"] == 0
    # 2. Seed 1 into the same folder: refused in one line, naming the key, both values and both
    # ways out; the folder is untouched.
    with pytest.raises(RunDirError) as err:
        ppo_train(load_config(TINY, [*overrides, "seed=1"]))
    message = str(err.value)
    assert message.startswith(f"the run in run_dir={run_dir} was started with other settings (")
    assert "seed was 0, now 1" in message and "\n" not in message
    assert "set another run_dir, or trainer.resume=never" in message
    assert _files(run_dir) == seed0
    # ... and by the command, before Prefect or Ray start: exit 2, one line on stderr.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    command = [sys.executable, "-m", "flows.cli", "train", "--config", str(TINY), *overrides]
    done = subprocess.run(
        [*command, "seed=1"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "seed was 0, now 1" in done.stderr, done.stderr
    assert done.stdout == ""
    assert _files(run_dir) == seed0
    # 3. trainer.resume=never: seed 1 runs in the folder with its own warm start and result,
    # and seed 0's run is all in <run_dir>.old-1.
    second = ppo_train(load_config(TINY, [*overrides, "seed=1", "trainer.resume=never"]))
    assert (second["first_step"], second["last_step"]) == (0, 1)
    old = run_dir.with_name(run_dir.name + ".old-1")
    assert _files(old) == seed0
    seed1 = _files(run_dir)
    assert json.loads(seed1["warmstart/sft/settings.json"])["seed"] == 1
    assert json.loads(seed1["warmstart/reward_model/settings.json"])["seed"] == 1
    assert seed1["warmstart/sft/model.safetensors"] != seed0["warmstart/sft/model.safetensors"]
    rows = [json.loads(x) for x in seed1["metrics.jsonl"].decode().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
