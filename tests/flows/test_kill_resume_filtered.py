"""Dynamic sampling survives a SIGKILL in the middle of a refill: the run, killed while a refill
round's generate is in flight, resumed from its checkpoint, ends with the same weights as an
uninterrupted run with the same seed (CPU, real subprocesses, real Ray, `configs/tiny.yaml`
with filtering on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_kill_resume import STEPS, _assert_same_weights, _command, _env, _kill_everything_under

from infra.faults import FIRED

# About one sample in five scores 1: most groups of four have no spread, so steps refill.
LUCKY = """
import zlib


def lucky(data_source, solution_str, ground_truth, extra_info=None):
    return float(zlib.crc32(solution_str.encode()) % 5 == 0)
"""
KILLED_AT = 4  # the step whose refill round 1 is killed (steps 0-2 and 4 refill with seed 0)


def _filtered(assets, run_dir: Path, reward: Path, *extra: str) -> list[str]:
    return _command(
        assets,
        run_dir,
        f"reward.functions=[{{path: {reward}, name: lucky, weight: 1.0}}]",
        "algorithm.filter_groups.enabled=true",
        "algorithm.filter_groups.metric=lucky",
        "algorithm.filter_groups.max_rounds=3",
        *extra,
    )


@pytest.mark.slow
def test_sigkill_mid_refill_then_resume_matches_an_uninterrupted_run(
    assets, tmp_path: Path
) -> None:
    reward = tmp_path / "lucky.py"
    reward.write_text(LUCKY)
    tmp = Path(tempfile.mkdtemp(prefix="kf", dir="/tmp"))
    try:
        # 1. The uninterrupted reference; step KILLED_AT must have refilled.
        ref_dir = tmp_path / "uninterrupted"
        subprocess.run(
            _filtered(assets, ref_dir, reward),
            env=_env(tmp),
            check=True,
            timeout=600,
            capture_output=True,
        )
        rows = [json.loads(x) for x in (ref_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[KILLED_AT]["filter/rounds"] > 1, rows[KILLED_AT]
        _kill_everything_under(tmp)
        # 2. The same run with a late reply armed on step KILLED_AT's refill generate: once that
        # fault has fired (the workers are generating round 1), SIGKILL the whole run.
        run_dir = tmp_path / "killed"
        late = (
            f"faults=[{{stage: generate, step: {KILLED_AT}, round: 1, action: delay, seconds: 60}}]"
        )
        proc = subprocess.Popen(
            _filtered(assets, run_dir, reward, late),
            env=_env(tmp),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        fired = run_dir / FIRED
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None and not fired.exists():
            time.sleep(0.05)
        assert proc.poll() is None and fired.exists(), "the refill round never started"
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _kill_everything_under(tmp)
        done_rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert len(done_rows) == KILLED_AT, done_rows  # killed inside step KILLED_AT
        # 3. Resume (the fault has fired: it does not fire again) and compare the final weights.
        done = subprocess.run(
            _filtered(assets, run_dir, reward, late),
            env=_env(tmp),
            timeout=600,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert '"first_step": 4' in done.stdout, done.stdout[-2000:]  # after step 3's checkpoint
        _assert_same_weights(ref_dir, run_dir)
        resumed = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in resumed] == list(range(STEPS))
        for key in ("filter/kept_groups", "filter/dropped_groups", "filter/rounds"):
            assert [r[key] for r in resumed] == [r[key] for r in rows], key
    finally:
        _kill_everything_under(tmp)
