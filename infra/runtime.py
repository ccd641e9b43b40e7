"""What a training run computes on, held once: the store, the worker groups, the reward-function
pool, and the resource pools and Ray instance they run on (``flows.runtime.build_runtime``
builds it; ``tasks.context.StageContext`` hands it to the stages)."""

from __future__ import annotations

from dataclasses import dataclass, field

from infra.cluster import ResourcePool
from infra.group import WorkerGroup
from infra.reward_functions import RewardFunctionPool
from storage import Store


@dataclass
class Runtime:
    """The run's compute handles. ``rollout_group`` and ``reward_group`` are the training group
    itself when they share its pool; ``reward_group`` is None without a reward model or judge and
    ``reward_pool`` None without reward functions."""

    store: Store
    train_group: WorkerGroup
    rollout_group: WorkerGroup
    reward_group: WorkerGroup | None = None
    reward_pool: RewardFunctionPool | None = None
    pools: list[ResourcePool] = field(default_factory=list)
    started_ray: bool = False

    def groups(self) -> list[WorkerGroup]:
        """Each worker group once (pools that share a group list it once)."""
        found = {
            id(g): g
            for g in (self.train_group, self.reward_group, self.rollout_group)
            if g is not None
        }
        return list(found.values())

    def shutdown(self) -> None:
        if self.reward_pool is not None:
            self.reward_pool.close()
        for g in self.groups():
            g.shutdown()
        for pool in self.pools:
            pool.release()
        self.store.close()
        if self.started_ray:
            import ray

            ray.shutdown()
