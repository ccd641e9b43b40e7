"""A group of ``ModelWorker`` Ray actors on one resource pool, used by the stage tasks.

A stage asks the group to run its worker-side step: ``group.run_sharded(fn, meta, ...)``
gives worker i the i-th shard of ``meta`` (a ``BatchMeta``: partition and keys, no data), and
each worker reads and writes its own rows in the store. Only handles go out and only the
steps' small replies (metrics, versions) come back. Steps are Python functions and worker
methods are named by the method itself (``group.call(ModelWorker.ping)``), so a reader can jump
from a stage to the code it runs. Every blocking ``ray.get`` has its own timeout
(``call_timeout_s``): a stalled worker surfaces as ``WorkerTimeout`` (a ``TimeoutError``),
which Prefect retries. An exception raised by a step is re-raised as itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray

from infra.cluster import ResourcePool
from infra.config import FaultConfig
from infra.workers import ModelWorker, WorkerSpec
from storage import BatchMeta

P = ParamSpec("P")
R = TypeVar("R")


def _method_name(method: Callable[..., Any]) -> str:
    """The name of a ``ModelWorker`` method (refusing anything else)."""
    name = getattr(method, "__name__", "")
    if getattr(ModelWorker, name, None) is not method:
        raise TypeError(f"{method!r} is not a ModelWorker method")
    return str(name)


class WorkerTimeout(TimeoutError):
    """A worker call did not return within ``orchestration.call_timeout_s``."""


class WorkerDied(RuntimeError):
    """A worker's process is gone (killed, out of memory, its node lost); ``group`` names it."""

    def __init__(self, message: str, group: WorkerGroup) -> None:
        super().__init__(message)
        self.group = group


class WorkerGroup:
    """``size`` workers, one per bundle of ``pool``, holding ``spec.roles``."""

    def __init__(self, pool: ResourcePool, spec: WorkerSpec, *, call_timeout_s: float) -> None:
        self.pool = pool
        self.spec = spec
        self.call_timeout_s = call_timeout_s
        self.roles = spec.roles
        self.workers: list[Any] = []
        self._fault: FaultConfig | None = None
        self.start()

    def start(self) -> None:
        """Start the workers; trainers then form their torch.distributed group, meeting on
        rank 0's node (rollout and reward workers shard independently)."""
        world = self.pool.size if "actor" in self.spec.roles else 1
        remote_cls = ray.remote(ModelWorker)
        self.workers = [
            remote_cls.options(**self.pool.actor_options(rank, share=1.0)).remote(
                replace(self.spec, rank=rank, world_size=world)
            )
            for rank in range(self.pool.size)
        ]
        # Loading the models may take longer than one call may: startup has its own bound.
        ray.get([w.ping.remote() for w in self.workers], timeout=max(self.call_timeout_s, 600.0))
        if world > 1 or self._sharded_alone():
            address = self.get(self.workers[0].rendezvous_address.remote(), "rendezvous_address")
            self.get([w.join_group.remote(address) for w in self.workers], "join_group")

    def _sharded_alone(self) -> bool:
        """One trainer with ``fsdp2`` asked for: it needs a (one-worker) group too."""
        cfg = self.spec.cfg
        return "actor" in self.spec.roles and "fsdp2" in (cfg.actor.strategy, cfg.critic.strategy)

    def restart(self) -> None:
        """Replace every worker with a fresh one (models loaded anew from ``spec``)."""
        for w in self.workers:
            ray.kill(w)
        self.start()

    def arm(self, fault: FaultConfig | None) -> None:
        """Apply ``fault`` (``delay`` or ``kill_worker``) to the next call of a step."""
        self._fault = fault

    @property
    def size(self) -> int:
        return len(self.workers)

    def get(self, refs: Any, what: str) -> Any:
        try:
            return ray.get(refs, timeout=self.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerTimeout(
                f"{what} on pool {self.pool.name!r} did not return within {self.call_timeout_s:.0f} s "
                "(orchestration.call_timeout_s)"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(
                f"{self._dead_worker()} of pool {self.pool.name!r} (roles {', '.join(self.roles)}) "
                f"died during {what}: {type(exc).__name__}",
                self,
            ) from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None  # the step's own error, e.g. a non-finite score
            raise

    def _dead_worker(self) -> str:
        """``worker <rank>`` of the first worker that no longer answers."""
        for rank, w in enumerate(self.workers):
            try:
                ray.get(w.ping.remote(), timeout=min(self.call_timeout_s, 10.0))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return f"worker {rank}"
        return "a worker"

    def _submit(
        self, index: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """One ``run`` call on worker ``index``, with the armed fault if any (rank 0 is the one
        killed; every worker delays its reply)."""
        w, fault = self.workers[index], self._fault
        if fault is None or (fault.action == "kill_worker" and index != 0):
            return w.run.remote(fn, *args, **kwargs)
        return w.run_faulty.remote(fault.action, fault.seconds, fn, *args, **kwargs)

    def call(
        self, method: Callable[Concatenate[ModelWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """The same call of ``method`` (a ``ModelWorker`` method) on every worker."""
        name = _method_name(method)
        return list(
            self.get([getattr(w, name).remote(*args, **kwargs) for w in self.workers], name)
        )

    def run(
        self,
        fn: Callable[Concatenate[ModelWorker, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[R]:
        """``fn(worker, *args, **kwargs)`` on every worker."""
        refs = [self._submit(i, fn, args, kwargs) for i in range(self.size)]
        return list(self._collect(refs, fn.__qualname__))

    def run_on(
        self,
        rank: int,
        fn: Callable[Concatenate[ModelWorker, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``fn(worker, *args, **kwargs)`` on worker ``rank`` only."""
        result: R = self._collect(self._submit(rank, fn, args, kwargs), fn.__qualname__)
        return result

    def run_each(
        self,
        fn: Callable[Concatenate[ModelWorker, ...], R],
        calls: list[dict[str, Any]],
        /,
    ) -> list[R]:
        """``fn(worker_i, **calls[i])``, one call per worker in order (fewer calls than
        workers leave the rest idle); the replies come back in call order."""
        if len(calls) > len(self.workers):
            raise ValueError(f"{len(calls)} calls of {fn.__qualname__} for {self.size} workers")
        refs = [self._submit(i, fn, (), kw) for i, kw in enumerate(calls)]
        return list(self._collect(refs, fn.__qualname__))

    def run_sharded(
        self,
        fn: Callable[Concatenate[ModelWorker, BatchMeta, ...], R],
        meta: BatchMeta,
        /,
        *,
        skip_empty: bool = False,
        **kwargs: Any,
    ) -> list[R]:
        """``fn(worker_i, shard_i, **kwargs)`` with ``meta``'s keys split into one contiguous
        shard per worker (``skip_empty`` leaves workers without keys idle); the replies come
        back in shard order."""
        shards = [s for s in meta.shards(self.size) if s.keys or not skip_empty]
        refs = [self._submit(i, fn, (shard,), kwargs) for i, shard in enumerate(shards)]
        return list(self._collect(refs, fn.__qualname__))

    def _collect(self, refs: Any, what: str) -> Any:
        self._fault = None  # a fault applies to one call
        return self.get(refs, what)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
