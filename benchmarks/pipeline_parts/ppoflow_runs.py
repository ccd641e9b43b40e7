"""ppoflow in the pipeline benchmark: the three variants (``flow``: the real ``ppo_train``;
``ray+store``: ``Trainer.iteration`` with each task's plain ``.fn``; ``direct``: the same
worker-side steps called on one in-process ``ModelWorker`` over an in-process store), the Baton that makes them take turns step by step, the
child-side entry that runs one of them (or a solo flow) and prints its timed steps, and the
driver-side launchers of those children."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .children import child_env, run_children
from .measure import tree_cpu_s
from .settings import (
    ASYNC_OVERRIDES,
    CHILD_TIMEOUT_S,
    SCRIPT,
    STAGES,
    STEP_PARTS,
    VARIANTS,
    VLLM_OVERRIDES,
)
from .workload import VARLEN_MODES, ppoflow_config, resolved_models


class Baton:
    """Turn-taking between ppoflow variants run side by side: a file names whose step is next.

    The three variants start together and then run their steps in turn (direct, ray+store,
    flow, direct, ...), so step k of each sees nearly the same machine load: their ratio is
    measured on paired steps even while other work comes and goes. Without a path, no-ops.
    It also reads the process tree's CPU seconds: at the start of turns ``first`` and ``last``
    (everything, the background between turns included) and around each turn in between (own
    turns only).
    """

    def __init__(self, path: str | None, name: str, *, first: int, last: int) -> None:
        self.path = Path(path) if path else None
        self.name = name
        turn_order = VARIANTS if name in VARIANTS else (name,)  # a solo run passes to itself
        self.next = turn_order[(turn_order.index(name) + 1) % len(turn_order)]
        self.turn, self.first, self.last = -1, first, last
        self.window_cpu_s: dict[int, float] = {}
        self.own_cpu_s = 0.0

    def wait(self) -> None:
        """Block until it is this variant's turn."""
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while self.path is not None:
            turn = self.path.read_text() if self.path.exists() else ""
            if turn == self.name:
                break
            if turn == "abort" or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the paired run stopped ({turn or 'timeout'})")
            time.sleep(0.005)
        self.turn += 1
        if self.first <= self.turn <= self.last:
            self.window_cpu_s[self.turn] = tree_cpu_s(os.getpid())

    def pass_on(self) -> None:
        if self.first <= self.turn < self.last:
            self.own_cpu_s += tree_cpu_s(os.getpid()) - self.window_cpu_s[self.turn]
        if self.path is not None:
            tmp = self.path.with_name(f"{self.path.name}.{self.name.replace('+', '-')}")
            tmp.write_text(self.next)
            tmp.replace(self.path)

    def cpu_per_step(self) -> dict[str, float]:
        steps = self.last - self.first
        window = self.window_cpu_s[self.last] - self.window_cpu_s[self.first]
        return {"cpu_s_per_step": window / steps, "own_turn_cpu_s_per_step": self.own_cpu_s / steps}


@dataclass
class Run:
    """Per-step metrics rows, seconds of each step's turn, and store seconds (ray+store)."""

    rows: list[dict[str, float]]
    step_s: list[float]
    store_s: list[float] = field(default_factory=list)


def record_response_lengths() -> dict[int, list[int]]:
    """Each training step's response lengths (tokens up to and including EOS), as the score
    task sees them: ``tasks.score.stage.compute_scores`` is wrapped in this process (the flow's
    tasks run here; validation holds its own reference and is not recorded)."""
    import tasks.score.stage as score_stage

    lengths: dict[int, list[int]] = {}
    compute = score_stage.compute_scores

    def recorded(ctx: Any, meta: Any, scoring: Any) -> Any:
        scores = compute(ctx, meta, scoring)
        step = int(meta.partition_id.rsplit("-", 1)[1])  # train/step-000003
        lengths[step] = [int(n) for n in scores.response_lengths.tolist()]
        return scores

    score_stage.compute_scores = recorded
    return lengths


def run_flow(cfg: Any, baton: Baton) -> Run:
    """The real ``ppo_train``; a step runs from taking the turn to its metrics row being logged."""
    import flows.report
    from flows.train import ppo_train

    begins, ends = [], []
    start, log = flows.report.RunReport.start, flows.report.RunReport.log

    def take_turn() -> None:
        baton.wait()
        begins.append(time.perf_counter())

    def hooked_start(self: Any, step: int) -> None:
        start(self, step)
        take_turn()

    def hooked_log(self: Any, step: int, metrics: dict[str, float]) -> None:
        log(self, step, metrics)
        ends.append(time.perf_counter())
        baton.pass_on()
        if step < cfg.trainer.total_steps - 1:
            take_turn()

    flows.report.RunReport.start = hooked_start  # type: ignore[method-assign]
    flows.report.RunReport.log = hooked_log  # type: ignore[method-assign]
    summary = ppo_train(cfg)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return Run([json.loads(line) for line in lines], [e - b for b, e in zip(begins, ends)])


def turns(baton: Baton, steps: int, iteration: Any) -> Iterator[tuple[dict[str, float], float]]:
    """Each step's metrics row and seconds, run in turn."""
    for step in range(steps):
        baton.wait()
        begin = time.perf_counter()
        row = iteration(step)
        seconds = time.perf_counter() - begin
        baton.pass_on()
        yield row, seconds


class TimedStore:
    """Forwards to a store; adds up the seconds spent in its ``kv_*`` calls."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not name.startswith("kv_"):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


class Plain:
    """A stage task called without Prefect: ``with_options`` gives back its plain function."""

    def __init__(self, task: Any) -> None:
        self.fn = task.fn

    def with_options(self, **_: Any) -> Any:
        return self.fn


def run_staged(cfg: Any, baton: Baton) -> Run:
    """``Trainer.iteration`` on Ray workers and the store, each Prefect task's plain ``.fn``."""
    import flows.loop
    import storage
    from flows.loop import Trainer
    from flows.runtime import build_runtime

    for name in ("generate", "score", "logprobs", "advantage", "update"):
        setattr(flows.loop, name, Plain(getattr(flows.loop, name)))

    models = resolved_models(cfg)
    opened: list[TimedStore] = []
    open_store = storage.open_store
    storage.open_store = lambda url: opened.append(TimedStore(open_store(url))) or opened[-1]
    runtime = build_runtime(cfg, models)
    run = Run([], [])
    try:
        from transformers import AutoTokenizer

        from flows.inputs import load_datasets

        tokenizer = AutoTokenizer.from_pretrained(models.tokenizer)
        datasets = load_datasets(cfg, models, tokenizer)
        trainer = Trainer(cfg, runtime, models, cfg.resolved_run_dir, datasets, tokenizer)
        for row, seconds in turns(baton, cfg.trainer.total_steps, trainer.iteration):
            run.rows.append(row)
            run.step_s.append(seconds)
            run.store_s.append(opened[0].seconds)
            opened[0].seconds = 0.0
    finally:
        runtime.shutdown()
    return run


@contextmanager
def timed(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[f"timing_s/{name}"] = time.perf_counter() - start


def direct_iteration(worker: Any, ctx: Any, data: Any, step: int) -> dict[str, float]:
    """One iteration as plain calls of the stages' worker-side steps, in order, on one worker."""
    import torch

    from tasks.advantage.stage import advantage_rows
    from tasks.generate.stage import generate_rows, generation_seed, submit_prompts
    from tasks.logprobs.stage import forward_rows
    from tasks.score.stage import score_rows
    from tasks.update.stage import actor_settings, critic_settings, update_rows

    cfg, n, t = ctx.cfg, ctx.cfg.rollout.n, {}
    start = time.perf_counter()
    # 1. Prompts (the flow's submit), 2. generate, 3. score, 4. logprobs, 5. advantage, 6. update.
    partition = f"direct/step-{step:06d}"
    meta = submit_prompts(
        ctx, partition_id=partition, rows=data.next_batch(cfg.rollout.prompts_per_step)
    )
    with timed(t, "generate"):
        prompts = type(meta)(partition, meta.keys[::n])
        worker.run(generate_rows, prompts, n=n, seed=generation_seed(cfg.seed, step), first_group=0)
    with timed(t, "score"):
        rule = ctx.plan.scoring.rule
        part = worker.run(score_rows, meta, rule=rule, texts=False)
        scores = torch.zeros(len(meta.keys))
        if part.rm is not None:
            scores += cfg.reward.model_weight * torch.tensor(part.rm)
        if part.rule is not None:
            scores += cfg.reward.rule_weight * torch.tensor(part.rule)
        ctx.rt.store.kv_batch_put(list(meta.keys), partition, {"scores": scores})
    with timed(t, "logprobs"):
        needed = ctx.plan.forward_passes  # none: one on-policy step, no reference or critic
        if needed:
            worker.run(forward_rows, meta, names=needed)
    with timed(t, "advantage"):
        worker.run(advantage_rows, meta, plan=ctx.plan, kl_coef=ctx.kl.value)
    with timed(t, "update"):
        worker.run(
            update_rows,
            meta,
            step=step,
            reads=ctx.plan.update_reads,
            actor=actor_settings(cfg, 1),
            critic=critic_settings(cfg, 1) if ctx.plan.critic else None,
        )
    ctx.rt.store.kv_clear(partition)
    t["timing_s/step"] = time.perf_counter() - start
    t["perf/total_num_tokens"] = float(sum(part.response_lengths))
    return t


def run_direct(cfg: Any, baton: Baton) -> Run:
    """One ``ModelWorker`` with the flow's roles and spec, in this process, over ``memory://``."""
    from transformers import AutoTokenizer

    from flows.runtime import _spec, _train_roles
    from infra.data import PromptDataset
    from infra.runtime import Runtime
    from infra.workers import ModelWorker
    from storage import open_store
    from tasks.context import StageContext

    models = resolved_models(cfg)
    store = open_store("memory://bench-direct")
    worker = ModelWorker(_spec(cfg, models, _train_roles(cfg), store.url))

    class NoGroup:  # the worker is called directly, in this process
        size = 1

    group: Any = NoGroup()
    rt = Runtime(store=store, train_group=group, rollout_group=group)
    ctx = StageContext(cfg=cfg, rt=rt, tokenizer=AutoTokenizer.from_pretrained(models.tokenizer))
    data = PromptDataset(Path(models.train_data), seed=cfg.seed)
    steps = turns(baton, cfg.trainer.total_steps, lambda k: direct_iteration(worker, ctx, data, k))
    rows, seconds = zip(*steps)
    return Run(list(rows), list(seconds))


RUNNERS = {
    "flow": run_flow,
    "ray+store": run_staged,
    "direct": run_direct,
    "flow-async": run_flow,
    "flow@all": run_flow,
    "flow-vllm@all": run_flow,
    "flow-async-vllm": run_flow,
}


def child_main(args: argparse.Namespace) -> None:
    """Inside the subprocess: run one ppoflow variant, print its timed steps as one JSON line."""
    started = time.perf_counter()
    total = args.warmup + args.steps + 1  # the last step also evaluates: never timed
    run_dir = Path(args.work) / "runs" / f"{args.mode}-{args.child.replace('+', '-')}"
    extra = (ASYNC_OVERRIDES if "async" in args.child else ()) + (
        VLLM_OVERRIDES if "vllm" in args.child else ()
    )
    cfg = ppoflow_config(
        args.mode, Path(args.work), run_dir, total_steps=total, threads=args.threads, extra=extra
    )
    first, last = args.warmup, args.warmup + args.steps
    baton = Baton(args.baton, args.child, first=first, last=last)
    lengths = record_response_lengths() if args.mode in VARLEN_MODES else {}
    run = RUNNERS[args.child](cfg, baton)
    timed_steps = range(first, last)
    result = {
        "ok": True,
        "step_s": [run.step_s[k] for k in timed_steps],
        "iteration_s": [run.rows[k]["timing_s/step"] for k in timed_steps],
        "stages_s": {
            s: [run.rows[k].get(f"timing_s/{s}", 0.0) for k in timed_steps]
            for s in (*STAGES, *STEP_PARTS)
        },
        "lengths": [lengths[k] for k in timed_steps] if lengths else None,
        "store_s": [run.store_s[k] for k in timed_steps] if run.store_s else None,
        "tokens": [run.rows[k]["perf/total_num_tokens"] for k in timed_steps],
        **baton.cpu_per_step(),
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(result), flush=True)


def run_ppoflow(mode: str, args: argparse.Namespace, work: Path, tag: str) -> dict[str, Any]:
    """The three variants side by side, taking turns step by step."""
    logs = work / f"ppoflow-{mode}-{tag}"
    logs.mkdir()
    script = [sys.executable, str(SCRIPT), "--mode", mode, "--work", str(work)]
    script += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    script += ["--threads", str(args.threads), "--baton", str(logs / "turn")]
    cmds = {v: [*script, "--child", v] for v in VARIANTS}
    return run_children(cmds, env=child_env(work, args.threads), logs=logs, baton=logs / "turn")


def run_solo(
    name: str, mode: str, args: argparse.Namespace, work: Path, tag: str, threads: int
) -> dict[str, Any]:
    """One ppoflow flow alone on the machine (no turn-taking): ``flow-async`` or ``flow@all``
    (and their vLLM runs)."""
    logs = work / f"ppoflow-{mode}-{tag}-{name.replace('@', '-')}"
    logs.mkdir()
    cmd = [sys.executable, str(SCRIPT), "--mode", mode, "--work", str(work)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(threads)]
    cmd += ["--child", name]
    return run_children({name: cmd}, env=child_env(work, threads), logs=logs)[name]
