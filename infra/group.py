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
from infra.engines.base import EngineFailedError
from infra.faults import WorkerFault
from infra.workers import ModelWorker, WorkerSpec
from storage import BatchMeta

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


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
        self.workers: list[Any] = []  # Ray actor handles of ModelWorker
        self._fault: WorkerFault | None = None
        self.start()

    def start(self) -> None:
        """Start the workers; trainers then form their torch.distributed group, meeting on
        rank 0's node (rollout and reward workers shard independently)."""
        world = self.pool.size if self.spec.trains else 1
        remote_cls = ray.remote(ModelWorker)
        self.workers = [
            remote_cls.options(**self.pool.actor_options(rank, share=1.0)).remote(
                replace(self.spec, rank=rank, world_size=world)
            )
            for rank in range(self.pool.size)
        ]
        # Loading the models may take longer than one call may: startup has its own bound.
        ray.get([w.ping.remote() for w in self.workers], timeout=max(self.call_timeout_s, 600.0))
        cfg = self.spec.cfg
        sharded = any(cfg.strategy(role, world) == "fsdp2" for role in ("actor", "critic"))
        if self.spec.trains and (world > 1 or sharded):  # one fsdp2 trainer: a group of one
            address = self.run_on(0, ModelWorker.rendezvous_address)
            self.call(ModelWorker.join_group, address)

    def restart(self) -> None:
        """Replace every worker with a fresh one (models loaded anew from ``spec``)."""
        for w in self.workers:
            ray.kill(w)
        self.start()

    def arm(self, fault: WorkerFault) -> None:
        """Apply ``fault`` (infra.faults) to the next call on this group."""
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
            if isinstance(cause, EngineFailedError):  # a worker that serves no more
                raise WorkerDied(
                    f"a worker of pool {self.pool.name!r} (roles {', '.join(self.roles)}) "
                    f"cannot serve {what}: {cause}",
                    self,
                ) from None
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
        """One ``run`` call on worker ``index``, with the armed fault if any."""
        if self._fault is None:
            return self.workers[index].run.remote(fn, *args, **kwargs)
        return self.workers[index].run_faulty.remote(self._fault, fn, *args, **kwargs)

    def call(
        self, method: Callable[Concatenate[ModelWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """The same call of ``method`` (a ``ModelWorker`` method) on every worker."""
        _method_name(method)
        return self.run(method, *args, **kwargs)

    def relay(
        self,
        source: Callable[[ModelWorker], R],
        target: WorkerGroup,
        sink: Callable[Concatenate[ModelWorker, R, P], S],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[S]:
        """Every worker of this group calls ``source`` (a collective, e.g. gathering sharded
        weights); rank 0's reply goes to ``sink(worker, reply, *args, **kwargs)`` on every
        worker of ``target``, from worker to worker without passing through this process."""
        refs = [self._submit(i, source, (), {}) for i in range(self.size)]
        self._fault = None
        self.get(refs[1:], source.__qualname__)
        replies = [target._submit(i, sink, (refs[0], *args), kwargs) for i in range(target.size)]
        return list(target._collect(replies, sink.__qualname__))

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
        fn: Callable[Concatenate[ModelWorker, BatchMeta, P], R],
        meta: BatchMeta,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[R]:
        """``fn(worker_i, shard_i, *args, **kwargs)`` on every worker, with ``meta``'s keys split
        into one contiguous shard per worker (collectives need every worker, even one without
        keys); the replies come back in shard order."""
        return self._sharded(fn, meta, args, kwargs, skip_empty=False)

    def run_on_keys(
        self,
        fn: Callable[Concatenate[ModelWorker, BatchMeta, P], R],
        meta: BatchMeta,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[R]:
        """``run_sharded`` on the workers whose shard holds keys; the rest stay idle."""
        return self._sharded(fn, meta, args, kwargs, skip_empty=True)

    def _sharded(
        self,
        fn: Callable[..., R],
        meta: BatchMeta,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        skip_empty: bool,
    ) -> list[R]:
        shards = [s for s in meta.shards(self.size) if s.keys or not skip_empty]
        refs = [self._submit(i, fn, (shard, *args), kwargs) for i, shard in enumerate(shards)]
        return list(self._collect(refs, fn.__qualname__))

    def _collect(self, refs: Any, what: str) -> Any:
        self._fault = None  # a fault applies to one call
        return self.get(refs, what)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
