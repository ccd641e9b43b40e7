"""Running the benchmark's subprocesses: each with its output in files and its tree sampled for
memory, run together until done, failed or timed out; its last JSON line collected, whatever it
left running killed; and the environment every child gets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .measure import TreeMemory, proc_stat
from .settings import CHILD_TIMEOUT_S, PEER_TIMEOUT_S, QUIET_ENV, ROOT, VARIANTS


@dataclass
class Child:
    """A running subprocess: stdout and stderr go to files, its process tree is sampled."""

    proc: subprocess.Popen[bytes]
    memory: TreeMemory
    out: Path
    err: Path
    load_before: tuple[float, float, float]


def start_child(cmd: list[str], *, env: dict[str, str], log: Path) -> Child:
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, start_new_session=True)
    memory = TreeMemory(proc.pid)
    memory.start()
    return Child(proc, memory, out, err, os.getloadavg())


def run_children(
    cmds: dict[str, list[str]], *, env: dict[str, str], logs: Path, baton: Path | None = None
) -> dict[str, dict[str, Any]]:
    """Run the commands together (turns are taken through ``baton``); each one's last JSON
    line on stdout plus its peak memory and load, or why it failed. One failure aborts the
    others' turns; past the timeout every child still running is killed."""
    if baton is not None:
        baton.write_text(VARIANTS[0])
    children = {name: start_child(cmd, env=env, log=logs / name) for name, cmd in cmds.items()}
    timeout_s = CHILD_TIMEOUT_S if baton else PEER_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    failures: dict[str, str] = {}
    while any(c.proc.poll() is None for c in children.values()):
        for name, child in children.items():
            if child.proc.poll() not in (None, 0):
                failures.setdefault(name, f"exited {child.proc.returncode}")
        if failures and baton is not None:
            baton.write_text("abort")
        if time.monotonic() > deadline:
            for name, child in children.items():
                if child.proc.poll() is None:
                    failures[name] = f"timed out after {timeout_s} s"
            break
        time.sleep(0.2)
    return {name: finish_child(child, failures.get(name)) for name, child in children.items()}


def finish_child(child: Child, failure: str | None) -> dict[str, Any]:
    child.memory.stop()
    end_processes(child.memory.seen)
    child.proc.wait(timeout=30)
    if failure is None and child.proc.returncode != 0:
        failure = f"exited {child.proc.returncode}"
    lines = child.out.read_text(errors="replace").splitlines()
    result = next((json.loads(x) for x in reversed(lines) if x.startswith('{"ok"')), None)
    if result is None:
        tail = child.err.read_text(errors="replace")[-1500:]
        reason = f"{failure or 'no JSON line on stdout'}; stderr ends: {tail}"
        result = {"ok": False, "reason": reason}
    return {
        **result,
        "peak_rss_mb": child.memory.peak_mb(),
        "load_avg": [child.load_before, os.getloadavg()],
    }


def end_processes(seen: dict[int, str]) -> None:
    """Kill what the child started and left running: the pids its tree had, if each is still
    the same process (same start time)."""
    for pid, start in seen.items():
        fields = proc_stat(pid)
        if fields is not None and fields[19] == start:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def child_env(work: Path, threads: int, *, ppoflow: bool = True) -> dict[str, str]:
    """Quiet, offline, a private PREFECT_HOME, and the thread count in the OpenMP/MKL variables
    too (Ray sets OMP_NUM_THREADS in its workers: every process gets the same)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(QUIET_ENV)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PREFECT_HOME"] = str(work / "prefect-home")
    if ppoflow:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":")
    return env
