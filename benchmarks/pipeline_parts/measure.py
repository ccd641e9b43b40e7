"""Measuring a process tree from /proc: summed RSS sampled in a thread (peaks by kind: driver,
Ray ``ModelWorker`` actors, the rest) and CPU seconds of the whole tree."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path


class TreeMemory(threading.Thread):
    """Samples the summed RSS of a process tree from /proc; keeps peaks by process kind:
    ``driver`` (the root), ``workers`` (Ray ``ModelWorker`` actors), ``other`` (Ray daemons, idle
    Ray workers, Prefect's server ...)."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.peak = {"system": 0, "tree": 0, "driver": 0, "workers": 0}
        self.seen: dict[int, str] = {}  # pid -> start time
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def sample(self) -> None:
        kinds: dict[str, int] = defaultdict(int)
        for pid, fields in descendants(self.pid).items():
            self.seen[pid] = fields[19]  # the start time: pids get reused
            kinds[process_kind(pid, self.pid)] += rss_bytes(pid)
        now = {
            "system": kinds["driver"] + kinds["workers"],
            "tree": sum(kinds.values()),
            "driver": kinds["driver"],
            "workers": kinds["workers"],
        }
        self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def peak_mb(self) -> dict[str, float]:
        return {k: round(v / 2**20, 1) for k, v in self.peak.items()}


def proc_stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ..., starttime at 19]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> dict[int, list[str]]:
    """``root`` and every process below it, each with its /proc stat fields."""
    children: dict[int, list[int]] = defaultdict(list)
    stats: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := proc_stat(entry.name)) is not None:
            children[int(fields[1])].append(int(entry.name))
            stats[int(entry.name)] = fields
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid]
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, reaped children included) of ``root``'s process tree."""
    ticks = sum(sum(int(f[i]) for i in (11, 12, 13, 14)) for f in descendants(root).values())
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError):
        return 0


def process_kind(pid: int, root: int) -> str:
    if pid == root:
        return "driver"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return "other"
    return "workers" if cmdline.startswith(b"ray::ModelWorker") else "other"
