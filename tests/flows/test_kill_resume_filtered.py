"""A run whose flow process exits while a checkpoint is half written (the `faults` entry
`exit_flow`), resumed and then SIGKILLed in the middle of a dynamic-sampling refill, and resumed
again, ends with the same weights and the same refill counts as the uninterrupted run with the
same seed (CPU, real subprocesses, real Ray; the command and its reference run: ``cli_runs``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_runs import (
    STEPS,
    assert_same_weights,
    command,
    env,
    kill_everything_under,
    lucky_reward,
    metrics,
    private_tmp,
    run_to_exit,
)

from infra.faults import EXIT_STATUS, FIRED

KILLED_AT = 4  # the step whose refill round 1 is killed (steps 0-2 and 4 refill with seed 0)
FAULTS = (
    "faults=[{stage: checkpoint, step: 3, action: exit_flow},"
    f" {{stage: generate, step: {KILLED_AT}, round: 1, action: delay, seconds: 60}}]"
)
LATE_REFILL = f"1:generate@{KILLED_AT}#"  # how the second entry's label begins once it fired


@pytest.mark.slow
def test_exit_mid_checkpoint_then_sigkill_mid_refill_then_resume_matches_an_uninterrupted_run(
    assets, uninterrupted: Path, tmp_path: Path
) -> None:
    reference = metrics(uninterrupted)
    assert reference[KILLED_AT]["filter/rounds"] > 1, reference[KILLED_AT]
    run_dir = tmp_path / "interrupted"
    cmd = command(assets, run_dir, lucky_reward(tmp_path), FAULTS)
    tmp = private_tmp("kf")
    try:
        # 1. The flow process exits while step 3's checkpoint is half written: step 1's is the
        #    last whole one.
        code, output = run_to_exit(cmd, tmp, tmp_path)
        assert code == EXIT_STATUS, output[-3000:]
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert names == ["step-000001", "step-000003.tmp"], names
        # 2. The same command resumes from step 1's checkpoint, never from the half-written one
        #    (the exit has fired: it does not fire again). Once the late reply armed on step
        #    KILLED_AT's refill generate has fired (the workers are generating round 1), SIGKILL
        #    the whole run.
        log = tmp_path / "resumed.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, env=env(tmp), start_new_session=True, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None and not _fired(run_dir):
            time.sleep(0.05)
        assert proc.poll() is None and _fired(run_dir), "the refill round never started"
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        kill_everything_under(tmp)
        assert f"tiny[steps 2-{STEPS - 1}]" in log.read_text(), log.read_text()[-3000:]
        assert [r["step"] for r in metrics(run_dir)] == list(range(KILLED_AT))  # killed inside it
        # 3. Resume once more: from step 3's checkpoint, to the uninterrupted weights and refills.
        done = subprocess.run(cmd, env=env(tmp), timeout=600, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f'"first_step": {KILLED_AT}' in done.stdout, done.stdout[-2000:]
        assert_same_weights(uninterrupted, run_dir)
        resumed = metrics(run_dir)
        assert [r["step"] for r in resumed] == list(range(STEPS))
        for key in ("filter/kept_groups", "filter/dropped_groups", "filter/rounds"):
            assert [r[key] for r in resumed] == [r[key] for r in reference], key
    finally:
        kill_everything_under(tmp)


def _fired(run_dir: Path) -> bool:
    """The late reply on the refill has fired (the run records it before it strikes)."""
    try:
        fired = json.loads((run_dir / FIRED).read_text())
    except (OSError, ValueError):  # not written yet, or being written
        return False
    return any(label.startswith(LATE_REFILL) for label in fired)
