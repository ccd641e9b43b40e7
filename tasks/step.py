"""Declared worker steps over a typed per-shard batch: what a training worker does for a stage,
as data.

**The batch.** A ``Shard`` is one worker's rows of a step: a tensordict ``TensorClass`` with
``batch_size=[B]`` (B: the shard's keys) whose every field is a store field of the same name
(``storage.schema.VOCABULARY``), or None when the step did not read it, except
``response_mask``, which no stage stores:

- jagged (``torch.jagged`` nested tensors, one row per sample): ``prompt_ids``,
  ``response_ids``, the per-token log-probs, values, advantages and returns;
- dense (B,): ``group_ids``, ``scores``, ``truncated`` and the agent loop's counts;
- ``response_mask`` (jagged bool): True on the response tokens the policy sampled. It is built
  once, where the shard is read (``shard_of``): the multi-turn ``loss_mask`` (False on
  tool-message tokens) when the store holds one, else every response token. Every estimator,
  penalty, loss and metric downstream takes it as it is.

``read_shard`` builds a shard from the store, ``write_shard`` puts fields of one back.

**The steps.** A ``WorkerStep`` names the fields it reads, the model that must be awake while it
computes (``Awake``: a training role, the reference policy, or none), the compute function and
the fields it writes. ``run_steps`` is the only place that moves a training stage's rows between
the store and a worker: it reads the fields every step of the sequence declares (one get), and
for each step wakes its model, computes, and sets the step's fields on the shard; it then writes
every declared field back (one put) and returns the steps' metrics, merged. With ``once`` the
whole sequence is applied at most once per name (``ModelWorker.once``): a retried stage gets the
first attempt's metrics.

A compute function takes the worker (its config, device and data-parallel collectives), the
awake model's module (None for ``awake=None``) and the shard, and returns a shard of the fields
it writes (the same rows) and its metrics. Nothing in it reads or writes the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from tensordict import TensorClass, TensorDictBase
from torch import Tensor

from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.batching import PackedBatch, pack_batch
from tasks.context import Metrics
from tasks.io import offsets, padded, rows

LOSS_MASK = "loss_mask"  # stored by a multi-turn rollout; read into ``response_mask``


if TYPE_CHECKING:
    _Fields = TensorClass
else:  # "shadow": the store field ``values`` is a field here, over TensorClass.values()
    _Fields = TensorClass["shadow"]


class Shard(_Fields):
    """See the module docstring."""

    prompt_ids: Tensor | None = None
    response_ids: Tensor | None = None
    response_mask: Tensor | None = None
    group_ids: Tensor | None = None
    scores: Tensor | None = None
    truncated: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    values: Tensor | None = None  # type: ignore[assignment]  # shadows TensorClass.values()
    advantages: Tensor | None = None
    returns: Tensor | None = None
    num_turns: Tensor | None = None
    tool_calls: Tensor | None = None
    tool_errors: Tensor | None = None
    truncated_tool_responses: Tensor | None = None

    def need(self, name: str) -> Tensor:
        """The field ``name``, which the step declared it reads."""
        value: Tensor | None = getattr(self, name)
        if value is None:
            raise KeyError(f"the shard holds no {name!r}: the step must declare it in its reads")
        return value

    def packed(self, pad_id: int) -> PackedBatch:
        """The prompts and responses as one right-padded causal-LM batch (its ``response_mask``:
        every response token)."""
        return pack_batch(
            prompt_ids=rows(self.need("prompt_ids")),
            response_ids=rows(self.need("response_ids")),
            pad_id=pad_id,
        )

    def padded(self, name: str, width: int) -> Tensor:
        """The jagged field ``name`` right-padded to (B, ``width``), as float32 (bool for
        ``response_mask``)."""
        value = padded(self.need(name), width)
        return value.bool() if name == "response_mask" else value.float()


def shard_of(fields: Mapping[str, Any] | TensorDictBase, batch_size: int) -> Shard:
    """A shard of ``fields`` (store field names: a store get, or a test's dict), with
    ``response_mask`` built from ``loss_mask`` or ``response_ids`` (see the module docstring)."""
    values = dict(fields.items())
    loss_mask = values.pop(LOSS_MASK, None)
    unknown = sorted(set(values) - {f.name for f in Shard.fields()})
    if unknown:
        raise KeyError(
            f"a shard has no field {unknown[0]!r}: a worker step reads only the fields of "
            "tasks.step.Shard"
        )
    if loss_mask is not None:
        values["response_mask"] = loss_mask.to(torch.bool)
    elif "response_ids" in values:
        ids = values["response_ids"]
        every = torch.ones(ids.values().shape[0], dtype=torch.bool)
        values["response_mask"] = torch.nested.nested_tensor_from_jagged(every, offsets(ids))
    return Shard(**values, batch_size=[batch_size])


def read_shard(worker: ModelWorker, meta: BatchMeta, fields: Sequence[str]) -> Shard:
    """``fields`` of ``meta``'s keys from the store as a shard, waiting up to
    ``store.get_timeout_s`` for rows not produced yet."""
    got = worker.store.kv_batch_get(
        list(meta.keys), meta.partition_id, list(fields), timeout=worker.cfg.store.get_timeout_s
    )
    return shard_of(got, len(meta.keys))


def write_shard(worker: ModelWorker, meta: BatchMeta, shard: Shard, fields: Sequence[str]) -> None:
    """Put the shard's ``fields`` for ``meta``'s keys (all at once, as one put)."""
    if meta.keys and fields:
        worker.write(meta, {name: shard.need(name) for name in fields})


Awake = Literal["actor", "reference", "critic", "teacher"] | None
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
