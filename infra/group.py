"""A group of ``PPOWorker`` Ray actors on one resource pool, used by the stage tasks.

The group shards a batch over its data-parallel workers, calls them in parallel and joins the
results in order. Calls name the worker's method itself (``group.call(PPOWorker.ping)``), so a
reader can jump from a stage to the code it runs. Every blocking ``ray.get`` has its own timeout (``call_timeout_s``): a stalled
worker surfaces as ``WorkerTimeout`` (a ``TimeoutError``), which Prefect retries.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import ray

from infra.cluster import ResourcePool
from infra.transport import Jagged
from infra.workers import PPOWorker, WorkerSpec

P = ParamSpec("P")
R = TypeVar("R")


def _method_name(method: Callable[..., Any]) -> str:
    """The name of a ``PPOWorker`` method (refusing anything else)."""
    name = getattr(method, "__name__", "")
    if getattr(PPOWorker, name, None) is not method:
        raise TypeError(f"{method!r} is not a PPOWorker method")
    return str(name)


class WorkerTimeout(TimeoutError):
    """A worker call did not return within ``orchestration.call_timeout_s``."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def split(n: int, parts: int) -> list[slice]:
    """Contiguous shards of ``range(n)`` covering every index, sizes differing by at most one
    (equal when ``parts`` divides ``n``, as the config checks for training batches)."""
    size, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


def take(j: Jagged, sl: slice) -> Jagged:
    start, stop = int(j.offsets[sl.start]), int(j.offsets[sl.stop])
    return Jagged(j.values[start:stop], j.offsets[sl.start : sl.stop + 1] - start)


def concat(parts: Sequence[Jagged]) -> Jagged:
    values = np.concatenate([p.values for p in parts])
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for p in parts:
        offsets.append(p.offsets[1:] + base)
        base += int(p.offsets[-1])
    return Jagged(values, np.concatenate(offsets))


class WorkerGroup:
    """``size`` workers, one per bundle of ``pool``, holding ``spec.roles``."""

    def __init__(self, pool: ResourcePool, spec: WorkerSpec, *, call_timeout_s: float) -> None:
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self.roles = spec.roles
        # Only trainers form a torch.distributed group (rollout/reward workers shard independently).
        world = pool.size if "actor" in spec.roles else 1
        dist_address = f"127.0.0.1:{_free_port()}" if world > 1 else None
        remote_cls = ray.remote(PPOWorker)
        self.workers = [
            remote_cls.options(**pool.actor_options(rank, share=1.0)).remote(
                replace(spec, rank=rank, world_size=world, dist_address=dist_address)
            )
            for rank in range(pool.size)
        ]
        self.call(PPOWorker.ping)

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

    def call(
        self, method: Callable[Concatenate[PPOWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """The same call of ``method`` (a ``PPOWorker`` method) on every worker."""
        name = _method_name(method)
        return list(
            self.get([getattr(w, name).remote(*args, **kwargs) for w in self.workers], name)
        )

    def call_sharded(
        self,
        method: Callable[Concatenate[PPOWorker, ...], R],
        shards: list[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[R]:
        """One call per shard, shard i on worker i (fewer shards than workers leave the rest idle)."""
        name = _method_name(method)
        if len(shards) > len(self.workers):
            raise ValueError(f"{len(shards)} shards for {len(self.workers)} workers of {name}")
        refs = [getattr(w, name).remote(*a, **k) for w, (a, k) in zip(self.workers, shards)]
        return list(self.get(refs, name))

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
