"""Checkpoints of a training run: ``<run_dir>/checkpoints/step-<N>/``.

A checkpoint holds the workers' model, optimizer, scheduler and RNG states (``workers/``), the
flow's state (``state.json``: step, data cursor, KL controller) and the store partitions still in
flight (``store/``, Arrow IPC). It is written to a temporary folder and renamed into place, so a
run killed at any moment leaves either a whole checkpoint or none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

STATE = "state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (one with ``state.json``), or None."""
    root = run_dir / "checkpoints"
    if not root.exists():
        return None
    done = sorted(
        p for p in root.glob("step-*") if (p / STATE).exists() and not p.name.endswith(".tmp")
    )
    return done[-1] if done else None


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    state: dict[str, Any],
    save_workers: Any,
    store: Any,
    partitions: list[str],
    keep: int,
) -> Path:
    """Write a whole checkpoint atomically; keep the newest ``keep``."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_workers(str(tmp / "workers"))
    if partitions:
        store.save(tmp / "store", partitions=partitions)
    (tmp / STATE).write_text(
        json.dumps({**state, "step": step, "partitions": partitions}, indent=1)
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted((run_dir / "checkpoints").glob("step-*"))[:-keep]:
        if not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE).read_text())
