"""What every stage task needs besides its ``BatchMeta``: the store, the config, the worker
groups and the reward-function pool.

A plain class on purpose: Prefect walks dataclasses and dicts in task arguments looking for
futures, and this object holds a store and Ray actor handles that it must not walk.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from infra.config import TrainConfig
from infra.faults import FaultPlan


class StageContext:
    """Shared handles of one training run (one per flow run)."""

    def __init__(
        self,
        *,
        cfg: TrainConfig,
        store: Any,
        tokenizer: Any,
        train_group: Any,
        reward_group: Any | None = None,
        rollout_group: Any | None = None,
        kl_controller: Any | None = None,
        reward_pool: Any | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.tokenizer = tokenizer
        self.train_group = train_group
        self.reward_group = reward_group  # None: no reward model in this run
        self.rollout_group = rollout_group or train_group
        self.kl_controller = kl_controller
        self.reward_pool = reward_pool  # None: no reward functions
        self.faults = faults if faults is not None else FaultPlan([], None)
        self.metrics: dict[int, dict[str, float]] = defaultdict(dict)

    def record(self, step: int, values: dict[str, float]) -> None:
        self.metrics[step].update({k: float(v) for k, v in values.items()})

    @property
    def get_timeout(self) -> float:
        return self.cfg.store.get_timeout_s

    def inject(self, stage: str, step: int, group: Any | None = None) -> None:
        """Fire the ``faults`` entry due at this try of ``stage`` (infra.faults): ``raise``,
        ``exit_flow`` and ``kill_store_shard`` act here, ``delay`` and ``kill_worker`` on
        ``group``'s next call."""
        if not self.faults.faults:
            return
        from prefect.runtime import task_run

        attempt = max(int(task_run.run_count or 1), 1)
        fault = self.faults.take(stage, step, attempt)
        self.faults.fire_here(fault, f"{stage} at step {step}, attempt {attempt}", self.store)
        if fault is not None and group is not None and fault.action in ("delay", "kill_worker"):
            group.arm(fault)
