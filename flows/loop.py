"""The iteration loop of the training flow: submit prompts → generate → score → logprobs →
advantage → update, one Prefect task per stage per step, with checkpoints and reporting.

How the three modes differ here:
- ``sync``: each step submits its prompts and generates them with the current policy.
- ``colocate_async``: when a step finds no responses, the rollout wakes once and generates this
  step and the next ``max_staleness`` steps (prompts submitted ahead), saving wake/sleep cycles;
  a batch generated ``j`` steps ahead is ``j`` policy versions stale (≤ max_staleness).
- ``separate_async``: a producer thread (flows.producer) runs the generate and score tasks of
  the coming steps, up to ``max_staleness`` steps ahead of the trainer, on the rollout and reward
  pools; the training loop waits for its step's scored rows and runs logprobs → advantage →
  update on the training pool meanwhile.

Resuming and checkpoints are flows.checkpoint's, evaluation flows.evaluation's; ``Trainer.run``
returns a ``RunResult``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.checkpoint import checkpoint_run, latest_checkpoint, restore
from flows.evaluation import Evaluator
from flows.inputs import Datasets, heldout_rows
from flows.producer import RolloutProducer
from flows.report import RunReport
from flows.reward_model import ResolvedModels
from flows.runtime import Runtime
from infra.config import TrainConfig
from infra.faults import FaultPlan
from infra.group import WorkerDied
from infra.workers import ModelWorker
from storage import BatchMeta, ShardLost
from tasks.advantage.stage import advantage
from tasks.context import StageContext
from tasks.generate.stage import generate, submit_prompts
from tasks.kl import AdaptiveKLController, FixedKLController
from tasks.logprobs.stage import logprobs
from tasks.logprobs.stage import writes as logprob_writes
from tasks.score.stage import NonFiniteScoreError, score
from tasks.update.stage import update
from tasks.validate.stage import validate

STAGES = {
    "generate": generate,
    "score": score,
    "logprobs": logprobs,
    "advantage": advantage,
    "update": update,
    "validate": validate,
}


def retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a failed stage unless its error would repeat: a reward function that raised or
    returned a bad value, a non-finite reward-model score; a dead worker or a lost store shard
    is for the loop's restart (timeouts retry)."""
    from infra.reward_functions import RewardFunctionError

    try:
        state.result(raise_on_failure=True)
    except RewardFunctionError as exc:
        return exc.kind in ("timeout", "died")
    except (NonFiniteScoreError, WorkerDied, ShardLost):  # the loop restarts for these
        return False
    except BaseException:  # noqa: BLE001 - anything else may be transient
        return True
    return True


def partition_id(step: int) -> str:
    return f"train/step-{step:06d}"


class StalenessError(RuntimeError):
    """A batch is older than ``resources.max_staleness`` policy versions."""


@dataclass(frozen=True)
class RunResult:
    """What one flow run did: the steps it ran, its report and its last checkpoint."""

    report: RunReport
    first_step: int
    last_step: int
    checkpoint: Path | None


class Trainer:
    """Runs the iterations of one flow run; see the module docstring."""

    def __init__(
        self,
        cfg: TrainConfig,
        rt: Runtime,
        models: ResolvedModels,
        run_dir: Path,
        datasets: Datasets,
        tokenizer: Any,
    ) -> None:
        self.cfg, self.rt, self.models, self.run_dir = cfg, rt, models, run_dir
        kl = cfg.algorithm.kl
        controller = (
            AdaptiveKLController(init_coef=kl.coef, target=kl.target, horizon=kl.horizon)
            if kl.adaptive
            else FixedKLController(coef=kl.coef)
        )
        self.ctx = StageContext(
            cfg=cfg,
            store=rt.store,
            tokenizer=tokenizer,
            train_group=rt.train_group,
            reward_group=rt.reward_group,
            rollout_group=rt.rollout_group,
            kl_controller=controller,
            reward_pool=rt.reward_pool,
            faults=FaultPlan(cfg.faults, run_dir),
        )
        self.data = datasets.train
        self.notes = datasets.notes
        self.stages = {
            name: fn.with_options(
                retries=cfg.orchestration.retries,
                retry_delay_seconds=cfg.orchestration.retry_delay_seconds,
                timeout_seconds=cfg.orchestration.timeout_seconds,
                retry_condition_fn=retryable,
            )
            for name, fn in STAGES.items()
        }
        heldout = heldout_rows(cfg, models, tokenizer) if cfg.data.builtin else []
        self.evaluate = Evaluator(
            self.ctx,
            lambda *args: self.stages["validate"](*args),
            val_rows=datasets.val,
            heldout=heldout,
        )
        self.submitted: dict[int, BatchMeta] = {}
        self.submit_lock = threading.Condition()
        self.version = 0
        self.last_checkpoint: Path | None = None
        self.producer: RolloutProducer | None = None
        self.restarts = 0
        self.initial: dict[str, Any] = {}

    # ------------------------------------------------------------------ resume / checkpoint
    def resume(self) -> int:
        """Load the latest checkpoint when ``trainer.resume == 'auto'``; returns the first step to run."""
        path = latest_checkpoint(self.run_dir) if self.cfg.trainer.resume == "auto" else None
        return 0 if path is None else self._load(path)

    def _load(self, path: Path) -> int:
        """Restore the checkpoint at ``path``; returns the step after it."""
        restored = restore(path, rt=self.rt, ctx=self.ctx, data=self.data)
        self.version, self.submitted = restored.version, restored.submitted
        self.last_checkpoint = path
        return restored.step + 1

    def checkpoint(self, step: int) -> None:
        fault = self.ctx.faults.take("checkpoint", step, 1)
        if fault is not None and fault.action == "raise":
            self.ctx.faults.fire_here(fault, f"checkpoint at step {step}")
        if fault is not None and fault.action == "kill_worker":
            import ray

            ray.kill(self.rt.train_group.workers[0], no_restart=True)
        with self.submit_lock:
            pending = {s: m for s, m in self.submitted.items() if s > step}
            self.last_checkpoint = checkpoint_run(
                self.run_dir,
                step,
                rt=self.rt,
                ctx=self.ctx,
                data=self.data,
                pending=pending,
                keep=self.cfg.trainer.keep_checkpoints,
                midway=(lambda: self.ctx.faults.fire_here(fault, "checkpoint"))
                if fault is not None and fault.action == "exit_flow"
                else None,
            )

    # ------------------------------------------------------------------ prompts and rollout
    def submit(self, step: int) -> BatchMeta:
        """Draw the step's prompts from the data cursor and put them in its partition (once)."""
        with self.submit_lock:
            if step not in self.submitted:
                rows = self.data.next_batch(self.cfg.rollout.prompts_per_step)
                self.submitted[step] = submit_prompts(
                    self.ctx, partition_id=partition_id(step), rows=rows
                )
                self.submit_lock.notify_all()
            return self.submitted[step]

    def metas_for(self, step: int) -> list[BatchMeta]:
        """The partitions the generate task should fill at ``step`` (sync, colocate_async)."""
        mode = self.cfg.resources.mode
        ahead = self.cfg.resources.max_staleness if mode == "colocate_async" else 0
        last = min(step + ahead, self.cfg.trainer.total_steps - 1)
        if step in self.submitted:
            return [self.submitted[step]]
        return [self.submit(s) for s in range(step, last + 1)]

    # ------------------------------------------------------------------ one iteration
    def iteration(self, step: int) -> dict[str, float]:
        timing: dict[str, float] = {}
        t_step = time.perf_counter()

        def run(name: str, *args: Any) -> Any:
            t0 = time.perf_counter()
            out = self.stages[name](self.ctx, *args, step)
            timing[f"timing_s/{name}"] = time.perf_counter() - t0
            return out

        # 1.-2. generate (possibly several partitions ahead) and score; separate_async: the
        # producer thread (flows.producer) has run both: wait for its scored rows.
        if self.producer is not None:
            t0 = time.perf_counter()
            meta = self.producer.wait(step)
            timing["timing_s/wait_rollout"] = time.perf_counter() - t0
            self._check_staleness(meta, step)
        else:
            meta = run("generate", self.metas_for(step))[0]
            self._check_staleness(meta, step)
            meta = run("score", meta)
        # 3.-5. logprobs/values → advantage → update.
        if logprob_writes(self.ctx):  # nothing to compute: one on-policy step, no ref or critic
            meta = run("logprobs", meta)
        meta = run("advantage", meta)
        run("update", meta)
        # The step is applied: the adaptive KL controller moves once, on this step's KL.
        if self.cfg.algorithm.kl.in_reward:
            kl_mean = self.ctx.metrics[step]["actor/reward_kl_penalty"]
            self.ctx.kl_controller.update(kl_mean, self.cfg.batch_size)
        with self.submit_lock:
            self.version += 1
            self.submit_lock.notify_all()
        # 6. Wake/sleep seconds of the colocated roles (first training worker), then drop the partition.
        self.ctx.record(step, self.rt.train_group.call(ModelWorker.timing)[0])
        # Drop the finished partition.
        self.rt.store.kv_clear(meta.partition_id)
        self.submitted.pop(step, None)
        timing["timing_s/step"] = time.perf_counter() - t_step
        tokens = self.ctx.metrics[step].get("perf/total_num_tokens")  # logged by the score task
        if tokens is not None:
            timing["perf/total_num_tokens"] = tokens
            timing["perf/throughput"] = tokens / timing["timing_s/step"]
        return timing

    def _check_staleness(self, meta: BatchMeta, step: int) -> None:
        td = self.rt.store.kv_batch_get(
            list(meta.keys), meta.partition_id, ["rollout_version"], timeout=0
        )
        staleness = int(self.version - int(td["rollout_version"].min()))
        self.ctx.record(step, {"rollout/staleness": float(staleness)})
        if staleness > self.cfg.resources.max_staleness and self.cfg.resources.mode != "sync":
            raise StalenessError(
                f"step {step}: batch generated by policy version {int(td['rollout_version'].min())}, "
                f"trainer at {self.version}: staleness {staleness} > resources.max_staleness="
                f"{self.cfg.resources.max_staleness}"
            )

    # ------------------------------------------------------------------ restarts
    def restart(self, exc: WorkerDied | ShardLost, step: int, report: RunReport) -> int:
        """Replace the dead worker's group (for a lost store shard: make the shard anew and
        replace every group, whose store connections reach the dead one) and continue from this
        run's latest checkpoint (the one it resumed from or wrote; the run's start without one);
        returns the step to run next."""
        self.stop_producer()
        if isinstance(exc, WorkerDied):
            exc.group.restart()
        else:
            self.rt.store.recover()
            for group in self.rt.groups():
                group.restart()
        self.restarts += 1
        for s in list(self.submitted):  # rows of steps not checkpointed are made again
            self.rt.store.kv_clear(partition_id(s))
        self.submitted = {}
        if self.last_checkpoint is not None:
            nxt = self._load(self.last_checkpoint)
        else:
            self.data.load_state_dict(self.initial["data"])
            self.ctx.kl_controller.load_state_dict(self.initial["kl"])
            self.version, nxt = 0, 0
        for s in [s for s in self.ctx.metrics if s >= nxt]:
            self.ctx.metrics.pop(s)
        report.restarted(nxt, {"failed_step": step, "restarts": self.restarts, "error": str(exc)})
        self.ctx.record(nxt, {"trainer/restarts": float(self.restarts)})
        self.start_producer(nxt)
        return nxt

    def start_producer(self, first: int) -> None:
        if self.cfg.resources.mode == "separate_async":
            self.producer = RolloutProducer(
                stages=self.stages,
                ctx=self.ctx,
                submit=self.submit,
                version=lambda: self.version,
                lock=self.submit_lock,
            )
            self.producer.start(first)

    def stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.stop(timeout=self.cfg.orchestration.call_timeout_s)
            self.producer = None

    # ------------------------------------------------------------------ the run
    def run(self, report_factory: Any = RunReport) -> RunResult:
        cfg = self.cfg
        self.initial = {"data": self.data.state_dict(), "kl": self.ctx.kl_controller.state_dict()}
        first = self.resume()
        report: RunReport = report_factory(
            self.run_dir,
            cfg.name,
            cfg.trainer.total_steps,
            start_step=first,
            progress_bar=cfg.trainer.progress_bar,
            artifact_interval_s=cfg.trainer.artifact_interval_s,
            loggers=cfg.trainer.loggers,
            alerts=cfg.trainer.alerts,
            config=cfg.model_dump(mode="json"),
        )
        report.start(first)
        self.start_producer(first)
        t0 = time.perf_counter()
        per_run = cfg.trainer.steps_per_run
        end = (
            cfg.trainer.total_steps
            if per_run is None
            else min(cfg.trainer.total_steps, first + per_run)
        )
        step = last = first
        try:
            while step < end:
                try:
                    out_of_time = self.one_step(step, first=first, end=end, report=report, t0=t0)
                except (WorkerDied, ShardLost) as exc:
                    if self.restarts >= cfg.trainer.max_restarts:
                        message = (
                            f"{exc} at step {step}; no restart left "
                            f"(trainer.max_restarts={cfg.trainer.max_restarts})"
                        )
                        if isinstance(exc, WorkerDied):
                            raise WorkerDied(message, exc.group) from exc
                        raise RuntimeError(message) from exc
                    step = self.restart(exc, step, report)
                    continue
                last = step
                if out_of_time:
                    break
                step += 1
        finally:
            report.close()
            self.stop_producer()
        return RunResult(
            report=report, first_step=first, last_step=last, checkpoint=self.last_checkpoint
        )

    def one_step(self, step: int, *, first: int, end: int, report: RunReport, t0: float) -> bool:
        """Evaluate if due, iterate, log, checkpoint if due; True when out of time."""
        cfg = self.cfg
        # Evaluation before the step's update every eval_every steps, and after the last.
        metrics = {**(self.evaluate(step) if self.evaluate.due(step) else {})}
        metrics.update(self.iteration(step))
        if step == first:
            metrics.update(self.notes)
        if step == end - 1 and self.evaluate.enabled:
            metrics.update(self.evaluate(step + 1))
        report.log(step, {**self.ctx.metrics.pop(step, {}), **metrics})
        out_of_time = (
            cfg.trainer.max_seconds is not None
            and time.perf_counter() - t0 > cfg.trainer.max_seconds
        )
        if (step + 1) % cfg.trainer.checkpoint_every == 0 or step == end - 1 or out_of_time:
            self.checkpoint(step)
        return out_of_time
