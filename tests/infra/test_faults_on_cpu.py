"""Injected faults are carried out in one place (``infra.faults.strike``): what each action does
to the calling process, the store and the stage's worker group."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import FaultConfig
from infra.faults import FaultPlan, InjectedFault, WorkerFault, strike
from storage import open_store


class Armed:
    """Stands in for a ``WorkerGroup``: records the fault armed for its next call."""

    def __init__(self) -> None:
        self.fault: WorkerFault | None = None

    def arm(self, fault: WorkerFault) -> None:
        self.fault = fault


def _fault(action: str, **extra: object) -> FaultConfig:
    return FaultConfig.model_validate({"stage": "update", "step": 1, "action": action, **extra})


def test_raise_raises_naming_where_and_arms_nothing() -> None:
    group = Armed()
    with pytest.raises(InjectedFault, match="update at step 1"):
        strike(_fault("raise"), "update at step 1", store=open_store("memory://"), group=group)
    assert group.fault is None


def test_worker_side_actions_are_armed_on_the_group() -> None:
    store = open_store("memory://")
    delayed, killed = Armed(), Armed()
    strike(_fault("delay", seconds=2.5), "update", store=store, group=delayed)
    strike(_fault("kill_worker"), "update", store=store, group=killed)
    assert delayed.fault == WorkerFault(delay_s=2.5)  # every worker replies late
    assert killed.fault == WorkerFault(kill_rank=0)  # the first worker's process exits


def test_killing_a_store_shard_needs_a_ray_store() -> None:
    with pytest.raises(InjectedFault, match="kill_store_shard needs a ray:// store"):
        strike(_fault("kill_store_shard"), "update", store=open_store("memory://"), group=None)


def test_an_entry_fires_once_per_run_even_across_plans(tmp_path: Path) -> None:
    """A retry, a restart or a later flow run on the same run directory does not fire it again."""
    entry = _fault("raise")
    first = FaultPlan([entry], tmp_path)
    assert first.take("update", 1, 1) == entry
    assert first.take("update", 1, 1) is None
    assert FaultPlan([entry], tmp_path).take("update", 1, 1) is None  # a resumed run
    group = Armed()
    FaultPlan([_fault("delay", seconds=1)], tmp_path / "other").strike_due(
        "update", 1, 1, store=open_store("memory://"), group=group
    )
    assert group.fault == WorkerFault(delay_s=1.0)
