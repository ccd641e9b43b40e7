"""Checkpoints of a training run: ``<run_dir>/checkpoints/step-<N>/``.

A checkpoint holds the workers' model, optimizer, scheduler and RNG states (``workers/``), the
flow's state (``state.json``: step, data cursor, KL controller) and the store partitions still in
flight (``store/``, Arrow IPC). It is written to a temporary folder and renamed into place, so a
run killed at any moment leaves either a whole checkpoint or none.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from infra.workers import ModelWorker
from storage import BatchMeta, Store
from tasks.context import StageContext, StageResult

STATE = "state.json"


class DataCursor(Protocol):
    """Where a prompt dataset is (``infra.data.PromptDataset``): saved and restored whole."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
    state: RunState,
    *,
    save_workers: Callable[[str], object],
    store: Store,
    keep: int,
    midway: Callable[[], None] | None = None,
) -> Path:
    """Write a whole checkpoint atomically; keep the newest ``keep``. ``midway`` is called when
    everything is written but not yet renamed into place (where an injected fault strikes)."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_workers(str(tmp / "workers"))
    if state.partitions:
        store.save(tmp / "store", partitions=state.partitions)
    (tmp / STATE).write_text(json.dumps(state.to_json(), indent=1))
    if midway is not None:
        midway()
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted((run_dir / "checkpoints").glob("step-*"))[:-keep]:
        if not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass(frozen=True)
class RunState:
    """What a checkpoint saves of the flow (``state.json``), beside the workers' states and the
    store's partitions: the step it follows, the data cursor, the KL controller, the partitions
    submitted for later steps and, of those, the steps whose rollout finished (their handles and
    metrics: dynamic sampling in ``separate_async``)."""

    step: int
    data: dict[str, Any]
    kl: dict[str, Any]
    submitted: dict[int, BatchMeta]
    produced: dict[int, StageResult]

    @property
    def partitions(self) -> list[str]:
        """The store partitions the checkpoint holds: the submitted steps'."""
        return [meta.partition_id for meta in self.submitted.values()]

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data": self.data,
            "kl": self.kl,
            "submitted": {str(s): m.to_json() for s, m in self.submitted.items()},
            "produced": {
                str(s): {"meta": r.meta.to_json(), "metrics": r.metrics}
                for s, r in self.produced.items()
            },
        }

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> RunState:
        return cls(
            step=int(state["step"]),
            data=state["data"],
            kl=state["kl"],
            submitted={int(s): BatchMeta.from_json(m) for s, m in state["submitted"].items()},
            produced={
                int(s): StageResult(BatchMeta.from_json(p["meta"]), dict(p["metrics"]))
                for s, p in state.get("produced", {}).items()
            },
        )


def read_state(path: Path) -> RunState:
    """The flow's state in the checkpoint at ``path``."""
    return RunState.from_json(json.loads((path / STATE).read_text()))


@dataclass(frozen=True)
class Restored:
    """What ``restore`` put back: the checkpoint's path, its flow state and the policy version."""

    path: Path
    state: RunState
    version: int


def restore(path: Path, *, ctx: StageContext, data: DataCursor) -> Restored:
    """Load a checkpoint into the workers (and a separate rollout pool), the data cursor, the
    KL controller and the store."""
    from tasks.update.stage import sync_rollout_weights

    state = read_state(path)
    version = min(ctx.rt.train_group.call(ModelWorker.load_checkpoint, str(path / "workers")))
    sync_rollout_weights(ctx)
    data.load_state_dict(state.data)
    ctx.kl.load_state_dict(state.kl)
    if state.partitions:
        ctx.rt.store.load(path / "store")
    return Restored(path, state, version)


def checkpoint_run(
    run_dir: Path,
    step: int,
    *,
    ctx: StageContext,
    data: DataCursor,
    pending: dict[int, BatchMeta],
    keep: int,
    midway: Callable[[], None] | None = None,
    data_state: dict[str, Any] | None = None,
    produced: dict[int, StageResult] | None = None,
) -> Path:
    """Save the run after ``step``: workers, data cursor (``data_state`` in its place when
    given), KL controller, the partitions ``pending`` (submitted for later steps) and, of those,
    the ``produced`` ones' handles and metrics."""
    state = RunState(
        step=step,
        data=data.state_dict() if data_state is None else data_state,
        kl=ctx.kl.state_dict(),
        submitted=dict(pending),
        produced=dict(produced or {}),
    )
    return save_checkpoint(
        run_dir,
        state,
        save_workers=lambda path: ctx.rt.train_group.call(ModelWorker.save_checkpoint, path),
        store=ctx.rt.store,
        keep=keep,
        midway=midway,
    )
