"""Declared worker steps: what a training worker does for a stage, as data.

A ``WorkerStep`` names the shard fields it reads, the model that must be awake while it computes
(``Awake``: a training role, the reference policy, or none), the compute function and the
fields it writes. ``run_steps`` is the only place that moves a stage's rows between the store
and a worker: it reads the fields every step of the sequence declares (one get), and for each
step wakes its model, computes, and sets the step's fields on the shard; it then writes every
declared field back (one put) and returns the steps' metrics, merged. With ``once`` the whole
sequence is applied at most once per name (``ModelWorker.once``): a retried stage gets the first
attempt's metrics.

A compute function takes the worker (its config, device and data-parallel collectives), the
awake model's module (None for ``awake=None``) and the shard, and returns a shard of the fields
it writes (the same rows) and its metrics. Nothing in it reads or writes the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.context import Metrics
from tasks.shard import Shard, read_shard, write_shard

Awake = Literal["actor", "reference", "critic"] | None
Compute = Callable[[ModelWorker, torch.nn.Module | None, Shard], tuple[Shard, Metrics]]


@dataclass(frozen=True)
class WorkerStep:
    """See the module docstring."""

    name: str
    reads: tuple[str, ...]
    awake: Awake
    compute: Compute
    writes: tuple[str, ...]


@contextmanager
def _awake(worker: ModelWorker, awake: Awake) -> Iterator[torch.nn.Module | None]:
    """The module of ``awake`` (the reference: ``ModelWorker.reference``), awake in the block."""
    if awake is None:
        yield None
    elif awake == "reference":
        with worker.reference() as module:
            yield module
    else:
        with worker.awake(awake) as model:
            yield model.module


def _fields(names: Iterator[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def run_steps(
    worker: ModelWorker,
    meta: BatchMeta,
    steps: tuple[WorkerStep, ...],
    *,
    once: str | None = None,
) -> Metrics:
    """Read → (wake → compute) per step → write, for ``meta``'s rows on this worker; see the
    module docstring."""

    def apply() -> Metrics:
        shard = read_shard(worker, meta, _fields(f for step in steps for f in step.reads))
        metrics: Metrics = {}
        for step in steps:
            with _awake(worker, step.awake) as module:
                out, produced = step.compute(worker, module, shard)
            for name in step.writes:
                setattr(shard, name, out.need(name))
            metrics.update(produced)
        write_shard(worker, meta, shard, _fields(f for step in steps for f in step.writes))
        return metrics

    return apply() if once is None else worker.once(once, apply)
