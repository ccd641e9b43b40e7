"""A group of ``ModelWorker`` Ray actors on one resource pool, used by the stage tasks.

A stage asks the group to run its worker-side step: ``group.run_sharded(step, meta, ...)``
gives worker i the i-th shard of ``meta`` (a ``BatchMeta``: partition and keys, no data), and
each worker reads and writes its own rows in the store. Only handles go out and only the
steps' small replies (metrics, versions) come back. Steps are Python functions and worker
methods are named by the method itself (``group.call(ModelWorker.ping)``), so a reader can jump
from a stage to the code it runs. Every blocking ``ray.get`` has its own timeout
(``call_timeout_s``): a stalled worker surfaces as ``WorkerTimeout`` (a ``TimeoutError``),
which Prefect retries. An exception raised by a step is re-raised as itself.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray

from infra.cluster import ResourcePool
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WorkerGroup:
    """``size`` workers, one per bundle of ``pool``, holding ``spec.roles``."""

    def __init__(self, pool: ResourcePool, spec: WorkerSpec, *, call_timeout_s: float) -> None:
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self.roles = spec.roles
        # Only trainers form a torch.distributed group (rollout/reward workers shard independently).
        world = pool.size if "actor" in spec.roles else 1
        dist_address = f"127.0.0.1:{_free_port()}" if world > 1 else None
        remote_cls = ray.remote(ModelWorker)
        self.workers = [
            remote_cls.options(**pool.actor_options(rank, share=1.0)).remote(
                replace(spec, rank=rank, world_size=world, dist_address=dist_address)
            )
            for rank in range(pool.size)
        ]
        self.call(ModelWorker.ping)

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
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None  # the step's own error, e.g. a non-finite score
            raise

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
        step: Callable[Concatenate[ModelWorker, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[R]:
        """``step(worker, *args, **kwargs)`` on every worker."""
        refs = [w.run.remote(step, *args, **kwargs) for w in self.workers]
        return list(self.get(refs, step.__qualname__))

    def run_on(
        self,
        rank: int,
        step: Callable[Concatenate[ModelWorker, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``step(worker, *args, **kwargs)`` on worker ``rank`` only."""
        result: R = self.get(
            self.workers[rank].run.remote(step, *args, **kwargs), step.__qualname__
        )
        return result

    def run_each(
        self,
        step: Callable[Concatenate[ModelWorker, ...], R],
        calls: list[dict[str, Any]],
    ) -> list[R]:
        """``step(worker_i, **calls[i])``, one call per worker in order (fewer calls than
        workers leave the rest idle); the replies come back in call order."""
        if len(calls) > len(self.workers):
            raise ValueError(f"{len(calls)} calls of {step.__qualname__} for {self.size} workers")
        refs = [w.run.remote(step, **kw) for w, kw in zip(self.workers, calls)]
        return list(self.get(refs, step.__qualname__))

    def run_sharded(
        self,
        step: Callable[Concatenate[ModelWorker, BatchMeta, ...], R],
        meta: BatchMeta,
        *,
        skip_empty: bool = False,
        **kwargs: Any,
    ) -> list[R]:
        """``step(worker_i, shard_i, **kwargs)`` with ``meta``'s keys split into one contiguous
        shard per worker (``skip_empty`` leaves workers without keys idle); the replies come
        back in shard order."""
        shards = [s for s in meta.shards(self.size) if s.keys or not skip_empty]
        refs = [w.run.remote(step, shard, **kwargs) for w, shard in zip(self.workers, shards)]
        return list(self.get(refs, step.__qualname__))

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
