"""A run SIGKILLed in the middle of an iteration, a run whose flow process exits in the middle
of writing a checkpoint (the `faults` entry `exit_flow`), and a run whose Prefect server is
stopped mid-run, each resumed, end with the same weights as an uninterrupted run with the same
seed (CPU, real subprocesses, real Ray, a real local Prefect server)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from infra.faults import EXIT_STATUS

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _command(assets, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
        f"models.assets_dir={assets.root}", "warmstart.enabled=false", f"run_dir={run_dir}",
        f"models.reward_model={assets.reward_model}",
        f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2", "trainer.eval_every=100",
        "resources.num_cpus=2", *extra,
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


def _final_weights(run_dir: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The actor's weights in the checkpoint after the last of ``steps`` steps."""
    return load_file(
        run_dir
        / "checkpoints"
        / f"step-{steps - 1:06d}"
        / "workers"
        / "actor"
        / "model.safetensors"
    )


def kill_once_logged(command: list[str], tmp: Path, metrics: Path, *, steps: int) -> None:
    """Start ``command`` in a session of its own, SIGKILL its process group once ``metrics``
    holds ``steps`` lines (the next step is then in flight), and every process under ``tmp``."""
    proc = subprocess.Popen(
        command, env=_env(tmp), start_new_session=True,
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
    _kill_everything_under(tmp)


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the run of ``STEPS`` steps, uninterrupted (its run directory)."""
    ref_dir = tmp_path_factory.mktemp("kill-resume") / "uninterrupted"
    tmp = Path(tempfile.mkdtemp(prefix="kr", dir="/tmp"))
    try:
        subprocess.run(
            _command(assets, ref_dir), env=_env(tmp), check=True, timeout=600, capture_output=True
        )
    finally:
        _kill_everything_under(tmp)
    return ref_dir


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """A short private temp dir for a run's Ray sockets; whatever runs under it is killed after."""
    tmp = Path(tempfile.mkdtemp(prefix="kr", dir="/tmp"))
    try:
        yield tmp
    finally:
        _kill_everything_under(tmp)


@pytest.mark.slow
def test_sigkill_mid_iteration_then_resume_matches_an_uninterrupted_run(
    assets, uninterrupted: Path, private_tmp: Path, tmp_path: Path
) -> None:
    tmp = private_tmp
    # 1. The run, killed with SIGKILL once three steps are logged (step 3 is then in flight).
    run_dir = tmp_path / "killed"
    kill_once_logged(_command(assets, run_dir), tmp, run_dir / "metrics.jsonl", steps=3)
    assert not (run_dir / "checkpoints" / f"step-{STEPS - 1:06d}").exists()
    # 2. Resume (trainer.resume=auto is the default) and compare the final weights.
    done = subprocess.run(
        _command(assets, run_dir), env=_env(tmp), timeout=600, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"first_step": 2' in done.stdout or '"first_step": 4' in done.stdout, done.stdout[-2000:]
    _assert_same_weights(uninterrupted, run_dir)


@pytest.mark.slow
def test_a_flow_exiting_mid_checkpoint_resumes_from_the_last_whole_one(
    assets, uninterrupted: Path, private_tmp: Path, tmp_path: Path
) -> None:
    """The flow process exits while the step-3 checkpoint is half written; the rerun resumes
    from step 1's checkpoint, never from the half-written one."""
    exit_dir = tmp_path / "exited"
    fault = "faults=[{stage: checkpoint, step: 3, action: exit_flow}]"
    env = _env(private_tmp)
    code, output = _run_to_exit(_command(assets, exit_dir, fault), env, private_tmp, tmp_path)
    assert code == EXIT_STATUS, output[-3000:]
    names = sorted(p.name for p in (exit_dir / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000003.tmp"], names
    code, output = _run_to_exit(_command(assets, exit_dir, fault), env, private_tmp, tmp_path)
    assert code == 0, output[-3000:]
    assert '"first_step": 2' in output, output[-2000:]
    _assert_same_weights(uninterrupted, exit_dir)


@pytest.mark.slow
def test_a_run_whose_server_goes_away_checkpoints_and_a_later_run_resumes(
    assets, uninterrupted: Path, private_tmp: Path, tmp_path: Path
) -> None:
    """The Prefect server the run reports to is stopped after its first step: training goes on
    without it to the end of this run's 4 steps and checkpoints; the command exits 1 naming the
    checkpoint; a later run (no server: a temporary one) resumes."""
    away_dir = tmp_path / "server-away"
    command = _command(assets, away_dir, "trainer.steps_per_run=4")
    _server_goes_away(command, away_dir / "metrics.jsonl", private_tmp, tmp_path)
    rows = (away_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4, rows
    actor = away_dir / "checkpoints" / "step-000003" / "workers" / "actor"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(actor)  # the checkpoint is usable as it is
    env = _env(private_tmp)
    code, output = _run_to_exit(_command(assets, away_dir), env, private_tmp, tmp_path)
    assert code == 0, output[-3000:]
    assert '"first_step": 4' in output, output[-2000:]
    _assert_same_weights(uninterrupted, away_dir)


def _assert_same_weights(ref_dir: Path, run_dir: Path) -> None:
    ref, got = _final_weights(ref_dir), _final_weights(run_dir)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def _run_to_exit(command: list[str], env: dict[str, str], tmp: Path, logs: Path) -> tuple[int, str]:
    """The command's exit status and output. Output goes to a file, not a pipe: the processes an
    exited flow process leaves behind (Ray's) would hold a pipe open; they are killed after."""
    log = logs / f"run-{len(list(logs.glob('run-*.log')))}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _kill_everything_under(tmp)
    return code, log.read_text()


def _server_goes_away(command: list[str], metrics: Path, tmp: Path, logs: Path) -> None:
    """Run ``command`` against a local Prefect server that is stopped once the run has logged a
    step; the command must still finish its steps and exit 1, naming its latest checkpoint."""
    from server import local_server, stop_process

    root = logs / "prefect-server"
    root.mkdir()
    with local_server(root) as server:
        env = {**server.env, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
        env["PREFECT_CLIENT_MAX_RETRIES"] = "1"  # the final-state retries: seconds, not a minute
        log = logs / "server-away.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and proc.poll() is None:
                if metrics.exists() and metrics.read_text().strip():
                    break
                time.sleep(0.05)
            assert proc.poll() is None, log.read_text()[-3000:]
            stop_process(server.proc)
            code = proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _kill_everything_under(tmp)
    output = log.read_text()
    assert code == 1, output[-3000:]
    assert "stopped answering" in output and "step-000003" in output, output[-3000:]


def _listening_ports(procs: list[psutil.Process]) -> set[int]:
    ports = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    ports.add(conn.laddr.port)
    return ports


def _in_session(sid: int) -> list[int]:
    found = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid:
                found.append(pid)
    return found


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_leaves_nothing_running_and_resumes_to_the_same_weights(
    assets, uninterrupted: Path, private_tmp: Path, tmp_path: Path
) -> None:
    tmp = private_tmp
    run_dir, log = tmp_path / "stopped", tmp_path / "stopped.log"
    metrics = run_dir / "metrics.jsonl"
    # 1. The run, sent SIGTERM once two steps are logged (step 1's checkpoint or step 2 is then
    #    in flight: the run stops after that step).
    with log.open("w") as out:
        proc = subprocess.Popen(
            _command(assets, run_dir), env=_env(tmp), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, log.read_text()[-3000:]
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
        ports = _listening_ports(tree)
        assert len(tree) > 3 and ports, (tree, ports)  # Ray, its workers, the Prefect server
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
        # 2. Exit 143 with one line naming the checkpoint; nothing of its tree is left.
        text = log.read_text()
        assert code == 128 + signal.SIGTERM, text[-3000:]
        stopped = [
            line for line in text.splitlines() if line.startswith("ppoflow: stopped by SIGTERM")
        ]
        assert len(stopped) == 1, text[-3000:]
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
        assert not _in_session(proc.pid)
        assert not ports & _listening_ports([psutil.Process(p) for p in psutil.pids()])
        step = int(stopped[0].split("after step ")[1].split(",")[0])
        assert 1 <= step < STEPS - 1
        assert (run_dir / "checkpoints" / f"step-{step:06d}").is_dir()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    # 3. The same command resumes after that checkpoint and ends with the uninterrupted weights.
    done = subprocess.run(
        _command(assets, run_dir), env=_env(tmp), timeout=600, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f'"first_step": {step + 1}' in done.stdout, done.stdout[-2000:]
    _assert_same_weights(uninterrupted, run_dir)
