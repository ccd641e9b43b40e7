"""Helpers of the tests that run ``ppoflow train`` as a user does (real subprocesses, real Ray,
a Prefect server of their own) and interrupt it: the kill/resume tests' command and its one
uninterrupted reference run, shared by every test process of a pytest run.

The command is ``configs/tiny.yaml`` for ``STEPS`` steps, a checkpoint every 2, with dynamic
sampling on (the ``lucky`` reward function: about one sample in five scores 1, so most groups
of four have no spread and steps refill), so every interruption also crosses the refill state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from infra.assets import build_lock

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6

LUCKY = """
import zlib


def lucky(data_source, solution_str, ground_truth, extra_info=None):
    return float(zlib.crc32(solution_str.encode()) % 5 == 0)
"""


def lucky_reward(root: Path) -> Path:
    """The ``lucky`` reward function's file under ``root`` (written once)."""
    path = root / "lucky.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(LUCKY)
    return path


def filtering(reward: Path) -> list[str]:
    """The overrides of dynamic sampling on the ``lucky`` reward function at ``reward``."""
    return [
        f"reward.functions=[{{path: {reward}, name: lucky, weight: 1.0}}]",
        "algorithm.filter_groups.enabled=true",
        "algorithm.filter_groups.metric=lucky",
        "algorithm.filter_groups.max_rounds=3",
    ]


def command(assets, run_dir: Path, reward: Path, *extra: str) -> list[str]:
    """``ppoflow train`` on the tiny config with dynamic sampling on, ``STEPS`` steps."""
    return [
        sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
        f"models.assets_dir={assets.root}", "warmstart.enabled=false", f"run_dir={run_dir}",
        f"models.reward_model={assets.reward_model}",
        f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2", "trainer.eval_every=100",
        "resources.num_cpus=2", *filtering(reward), *extra,
    ]  # fmt: skip


def env(tmp: Path) -> dict[str, str]:
    """The environment of a run whose Ray sockets and Prefect home live under ``tmp``."""
    out = dict(os.environ)
    out.update(PREFECT_HOME=str(tmp / "prefect"), TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    out.pop("PREFECT_API_URL", None)
    return out


def private_tmp(prefix: str) -> Path:
    """A short private temp dir (Ray's socket paths are length-limited)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def kill_everything_under(tmp: Path) -> None:
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


def final_weights(run_dir: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The actor's weights in the checkpoint after the last of ``steps`` steps."""
    step = run_dir / "checkpoints" / f"step-{steps - 1:06d}"
    return load_file(step / "workers" / "actor" / "model.safetensors")


def assert_same_weights(ref_dir: Path, run_dir: Path) -> None:
    ref, got = final_weights(ref_dir), final_weights(run_dir)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kill_once_logged(command: list[str], tmp: Path, metrics: Path, *, steps: int) -> None:
    """Start ``command`` in a session of its own, SIGKILL its process group once ``metrics``
    holds ``steps`` lines (the next step is then in flight), and every process under ``tmp``."""
    proc = subprocess.Popen(
        command, env=env(tmp), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    kill_everything_under(tmp)


def run_to_exit(command: list[str], tmp: Path, logs: Path) -> tuple[int, str]:
    """The command's exit status and output. Output goes to a file, not a pipe: the processes an
    exited flow process leaves behind (Ray's) would hold a pipe open; they are killed after."""
    log = logs / f"run-{len(list(logs.glob('run-*.log')))}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, env=env(tmp), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            kill_everything_under(tmp)
    return code, log.read_text()


def reference_run(assets, root: Path) -> Path:
    """The uninterrupted run of ``command`` (its run directory), made once under ``root`` by
    whichever test process asks first; the others wait for it and read it. Its folder is named
    after the command, so another command never reads it."""
    reward = lucky_reward(root)
    key = hashlib.sha256(json.dumps(command(assets, Path("run"), reward)).encode()).hexdigest()
    run_dir = root / f"uninterrupted-{key[:12]}"
    done = run_dir / "reference-complete"
    with build_lock(run_dir):
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a failed attempt's, never resumed
            tmp = private_tmp("kr")
            try:
                subprocess.run(
                    command(assets, run_dir, reward),
                    env=env(tmp),
                    check=True,
                    timeout=600,
                    capture_output=True,
                )
            finally:
                kill_everything_under(tmp)
            done.touch()
    return run_dir
