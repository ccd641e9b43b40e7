"""Declared worker steps over a typed per-shard batch: what a worker does for a stage, as data.

**The batch.** A ``Shard`` is one worker's rows of a step: a tensordict ``TensorClass`` with
``batch_size=[B]`` (B: the shard's keys) whose fields are store fields of the same name
(``storage.schema.VOCABULARY``), or None when the step did not read or compute them:

- jagged (``torch.jagged`` nested tensors, one row per sample): ``prompt_ids``,
  ``response_ids``, ``loss_mask``, ``rm_scores``, the per-token log-probs, values, advantages
  and returns;
- dense (B,): ``group_ids``, ``scores``, ``truncated``, ``rollout_version``, ``rule_scores`` and
  the agent loop's counts;
- objects (a list, one item per row, kept as given): ``raw_prompt``, ``ground_truth``,
  ``data_source``, ``messages`` and ``judge_verdicts``;

and some that no stage stores:

- ``response_mask`` (jagged bool): True on the response tokens the policy sampled. It is built
  once, where the shard is read (``shard_of``), and again after a step that computes the
  responses (``response_mask``): the multi-turn ``loss_mask`` (False on tool-message tokens)
  when the shard holds one, else every response token. Every estimator,
  penalty, loss and metric downstream takes it as it is.
- ``rm``, ``rm_mean``, ``rm_std``, ``response_lengths`` (dense (B,)) and ``response_text``
  (objects): what the scoring steps send back to the flow for it to add up
  (``tasks.score.stage``).

``read_shard`` builds a shard from the store, ``write_shard`` puts fields of one back.

**The steps.** A ``WorkerStep`` names the fields it reads, the model that must be awake while it
computes (``Awake``: a role's model, the reference policy, or none), the compute function, the
fields it writes to the store and those it returns to the caller. ``run_steps`` is the only
place that moves a stage's rows between the store and a worker: it reads, in one get, the fields
the steps of the sequence read and no earlier step of it computes; for each step it wakes its
model, computes, and sets the step's fields on the shard (a later step reads them there); it
then writes every declared field back (one put) and returns the steps' metrics, merged, with the
shard of the fields they return. A step that raises writes nothing: the put comes after the
last step. With ``once`` the whole sequence is applied at most once per name
(``ModelWorker.once``): a retried stage gets the first attempt's result.

A compute function takes the worker (its config, device, tokenizer and data-parallel
collectives), the awake model (see ``Awake``; None for ``awake=None``) and the shard, and returns
a shard of the fields it writes and returns (the same rows) and its metrics. Nothing in it reads
or writes the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, get_type_hints

import torch
from tensordict import NonTensorData, TensorClass, TensorDictBase
from torch import Tensor

from infra.workers import ModelWorker
from storage import VOCABULARY, BatchMeta
from tasks.batching import PackedBatch, pack_batch
from tasks.context import Metrics
from tasks.io import offsets, padded, rows

if TYPE_CHECKING:
    _Fields = TensorClass
else:  # "shadow": the store field ``values`` is a field here, over TensorClass.values()
    _Fields = TensorClass["shadow"]


class Shard(_Fields):
    """See the module docstring."""

    prompt_ids: Tensor | None = None
    response_ids: Tensor | None = None
    response_mask: Tensor | None = None
    loss_mask: Tensor | None = None
    group_ids: Tensor | None = None
    rollout_version: Tensor | None = None
    scores: Tensor | None = None
    truncated: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    values: Tensor | None = None  # type: ignore[assignment]  # shadows TensorClass.values()
    advantages: Tensor | None = None
    returns: Tensor | None = None
    rm_scores: Tensor | None = None
    rule_scores: Tensor | None = None
    num_turns: Tensor | None = None
    tool_calls: Tensor | None = None
    tool_errors: Tensor | None = None
    truncated_tool_responses: Tensor | None = None
    raw_prompt: list[Any] | None = None
    ground_truth: list[Any] | None = None
    data_source: list[Any] | None = None
    messages: list[Any] | None = None
    judge_verdicts: list[Any] | None = None
    rm: Tensor | None = None
    rm_mean: Tensor | None = None
    rm_std: Tensor | None = None
    response_lengths: Tensor | None = None
    response_text: list[Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        """An object field's list is kept as it is (one ``NonTensorData`` holding it), never
        cast: tensordict would turn a list of numbers into a tensor."""
        if name in OBJECT_FIELDS and isinstance(value, list):
            if len(value) != self.batch_size[0]:
                raise ValueError(
                    f"the shard's {name!r} has {len(value)} items for {self.batch_size[0]} rows"
                )
            value = NonTensorData(data=value, batch_size=self.batch_size)
        super().__setattr__(name, value)

    def need(self, name: str) -> Tensor:
        """The tensor field ``name``, which the step declared it reads."""
        value = self._declared(name)
        if not isinstance(value, Tensor):
            raise TypeError(f"the shard's {name!r} is a list: take it with Shard.objects")
        return value

    def objects(self, name: str) -> list[Any]:
        """The object field ``name`` (one item per row), which the step declared it reads."""
        value = self._declared(name)
        if isinstance(value, Tensor):
            raise TypeError(f"the shard's {name!r} is a tensor: take it with Shard.need")
        return list(value)

    def _declared(self, name: str) -> Tensor | list[Any]:
        value: Tensor | list[Any] | None = getattr(self, name)
        if value is None:
            raise KeyError(f"the shard holds no {name!r}: the step must declare it in its reads")
        return value

    def value(self, name: str) -> Tensor | list[Any]:
        """The field ``name`` as the store takes it: a tensor, or a list for an object field."""
        value = self._declared(name)
        return value if isinstance(value, Tensor) else list(value)

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


SHARD_FIELDS = frozenset(f.name for f in fields(Shard))
# the fields declared as lists (one item per row)
OBJECT_FIELDS = frozenset(
    name
    for name, hint in get_type_hints(Shard).items()
    if list in {get_origin(arm) for arm in get_args(hint)}
)
UNSTORED = SHARD_FIELDS - set(VOCABULARY)  # the fields no stage stores (see the docstring)


def shard_of(values: Mapping[str, Any] | TensorDictBase, batch_size: int) -> Shard:
    """A shard of ``values`` (store field names: a store get, or a test's dict), with
    ``response_mask`` built from ``loss_mask`` or ``response_ids`` (see the module docstring)."""
    given = dict(values.items())
    unknown = sorted(set(given) - SHARD_FIELDS)
    if unknown:
        raise KeyError(
            f"a shard has no field {unknown[0]!r}: a worker step reads only the fields of "
            "tasks.step.Shard"
        )
    mask = response_mask(given.get("loss_mask"), given.get("response_ids"))
    if mask is not None:
        given["response_mask"] = mask
    return Shard(**given, batch_size=[batch_size])


def response_mask(loss_mask: Tensor | None, response_ids: Tensor | None) -> Tensor | None:
    """The multi-turn ``loss_mask`` as bool, else True on every response token (None without
    either field)."""
    if loss_mask is not None:
        return loss_mask.to(torch.bool)
    if response_ids is None:
        return None
    every = torch.ones(response_ids.values().shape[0], dtype=torch.bool)
    return torch.nested.nested_tensor_from_jagged(every, offsets(response_ids))


def read_shard(worker: ModelWorker, meta: BatchMeta, names: Sequence[str]) -> Shard:
    """``names`` of ``meta``'s keys from the store as a shard, waiting up to
    ``store.get_timeout_s`` for rows not produced yet."""
    got = worker.store.get_fields(meta, list(names), timeout=worker.cfg.store.get_timeout_s)
    return shard_of(got, len(meta.keys))


def write_shard(worker: ModelWorker, meta: BatchMeta, shard: Shard, names: Sequence[str]) -> None:
    """Put the shard's ``names`` for ``meta``'s keys (all at once, as one put)."""
    if meta.keys and names:
        values = {name: shard.value(name) for name in names}
        worker.store.kv_batch_put(list(meta.keys), meta.partition_id, values)


# The model awake while a step computes, as its compute function gets it: the rollout engine
# (``GenerationEngine``), the reward scorer (``RewardScorer``), the judge (``Judge``), a trained
# role's or the teacher's module (``torch.nn.Module``), the reference policy's module
# (``ModelWorker.reference``), or None.
Awake = Literal["rollout", "reward", "judge", "actor", "reference", "critic", "teacher"] | None
Compute = Callable[[ModelWorker, Any, Shard], tuple[Shard, Metrics]]


@dataclass(frozen=True)
class WorkerStep:
    """See the module docstring."""

    name: str
    reads: tuple[str, ...]
    awake: Awake
    compute: Compute
    writes: tuple[str, ...]
    returns: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ran:
    """What ``run_steps`` gives back: the steps' metrics, merged, and a shard of the fields
    they return (every other field None)."""

    metrics: Metrics
    returned: Shard


@contextmanager
def _awake(worker: ModelWorker, awake: Awake) -> Iterator[Any]:
    """The model of ``awake`` (see ``Awake``), awake in the block."""
    if awake is None:
        yield None
    elif awake == "reference":
        with worker.reference() as module:
            yield module
    elif awake in ("actor", "critic", "teacher"):
        with worker.awake(awake) as model:
            yield model.module
    else:  # the rollout engine, the reward scorer or the judge, as they are
        with worker.awake(awake) as model:
            yield model


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def store_reads(steps: Sequence[WorkerStep]) -> tuple[str, ...]:
    """The fields a sequence of steps reads from the store: each step's reads that no earlier
    step of the sequence computes. ``response_mask`` is built, not stored: a step that reads it
    reads ``response_ids`` (and ``loss_mask``, when it declares it)."""
    computed: set[str] = set()
    reads: list[str] = []
    for step in steps:
        wanted = ("response_ids" if name == "response_mask" else name for name in step.reads)
        reads += [name for name in wanted if name not in computed]
        computed.update(step.writes, step.returns)
    return _unique(reads)


def run_steps(
    worker: ModelWorker,
    meta: BatchMeta,
    steps: Sequence[WorkerStep],
    *,
    once: str | None = None,
) -> Ran:
    """Read → (wake → compute) per step → write, for ``meta``'s rows on this worker; see the
    module docstring."""

    def apply() -> Ran:
        shard = read_shard(worker, meta, store_reads(steps))
        metrics: Metrics = {}
        for step in steps:
            with _awake(worker, step.awake) as model:
                out, produced = step.compute(worker, model, shard)
            computed = step.writes + step.returns
            for name in computed:
                setattr(shard, name, out.value(name))
            if {"loss_mask", "response_ids"} & set(computed):  # e.g. a rollout's
                shard.response_mask = response_mask(shard.loss_mask, shard.response_ids)
            metrics.update(produced)
        write_shard(worker, meta, shard, _unique(f for step in steps for f in step.writes))
        returned = Shard(batch_size=shard.batch_size)
        for name in _unique(f for step in steps for f in step.returns):
            setattr(returned, name, shard.value(name))
        return Ran(metrics, returned)

    return apply() if once is None else worker.once(once, apply)
