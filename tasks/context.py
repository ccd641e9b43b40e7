"""What every stage task needs besides its ``BatchMeta``, and what it gives back.

``StageContext`` carries the run's config, its step plan (``tasks.plan``), the policy's tokenizer,
the KL controller, the injected faults and the ``Runtime`` (``infra.runtime``: store, worker
groups, reward-function pool) — each held once. Stages return their outputs as ``StageResult``s
(the widened handle and the stage's metrics); nothing is written into shared state.

``faults_at`` is the one seam where injected faults (``infra.faults``) enter a stage: it wraps
the stage's function, strikes the entry due at this try and arms the stage's worker group.

A plain class on purpose: Prefect walks dataclasses and dicts in task arguments looking for
futures, and this object holds a store and Ray actor handles that it must not walk.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Concatenate, Literal, ParamSpec, TypeVar

from infra.config import TrainConfig
from infra.faults import FaultPlan
from infra.group import WorkerGroup
from infra.runtime import Runtime
from storage import BatchMeta
from tasks.kl import AdaptiveKLController, FixedKLController
from tasks.plan import StepPlan

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


KLController = FixedKLController | AdaptiveKLController
Metrics = dict[str, float]
Stage = Literal["generate", "score", "filter", "logprobs", "advantage", "update", "validate"]


def kl_controller(cfg: TrainConfig) -> KLController:
    """The run's KL coefficient: adaptive (``algorithm.kl.adaptive``) or fixed."""
    kl = cfg.algorithm.kl
    if kl.adaptive:
        return AdaptiveKLController(init_coef=kl.coef, target=kl.target, horizon=kl.horizon)
    return FixedKLController(coef=kl.coef)


class StageContext:
    """Shared handles of one training run (one per flow run)."""

    def __init__(
        self,
        *,
        cfg: TrainConfig,
        rt: Runtime,
        tokenizer: PreTrainedTokenizerBase | None,
        plan: StepPlan | None = None,
        kl: KLController | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        self.cfg = cfg
        self.rt = rt  # the store, the worker groups, the reward-function pool
        self.tokenizer = tokenizer  # the policy's (None: a context that submits no prompts)
        self.plan = plan if plan is not None else StepPlan.from_config(cfg)
        self.kl = kl if kl is not None else kl_controller(cfg)
        self.faults = faults if faults is not None else FaultPlan([], None)


@dataclass(frozen=True)
class StageResult:
    """A stage's output: the handle of what it wrote, and its metrics for the step."""

    meta: BatchMeta
    metrics: Metrics = field(default_factory=dict)


In = TypeVar("In")
Out = TypeVar("Out")
P = ParamSpec("P")
StageFn = Callable[Concatenate[StageContext, In, int, P], Out]


def faults_at(
    stage: Stage, group: Callable[[StageContext], WorkerGroup]
) -> Callable[[StageFn[In, P, Out]], StageFn[In, P, Out]]:
    """Wrap a stage's function ``fn(ctx, input, step, ...)`` (under its ``@task``): before it
    runs, the ``faults`` entry due at this try (and, for a stage that takes one, its keyword
    ``round``) strikes (``infra.faults.strike``), worker-side actions armed on ``group(ctx)``."""

    def wrap(fn: StageFn[In, P, Out]) -> StageFn[In, P, Out]:
        @functools.wraps(fn)
        def run(ctx: StageContext, inp: In, step: int, /, *args: P.args, **kwargs: P.kwargs) -> Out:
            if ctx.faults.faults:
                from prefect.runtime import task_run

                attempt = max(int(task_run.run_count or 1), 1)
                at = kwargs.get("round", 0)  # a stage that takes rounds: its keyword int
                assert isinstance(at, int), f"{stage}: round={at!r} is not an int"
                ctx.faults.strike_due(
                    stage, step, attempt, round=at, store=ctx.rt.store, group=group(ctx)
                )
            return fn(ctx, inp, step, *args, **kwargs)

        return run

    return wrap


class Timings:
    """Seconds spent per named part of a step: ``with timings("generate"): ...`` adds
    ``timing_s/generate``."""

    def __init__(self) -> None:
        self.seconds: Metrics = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing_s/{name}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
