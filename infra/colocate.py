"""Turn-taking on shared devices: at most one model of a resource pool awake at a time.

The rollout engine, the reward model and the trainer's actor/critic share one pool's devices.
A ``ColocatedGroup`` holds the pool's models under role names and lends them out one at a
time::

    group = ColocatedGroup("pool-0")
    group.register("rollout", engine)
    group.register("reward", scorer)
    group.register("actor", TrainableModel(actor, optimizer, device="cuda"))
    with group.awake("rollout") as engine:
        out = engine.generate(...)
    # the engine is asleep again here, even if generate() raised

The one-awake rule is *checked* against each model's own ``is_awake`` every time, not taken
from bookkeeping, so a model woken behind the group's back is still caught. Wake and sleep
seconds accumulate in ``stats`` under ``timing_s/wake/<role>`` and ``timing_s/sleep/<role>``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from infra.engines.base import ModuleResidency, Sleepable

__all__ = ["ColocatedGroup", "ColocationError", "TrainableModel"]


class ColocationError(RuntimeError):
    """A second model of one resource pool was about to be awake, or a role is unknown."""


class ColocatedGroup:
    """The models sharing one resource pool, woken one at a time through ``awake(role)``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats: dict[str, float] = {}
        self._models: dict[str, Sleepable] = {}
        self._lent: str | None = None  # the role inside an awake() block, if any
        self._lock = threading.Lock()

    def register(self, role: str, model: Sleepable) -> None:
        """Add ``model`` under ``role``; its state is left as it is.

        Raises ColocationError for a role already registered, and when ``model`` is awake
        while another registered model is awake too (call ``put_all_to_sleep()`` first).
        """
        if not isinstance(model, Sleepable):
            raise TypeError(f"role {role!r}: {type(model).__name__} has no sleep/wake_up/is_awake")
        with self._lock:
            if role in self._models:
                raise ColocationError(f"group {self.name!r}: role {role!r} is already registered")
            others = self._awake_roles_locked()
            if model.is_awake and others:
                raise ColocationError(
                    f"group {self.name!r}: cannot register {role!r} awake while {others[0]!r} is "
                    "awake; put one of them to sleep first"
                )
            self._models[role] = model

    def awake_roles(self) -> list[str]:
        """Roles whose model reports ``is_awake`` right now, in registration order."""
        with self._lock:
            return self._awake_roles_locked()

    def put_all_to_sleep(self) -> None:
        """Sleep every awake model (e.g. right after building them, before the first turn)."""
        with self._lock:
            for role in self._awake_roles_locked():
                self._timed_sleep(role)

    @contextmanager
    def awake(self, role: str) -> Iterator[Sleepable]:
        """Wake ``role``'s model, yield it, and always put it back to sleep on exit.

        Raises ColocationError (before waking anything) when the role is unknown or when
        another role's model is awake; the error names that role.
        """
        with self._lock:
            if role not in self._models:
                raise ColocationError(
                    f"group {self.name!r} has no role {role!r}; registered: {sorted(self._models)}"
                )
            others = [r for r in self._awake_roles_locked() if r != role]
            lent = self._lent
            if lent is not None and lent != role and lent not in others:
                others.insert(0, lent)
            if others:
                raise ColocationError(
                    f"group {self.name!r}: cannot wake {role!r} while {others[0]!r} is awake "
                    "(one model per resource pool at a time)"
                )
            if self._models[role].is_awake:
                raise ColocationError(
                    f"group {self.name!r}: {role!r} is already awake (nested awake() or woken "
                    "outside the group)"
                )
            self._lent = role
        model = self._models[role]
        try:
            start = time.perf_counter()
            model.wake_up()
            self._add(f"timing_s/wake/{role}", time.perf_counter() - start)
            yield model
        finally:
            try:
                self._timed_sleep(role)
            finally:
                self._lent = None

    def pop_stats(self) -> dict[str, float]:
        """Return the accumulated timings and reset them (one call per training step)."""
        stats, self.stats = self.stats, {}
        return stats

    def _awake_roles_locked(self) -> list[str]:
        return [role for role, model in self._models.items() if model.is_awake]

    def _timed_sleep(self, role: str) -> None:
        start = time.perf_counter()
        self._models[role].sleep()
        self._add(f"timing_s/sleep/{role}", time.perf_counter() - start)

    def _add(self, key: str, seconds: float) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + seconds


class TrainableModel:
    """A trainer's module plus its optimizer (and scheduler), ``Sleepable`` for a group.

    On CUDA, ``sleep()`` moves parameters, gradients, buffers and every optimizer-state tensor
    to the CPU and empties the CUDA cache; ``wake_up()`` moves the module back, then each state
    tensor to its parameter's device, following torch's own rule for optimizer state: a
    ``step`` counter stays on the CPU unless its param group is ``capturable`` or ``fused``.
    So an optimizer state loaded while asleep lands correctly too. Parameter objects never
    change, so the optimizer keeps working across turns. On a CPU device nothing moves and only
    the flag changes. The scheduler never holds tensors and is only carried along.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: str | torch.device = "cpu",
        scheduler: Any | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = torch.device(device)
        self._residency = ModuleResidency(module, self.device)

    @property
    def is_awake(self) -> bool:
        return self._residency.is_awake

    def sleep(self) -> None:
        """Offload the module and the optimizer state (CUDA); mark asleep. Idempotent."""
        self._residency.sleep()
        if self._residency.offloads:
            self._move_optimizer_state(to_cpu=True)
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Restore the module, then the optimizer state, bit-identical. Idempotent."""
        self._residency.wake_up()
        if self._residency.offloads:
            self._move_optimizer_state(to_cpu=False)

    def require_awake(self) -> None:
        """Raise ``EngineAsleepError`` unless awake (call before training steps)."""
        self._residency.require_awake("TrainableModel")

    def _move_optimizer_state(self, *, to_cpu: bool) -> None:
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            step_follows = bool(group.get("capturable") or group.get("fused"))
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                for name, value in state.items():
                    if not isinstance(value, Tensor):
                        continue
                    if to_cpu:
                        state[name] = value.to("cpu")
                    elif name != "step" or step_follows:
                        state[name] = value.to(param.device)
