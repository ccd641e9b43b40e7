"""A run sent SIGTERM in the middle of a step, and a run whose Prefect server is stopped
mid-run, each resumed, end with the same weights as the uninterrupted run with the same seed
(CPU, real subprocesses, real Ray, a real local Prefect server; the command and its reference
run: ``cli_runs``, shared with ``test_kill_resume_filtered.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from cli_runs import (
    ROOT,
    STEPS,
    assert_same_weights,
    command,
    env,
    kill_everything_under,
    lucky_reward,
    private_tmp,
    run_to_exit,
)


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A short private temp dir for a run's Ray sockets; whatever runs under it is killed after."""
    path = private_tmp("kr")
    try:
        yield path
    finally:
        kill_everything_under(path)


@pytest.mark.slow
def test_a_run_whose_server_goes_away_checkpoints_and_a_later_run_resumes(
    assets, uninterrupted: Path, tmp: Path, tmp_path: Path
) -> None:
    """The Prefect server the run reports to is stopped after its first step: training goes on
    without it to the end of this run's 4 steps and checkpoints; the command exits 1 naming the
    checkpoint; a later run (no server: a temporary one) resumes."""
    away_dir = tmp_path / "server-away"
    reward = lucky_reward(tmp_path)
    first = command(assets, away_dir, reward, "trainer.steps_per_run=4")
    _server_goes_away(first, away_dir / "metrics.jsonl", tmp, tmp_path)
    rows = (away_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4, rows
    actor = away_dir / "checkpoints" / "step-000003" / "workers" / "actor"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(actor)  # the checkpoint is usable as it is
    code, output = run_to_exit(command(assets, away_dir, reward), tmp, tmp_path)
    assert code == 0, output[-3000:]
    assert '"first_step": 4' in output, output[-2000:]
    assert_same_weights(uninterrupted, away_dir)


def _server_goes_away(cmd: list[str], metrics: Path, tmp: Path, logs: Path) -> None:
    """Run ``cmd`` against a local Prefect server that is stopped once the run has logged a
    step; the command must still finish its steps and exit 1, naming its latest checkpoint."""
    from server import local_server, stop_process

    root = logs / "prefect-server"
    root.mkdir()
    with local_server(root) as server:
        run_env = {**server.env, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
        run_env["PREFECT_CLIENT_MAX_RETRIES"] = (
            "1"  # the final-state retries: seconds, not a minute
        )
        log = logs / "server-away.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, env=run_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
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
            kill_everything_under(tmp)
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


def _of_run(tmp: Path) -> list[psutil.Process]:
    """Every process whose environment names the run's private temp folder: its descendants,
    even one that left its session; not another test's process that reuses one of its ports."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("TMPDIR") == str(tmp) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _in_session(sid: int) -> list[int]:
    found = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid:
                found.append(pid)
    return found


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_leaves_nothing_running_and_resumes_to_the_same_weights(
    assets, uninterrupted: Path, tmp: Path, tmp_path: Path
) -> None:
    reward = lucky_reward(tmp_path)
    run_dir, log = tmp_path / "stopped", tmp_path / "stopped.log"
    metrics = run_dir / "metrics.jsonl"
    # 1. The run, sent SIGTERM once two steps are logged (step 1's checkpoint or step 2 is then
    #    in flight: the run stops after that step).
    with log.open("w") as out:
        proc = subprocess.Popen(
            command(assets, run_dir, reward), env=env(tmp), stdout=out, stderr=subprocess.STDOUT,
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
        found = {p.pid for p in _of_run(tmp)}  # by its TMPDIR: the run, Ray and most of the rest
        assert proc.pid in found and len(found & {p.pid for p in tree}) > 3, (found, tree)
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
        assert not _of_run(tmp), [p.cmdline() for p in _of_run(tmp)]
        step = int(stopped[0].split("after step ")[1].split(",")[0])
        assert 1 <= step < STEPS - 1
        assert (run_dir / "checkpoints" / f"step-{step:06d}").is_dir()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    # 3. The same command resumes after that checkpoint and ends with the uninterrupted weights.
    done = subprocess.run(
        command(assets, run_dir, reward), env=env(tmp), timeout=600, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f'"first_step": {step + 1}' in done.stdout, done.stdout[-2000:]
    assert_same_weights(uninterrupted, run_dir)
