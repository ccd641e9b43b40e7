"""A run SIGKILLed in the middle of an iteration and resumed ends with the same weights as an
uninterrupted run with the same seed (CPU, real subprocesses, real Ray and Prefect)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _command(assets, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
        f"models.assets_dir={assets.root}", "warmstart.enabled=false", f"run_dir={run_dir}",
        f"models.reward_model={assets.reward_model}",
        f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2", "trainer.eval_every=100",
        "resources.num_cpus=2",
    ]  # fmt: skip


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PREFECT_HOME=str(tmp / "prefect"), TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    env.pop("PREFECT_API_URL", None)
    return env


def _kill_everything_under(tmp: Path) -> None:
    """SIGKILL stray processes (Ray's) whose command line mentions the run's private temp dir."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if str(tmp).encode() in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(
        run_dir
        / "checkpoints"
        / f"step-{STEPS - 1:06d}"
        / "workers"
        / "actor"
        / "model.safetensors"
    )


@pytest.mark.slow
def test_sigkill_mid_iteration_then_resume_matches_an_uninterrupted_run(
    assets, tmp_path: Path
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kr", dir="/tmp"))
    try:
        # 1. The reference: an uninterrupted run.
        ref_dir = tmp_path / "uninterrupted"
        subprocess.run(
            _command(assets, ref_dir), env=_env(tmp), check=True, timeout=600, capture_output=True
        )
        # 2. The same run, killed with SIGKILL once three steps are logged (step 3 is then in flight).
        run_dir = tmp_path / "killed"
        proc = subprocess.Popen(
            _command(assets, run_dir), env=_env(tmp), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _kill_everything_under(tmp)
        assert not (run_dir / "checkpoints" / f"step-{STEPS - 1:06d}").exists()
        # 3. Resume (trainer.resume=auto is the default) and compare the final weights.
        done = subprocess.run(
            _command(assets, run_dir), env=_env(tmp), timeout=600, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert '"first_step": 2' in done.stdout or '"first_step": 4' in done.stdout, done.stdout[
            -2000:
        ]
        ref, got = _final_weights(ref_dir), _final_weights(run_dir)
        assert ref.keys() == got.keys()
        for key in ref:
            assert torch.equal(ref[key], got[key]), key
    finally:
        _kill_everything_under(tmp)
