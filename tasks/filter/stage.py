"""filter: dynamic sampling's cut of one round (``algorithm.filter_groups``).

The task takes the step's candidate rows (the groups kept in earlier rounds, then this round's
scored ones), reads the metric the config names (``scores``; ``rule_scores`` for ``rule``; a
reward function's part of ``reward_parts``), keeps the first ``want`` groups whose values spread
(``tasks.filter.core.choose_groups``) and removes every other row from the partition. It decides
on the rows still present, so a retried task decides the same and removes nothing twice: what a
first try removed was a group without spread, or surplus beyond ``want``, and neither can come
back as kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from storage import BatchMeta
from tasks.context import StageContext, faults_at
from tasks.filter.core import GroupChoice, choose_groups


@dataclass(frozen=True)
class FilterJob:
    """One round's cut: the candidate rows (prompt-major, earlier rounds' kept groups first) and
    how many groups the step wants."""

    candidates: BatchMeta
    want: int
    round: int


@dataclass(frozen=True)
class FilterResult:
    """The rows kept (their handle) and this cut's groups by label."""

    meta: BatchMeta
    choice: GroupChoice
    removed: int  # rows taken out of the partition by this try


def metric_field(metric: str) -> str:
    """The stored field that holds ``metric`` (a reward function's: ``reward_parts``)."""
    return {"score": "scores", "rule": "rule_scores"}.get(metric, "reward_parts")


def metric_values(data: dict[str, Any], meta: BatchMeta, metric: str) -> torch.Tensor:
    """(B,) float64: the filter metric of each row of ``meta``, from its read ``data``."""
    got = data[metric_field(metric)]
    if metric in ("score", "rule"):
        return torch.as_tensor(got).double()
    name = f"fn/{metric}"
    missing = [k for k, p in zip(meta.keys, got, strict=True) if name not in p]
    if missing:
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r}: no {name!r} part in reward_parts of "
            f"{len(missing)} row(s) of {meta.partition_id}, e.g. {missing[0]!r}"
        )
    return torch.tensor([float(p[name]) for p in got], dtype=torch.float64)


@faults_at("filter", lambda ctx: ctx.rt.train_group)
def filter_groups(ctx: StageContext, job: FilterJob, step: int) -> FilterResult:
    meta = job.candidates
    # 1. The rows still present (a retried try sees what its first try left).
    present = ctx.rt.store.kv_list(meta.partition_id)
    live = BatchMeta(meta.partition_id, tuple(k for k in meta.keys if k in present), meta.fields)
    # 2. The metric and the groups; the choice.
    metric = ctx.cfg.algorithm.filter_groups.metric
    fields = ["group_ids", metric_field(metric)]
    data = ctx.rt.store.kv_batch_get(list(live.keys), live.partition_id, fields, timeout=0)
    values = metric_values(data, live, metric)  # (B,)
    group_ids = torch.as_tensor(data["group_ids"])  # (B,)
    choice = choose_groups(values=values, group_ids=group_ids, want=job.want)
    # 3. Remove the rows of dropped and surplus groups; the kept rows' handle.
    keep = set(choice.kept)
    kept = tuple(k for k, g in zip(live.keys, group_ids.tolist(), strict=True) if g in keep)
    gone = [k for k, g in zip(live.keys, group_ids.tolist(), strict=True) if g not in keep]
    removed = ctx.rt.store.kv_clear(meta.partition_id, gone) if gone else 0
    return FilterResult(BatchMeta(meta.partition_id, kept, meta.fields), choice, removed)
