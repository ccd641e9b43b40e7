"""Where a command's CPU time goes, by phase: run a command (``.ci/run``) and attribute the CPU
time of every process it starts to the ``PPOFLOW_CI_PHASE`` in that process's environment
(``.ci/run`` exports one per phase: install, lint, fast, slow, main, vllm, ...; a process
inherits its parent's), and to its name within the phase.

A sampler reads ``/proc`` once a second; each process's CPU (user + system) counts from its
start, so short-lived processes that live between two samples are missed (a lower bound).
Processes that were running before the command started are left out.

    python benchmarks/ci_cpu.py [--output benchmarks/results/ci_cpu.json] -- bash .ci/run

Prints, per phase, the CPU-seconds and their share, then the use of the machine's cores minute
by minute, and writes it all as JSON. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PHASE_VAR = "PPOFLOW_CI_PHASE"
HZ = os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime")


def _phase_and_name(pid: int) -> tuple[str, str]:
    phase, name = "(none)", "?"
    try:
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(PHASE_VAR.encode() + b"="):
                phase = entry.split(b"=", 1)[1].decode(errors="replace")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        pass
    return phase, name


class Sampler:
    """CPU ticks per phase and per (phase, process name), and per phase each second."""

    def __init__(self) -> None:
        self.started = time.time()
        self._boot = _boot_time()
        self._seen: dict[int, tuple[str, str, str, int]] = {}  # pid → start, phase, name, ticks
        self.by_phase: collections.Counter[str] = collections.Counter()
        self.by_name: collections.Counter[tuple[str, str]] = collections.Counter()
        self.seconds: list[dict[str, float]] = []
        self.stop = threading.Event()

    def _sample(self) -> None:
        tick: collections.Counter[str] = collections.Counter()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks, start = int(fields[11]) + int(fields[12]), fields[19]
            known = self._seen.get(pid)
            if known is None or known[0] != start:
                if self._boot + int(start) / HZ < self.started:
                    self._seen[pid] = (start, "", "", ticks)  # running before the command
                    continue
                phase, name = _phase_and_name(pid)
                delta = ticks
            else:
                _, phase, name, before = known
                delta = ticks - before
            self._seen[pid] = (start, phase, name, ticks)
            if phase and delta:
                self.by_phase[phase] += delta
                self.by_name[(phase, name)] += delta
                tick[phase] += delta
        self.seconds.append({phase: ticks / HZ for phase, ticks in tick.items()})

    def run(self) -> None:
        while not self.stop.is_set():
            self._sample()
            self.stop.wait(1.0)
        self._sample()


def _minutes(seconds: list[dict[str, float]], cores: int) -> list[dict[str, object]]:
    out = []
    for first in range(0, len(seconds), 60):
        window = seconds[first : first + 60]
        phases: collections.Counter[str] = collections.Counter()
        for second in window:
            phases.update(second)
        busy = sum(phases.values()) / (len(window) * cores)
        out.append(
            {
                "minute": first // 60,
                "busy": round(busy, 3),
                "phases": {p: round(v, 1) for p, v in phases.most_common()},
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/ci_cpu.json"))
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sampler = Sampler()
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    code = subprocess.call(command)
    wall = time.time() - sampler.started
    sampler.stop.set()
    thread.join()
    cores = os.cpu_count() or 1
    total = sum(sampler.by_phase.values()) / HZ
    print(
        f"{' '.join(command)}: exit {code}, {wall:.0f} s wall, {total:.0f} CPU-s on {cores} cores"
    )
    print(f"{'phase':<12} {'CPU-s':>8} {'share':>6}  top processes (CPU-s)")
    for phase, ticks in sampler.by_phase.most_common():
        names = [(n, t) for (p, n), t in sampler.by_name.most_common() if p == phase][:3]
        top = ", ".join(f"{n} {t / HZ:.0f}" for n, t in names)
        print(f"{phase:<12} {ticks / HZ:>8.0f} {ticks / HZ / max(total, 1e-9):>6.0%}  {top}")
    minutes = _minutes(sampler.seconds, cores)
    for row in minutes:
        print(f"minute {row['minute']:>3}: {row['busy']:.0%} of the cores busy  {row['phases']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "command": command,
                "exit_code": code,
                "wall_s": round(wall, 1),
                "cores": cores,
                "cpu_s": round(total, 1),
                "by_phase": {p: round(t / HZ, 1) for p, t in sampler.by_phase.most_common()},
                "by_process": {
                    f"{p} {n}": round(t / HZ, 1) for (p, n), t in sampler.by_name.most_common(60)
                },
                "minutes": minutes,
            },
            indent=1,
        )
    )
    sys.exit(code)


if __name__ == "__main__":
    main()
