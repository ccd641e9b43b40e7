"""Injected failures (the ``faults`` config list), to rehearse recovery on a real run.

``FaultPlan.take(stage, step, attempt)`` returns the entry due there, if any, and records it as
fired in ``<run_dir>/faults-fired.json`` before anything acts on it: each entry fires at most
once per run, so neither a retry, nor the step run again after a restart, nor a later flow run
resuming the same run directory fires it again. What each action does:

- ``raise``: ``InjectedFault`` is raised before the stage's side effects;
- ``delay``: the workers do their work, then wait ``seconds`` before replying (a late reply);
- ``kill_worker``: the first worker's process exits at the start of the call (a lost worker);
- ``kill_store_shard``: shard ``shard`` of the run's ``ray://`` store is killed just before the
  stage, taking its rows with it (a lost store node);
- ``exit_flow``: the flow process exits at once (a lost driver), with status ``EXIT_STATUS``.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from infra.config import FaultConfig

EXIT_STATUS = 75
FIRED = "faults-fired.json"


class InjectedFault(RuntimeError):
    """The failure a ``raise`` fault asked for."""


def _label(index: int, fault: FaultConfig) -> str:
    return f"{index}:{fault.stage}@{fault.step}#{fault.attempt}:{fault.action}"


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

    def take(self, stage: str, step: int, attempt: int) -> FaultConfig | None:
        """The not yet fired entry for (stage, step, attempt), now recorded as fired; or None."""
        if not self.faults:
            return None
        with self._lock:
            fired = self._fired()
            for index, fault in enumerate(self.faults):
                label = _label(index, fault)
                if (fault.stage, fault.step, fault.attempt) == (
                    stage,
                    step,
                    attempt,
                ) and label not in fired:
                    if self.path is not None:
                        self.path.parent.mkdir(parents=True, exist_ok=True)
                        self.path.write_text(json.dumps(sorted(fired | {label})))
                    return fault
        return None

    def fire_here(self, fault: FaultConfig | None, where: str, store: object = None) -> None:
        """Act on ``raise``, ``exit_flow`` and ``kill_store_shard`` (on ``store``) in the calling
        process (the others act in a worker)."""
        if fault is None:
            return
        if fault.action == "kill_store_shard":
            kill = getattr(store, "kill_shard", None)
            if kill is None:
                raise InjectedFault(
                    f"injected fault at {where}: kill_store_shard needs a ray:// store "
                    f"(store.url), not {getattr(store, 'url', store)!r}"
                )
            kill(fault.shard)
        if fault.action == "raise":
            raise InjectedFault(
                f"injected fault: {where} raised (faults entry {fault.model_dump()})"
            )
        if fault.action == "exit_flow":
            os._exit(EXIT_STATUS)
