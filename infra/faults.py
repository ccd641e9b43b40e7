"""Injected failures (the ``faults`` config list), to rehearse recovery on a real run.

``FaultPlan.take(stage, step, attempt)`` returns the entry due there, if any, and records it as
fired in ``<run_dir>/faults-fired.json`` before anything acts on it: each entry fires at most
once per run, so neither a retry, nor the step run again after a restart, nor a later flow run
resuming the same run directory fires it again. ``strike`` is the one place each action is
carried out:

- ``raise``: ``InjectedFault`` is raised before the stage's side effects;
- ``delay``: the workers do their work, then wait ``seconds`` before replying (a late reply);
- ``kill_worker``: the first worker's process exits at the start of the call (a lost worker);
- ``kill_store_shard``: shard ``shard`` of the run's ``ray://`` store is killed just before the
  stage, taking its rows with it (a lost store node);
- ``exit_flow``: the flow process exits at once (a lost driver), with status ``EXIT_STATUS``;
- ``corrupt_sync`` (update): the training workers perturb one tensor of the weights they next
  send to the rollout engine (a broken sync), which the weight-sync probe must catch.

The worker-side actions reach the workers as a ``WorkerFault`` armed on the group
(``WorkerGroup.arm``) for its next call.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from infra.config import FaultConfig
from storage import Store

EXIT_STATUS = 75
FIRED = "faults-fired.json"


class InjectedFault(RuntimeError):
    """The failure a ``raise`` fault asked for."""


@dataclass(frozen=True)
class WorkerFault:
    """What the workers of one call do: rank ``kill_rank``'s process exits before the step;
    every worker waits ``delay_s`` after it, before replying; with ``corrupt_sync`` the next
    weights they send to a rollout engine have one tensor perturbed."""

    kill_rank: int | None = None
    delay_s: float = 0.0
    corrupt_sync: bool = False


class Armable(Protocol):
    """A worker group (``infra.group.WorkerGroup``) that takes a fault for its next call."""

    def arm(self, fault: WorkerFault) -> None: ...


def _label(index: int, fault: FaultConfig) -> str:
    return f"{index}:{fault.stage}@{fault.step}#{fault.attempt}:{fault.action}"


def strike(fault: FaultConfig, where: str, *, store: Store, group: Armable | None) -> None:
    """Carry out ``fault`` at ``where``: in this process, on ``store``, or armed on ``group``."""
    if fault.action == "raise":
        raise InjectedFault(f"injected fault: {where} raised (faults entry {fault.model_dump()})")
    if fault.action == "exit_flow":
        os._exit(EXIT_STATUS)
    if fault.action == "kill_store_shard":
        from storage.ray_backend import RayStore

        if not isinstance(store, RayStore):
            raise InjectedFault(
                f"injected fault at {where}: kill_store_shard needs a ray:// store "
                f"(store.url), not {store.url!r}"
            )
        store.kill_shard(fault.shard)
        return
    if group is None:
        raise InjectedFault(f"injected fault at {where}: {fault.action} needs workers")
    if fault.action == "kill_worker":
        group.arm(WorkerFault(kill_rank=0))
    elif fault.action == "corrupt_sync":
        group.arm(WorkerFault(corrupt_sync=True))
    else:  # delay
        group.arm(WorkerFault(delay_s=fault.seconds))


class FaultPlan:
    """The run's ``faults`` and which of them have fired (see the module docstring)."""

    def __init__(self, faults: list[FaultConfig], run_dir: Path | None) -> None:
        self.faults = list(faults)
        self.path = None if run_dir is None else Path(run_dir) / FIRED
        self._lock = threading.Lock()

    def _fired(self) -> set[str]:
        if self.path is None or not self.path.exists():
            return set()
        return set(json.loads(self.path.read_text()))

    def take(self, stage: str, step: int, attempt: int, round: int = 0) -> FaultConfig | None:
        """The not yet fired entry for (stage, step, attempt, round), now recorded as fired; or
        None."""
        if not self.faults:
            return None
        with self._lock:
            fired = self._fired()
            for index, fault in enumerate(self.faults):
                label = _label(index, fault)
                due = (fault.stage, fault.step, fault.attempt, fault.round) == (
                    stage,
                    step,
                    attempt,
                    round,
                )
                if due and label not in fired:
                    if self.path is not None:
                        self.path.parent.mkdir(parents=True, exist_ok=True)
                        self.path.write_text(json.dumps(sorted(fired | {label})))
                    return fault
        return None

    def strike_due(
        self,
        stage: str,
        step: int,
        attempt: int,
        *,
        round: int = 0,
        store: Store,
        group: Armable | None,
    ) -> None:
        """``strike`` the entry due at (stage, step, attempt, round), if any."""
        fault = self.take(stage, step, attempt, round)
        if fault is not None:
            where = f"{stage} at step {step}" + (f", round {round}" if round else "")
            strike(fault, f"{where}, attempt {attempt}", store=store, group=group)
