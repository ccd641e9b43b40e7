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

Each stage is the imported task itself, called with the run's retry options
(``flows.retry.retry_options``) and timed by ``Timings``. Resuming and checkpoints are
flows.checkpoint's, evaluation flows.evaluation's; ``Trainer.run`` returns a ``RunResult``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows import stopping
from flows.checkpoint import checkpoint_run, latest_checkpoint, restore
from flows.evaluation import Evaluator
from flows.inputs import Datasets, heldout_rows
from flows.producer import RolloutProducer
from flows.report import RunReport
from flows.retry import retry_options
from flows.reward_model import ResolvedModels
from flows.samples import save_step_samples
from flows.sampling import Sampler
from flows.stages import advantage, logprobs, update, validate
from infra.config import TrainConfig
from infra.faults import FaultPlan, strike
from infra.group import WorkerDied
from infra.progress import Progress
from infra.runtime import Runtime
from infra.workers import ModelWorker
from storage import BatchMeta, ShardLost
from storage.ray_backend import RayStore
from tasks.context import Metrics, StageContext, StageResult, Timings
from tasks.generate.stage import submit_prompts
from tasks.validate.stage import Validation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.cfg, self.rt, self.models, self.run_dir = cfg, rt, models, run_dir
        self.ctx = StageContext(
            cfg=cfg, rt=rt, tokenizer=tokenizer, faults=FaultPlan(cfg.faults, run_dir)
        )
        self.retry = retry_options(cfg)
        self.data = datasets.train
        self.notes = datasets.notes
        heldout = heldout_rows(cfg, models, tokenizer) if cfg.data.builtin else []
        self.evaluate = Evaluator(self.ctx, self._validate, val_rows=datasets.val, heldout=heldout)
        self.submitted: dict[int, BatchMeta] = {}
        self.drawn_from: dict[int, dict[str, Any]] = {}  # the cursor before a step's first draw
        self.submit_lock = threading.Condition()
        self.sampler = Sampler(self.ctx, self.retry, self.draw)
        self.version = 0  # policy updates applied
        self.steps_done = 0  # steps finished (a step that kept no group updates nothing)
        self.last_checkpoint: Path | None = None
        self.producer: RolloutProducer | None = None
        self.restarts = 0
        self.initial: dict[str, Any] = {}
        self.carried: dict[int, Metrics] = {}  # metrics for a step not run yet (restarts)
        self.ready: dict[int, StageResult] = {}  # produced steps a checkpoint restored

    def _validate(
        self, ctx: StageContext, job: Validation, step: int, progress: Progress
    ) -> Metrics:
        return validate.with_options(**self.retry)(ctx, job, step, progress)

    # ------------------------------------------------------------------ resume / checkpoint
    def resume(self) -> int:
        """Load the latest checkpoint when ``trainer.resume == 'auto'``; returns the first step to run."""
        path = latest_checkpoint(self.run_dir) if self.cfg.trainer.resume == "auto" else None
        return 0 if path is None else self._load(path)

    def _load(self, path: Path) -> int:
        """Restore the checkpoint at ``path``; returns the step after it."""
        restored = restore(path, ctx=self.ctx, data=self.data)
        self.version, self.submitted = restored.version, dict(restored.state.submitted)
        self.steps_done = restored.state.step + 1
        self.ready = dict(restored.state.produced)
        self.last_checkpoint = path
        return restored.state.step + 1

    def checkpoint(self, step: int) -> None:
        """Save the run after ``step``; a ``faults`` entry for the checkpoint strikes when
        everything is written but not yet renamed into place."""
        fault = self.ctx.faults.take("checkpoint", step, 1)

        def midway() -> None:
            if fault is not None:
                where = f"checkpoint at step {step}"
                strike(fault, where, store=self.rt.store, group=self.rt.train_group)

        with self.submit_lock:
            pending, ready, data_state = self._pending(step)
            self.last_checkpoint = checkpoint_run(
                self.run_dir,
                step,
                ctx=self.ctx,
                data=self.data,
                data_state=data_state,
                pending=pending,
                produced=ready,
                keep=self.cfg.trainer.keep_checkpoints,
                midway=midway,
            )

    def _pending(
        self, step: int
    ) -> tuple[dict[int, BatchMeta], dict[int, StageResult], dict[str, Any] | None]:
        """What a checkpoint after ``step`` keeps of the later steps: their submitted partitions,
        the producer's finished steps (dynamic sampling in separate_async), and the data cursor
        to save (None: the cursor as it is). A step whose filter rounds are under way in the
        producer cannot be saved half done: the checkpoint stops before it and keeps the cursor
        from before its first draw, so a resumed run draws its prompts again."""
        pending = {s: m for s, m in sorted(self.submitted.items()) if s > step}
        if self.producer is None or not self.cfg.algorithm.filter_groups.enabled:
            return pending, {}, None
        done = self.producer.finished()
        kept: dict[int, BatchMeta] = {}
        for s in pending:
            if s not in done:
                return kept, {t: done[t] for t in kept}, self.drawn_from[s]
            kept[s] = done[s].meta
        return kept, {t: done[t] for t in kept}, None

    # ------------------------------------------------------------------ prompts and rollout
    def submit(self, step: int) -> BatchMeta:
        """Draw the step's prompts from the data cursor and put them in its partition (once)."""
        with self.submit_lock:
            if step not in self.submitted:
                self.drawn_from[step] = self.data.state_dict()
                rows = self.data.next_batch(self.cfg.rollout.prompts_per_step)
                self.submitted[step] = submit_prompts(
                    self.ctx, partition_id=partition_id(step), rows=rows
                )
                self.submit_lock.notify_all()
            return self.submitted[step]

    def draw(self, step: int, round: int, prompts: int) -> BatchMeta:
        """Dynamic sampling's refill: the next ``prompts`` rows of the data cursor, put in the
        step's partition (a prompt already there, after the cursor wrapped into a new epoch,
        gets the round in its id); returns the new rows' handle."""
        with self.submit_lock:
            rows = self.data.next_batch(prompts)
            taken = {k.rsplit("/", 1)[0] for k in self.rt.store.kv_list(partition_id(step))}
            rows = [r if r.uid not in taken else replace(r, uid=f"{r.uid}~{round}") for r in rows]
            return submit_prompts(self.ctx, partition_id=partition_id(step), rows=rows)

    def metas_for(self, step: int) -> list[BatchMeta]:
        """The partitions the generate task should fill at ``step`` (sync, colocate_async)."""
        mode = self.cfg.resources.mode
        ahead = self.cfg.resources.max_staleness if mode == "colocate_async" else 0
        last = min(step + ahead, self.cfg.trainer.total_steps - 1)
        if step in self.submitted:
            return [self.submitted[step]]
        return [self.submit(s) for s in range(step, last + 1)]

    # ------------------------------------------------------------------ one iteration
    def iteration(self, step: int) -> Metrics:
        """One step's stages; returns their metrics and timings."""
        timed = Timings()
        metrics: Metrics = {}
        t_step = time.perf_counter()
        # 1.-2. generate (possibly several partitions ahead) and score; separate_async: the
        # producer thread (flows.producer) has run both: wait for its scored rows.
        # With dynamic sampling, filter and refill rounds (flows.sampling).
        if self.producer is not None:
            with timed("wait_rollout"):
                produced = self.producer.wait(step)
        else:
            produced = self.sampler(self.metas_for(step), step, timed)
        meta = produced.meta
        metrics.update(produced.metrics)
        if meta.keys:
            metrics.update(self._check_staleness(meta, step))
            metrics.update(self._train(meta, step, timed))
        else:  # dynamic sampling kept no group: nothing to learn from this step
            metrics["filter/skipped_update"] = 1.0
        with self.submit_lock:
            self.steps_done += 1
            self.submit_lock.notify_all()
        # 6. Wake/sleep seconds of the colocated roles (first training worker), then drop the partition.
        metrics.update(self.rt.train_group.call(ModelWorker.timing)[0])
        save_step_samples(self.ctx, meta, step, self.run_dir)  # samples/step_<N>.jsonl
        self.rt.store.kv_clear(meta.partition_id)
        self.submitted.pop(step, None)
        self.drawn_from.pop(step, None)
        metrics.update(timed.seconds)
        metrics["timing_s/step"] = time.perf_counter() - t_step
        tokens = metrics.get("perf/total_num_tokens")  # the score task's
        if tokens is not None:
            metrics["perf/throughput"] = tokens / metrics["timing_s/step"]
        return metrics

    def _train(self, meta: BatchMeta, step: int, timed: Timings) -> Metrics:
        """3.-5. logprobs/values (nothing to compute: one on-policy step, no ref or critic) →
        advantage → update; the KL controller and the policy version move once the update is
        applied."""
        ctx, retry = self.ctx, self.retry
        metrics: Metrics = {}
        if ctx.plan.forward_passes:
            with timed("logprobs"):
                meta = logprobs.with_options(**retry)(ctx, meta, step)
        with timed("advantage"):
            advantaged = advantage.with_options(**retry)(ctx, meta, step)
        with timed("update"):
            updated = update.with_options(**retry)(ctx, advantaged.meta, step)
        metrics.update(advantaged.metrics)
        metrics.update(updated.metrics)
        # The step is applied: the adaptive KL controller moves once, on this step's KL.
        if advantaged.reward_kl is not None:
            ctx.kl.update(advantaged.reward_kl, self.cfg.batch_size)
        with self.submit_lock:
            self.version += 1
        return metrics

    def _check_staleness(self, meta: BatchMeta, step: int) -> Metrics:
        td = self.rt.store.kv_batch_get(
            list(meta.keys), meta.partition_id, ["rollout_version"], timeout=0
        )
        made_by = int(td["rollout_version"].min())
        staleness = self.version - made_by
        if staleness > self.cfg.resources.max_staleness and self.cfg.resources.mode != "sync":
            raise StalenessError(
                f"step {step}: batch generated by policy version {made_by}, trainer at "
                f"{self.version}: staleness {staleness} > resources.max_staleness="
                f"{self.cfg.resources.max_staleness}"
            )
        return {"rollout/staleness": float(staleness)}

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
            if isinstance(self.rt.store, RayStore):
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
            self.ctx.kl.load_state_dict(self.initial["kl"])
            self.version = self.steps_done = nxt = 0
            self.ready = {}
        report.restarted(nxt, {"failed_step": step, "restarts": self.restarts, "error": str(exc)})
        self.carried[nxt] = {"trainer/restarts": float(self.restarts)}
        self.start_producer(nxt)
        return nxt

    def start_producer(self, first: int) -> None:
        if self.cfg.resources.mode == "separate_async":
            self.producer = RolloutProducer(
                sampler=self.sampler,
                submit=self.submit,
                progress=lambda: self.steps_done,
                ready=self.ready,
                lock=self.submit_lock,
            )
            self.producer.start(first)

    def stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.stop(timeout=self.cfg.orchestration.call_timeout_s)
            self.producer = None

    # ------------------------------------------------------------------ the run
    def run(self, report_factory: Callable[..., RunReport] = RunReport) -> RunResult:
        cfg = self.cfg
        self.initial = {"data": self.data.state_dict(), "kl": self.ctx.kl.state_dict()}
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
        last = first
        try:
            with stopping.safe_points():
                last = self._steps(first, end, report, t0)
        finally:
            report.close()
            self.stop_producer()
        return RunResult(
            report=report, first_step=first, last_step=last, checkpoint=self.last_checkpoint
        )

    def _steps(self, first: int, end: int, report: RunReport, t0: float) -> int:
        """Run steps ``first``..``end - 1`` (a restart goes back to its checkpoint); returns the
        last step run."""
        cfg = self.cfg
        step = last = first
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
        return last

    def one_step(self, step: int, *, first: int, end: int, report: RunReport, t0: float) -> bool:
        """Evaluate if due, iterate, log, checkpoint if due; True when out of time."""
        cfg = self.cfg
        # Evaluation before the step's update every eval_every steps, and after the last.
        metrics = self.carried.pop(step, {})
        if self.evaluate.due(step):
            metrics.update(self.evaluate(step))
        metrics.update(self.iteration(step))
        if step == first:
            metrics.update(self.notes)
        if step == end - 1 and self.evaluate.enabled:
            metrics.update(self.evaluate(step + 1))
        report.log(step, metrics)
        out_of_time = (
            cfg.trainer.max_seconds is not None
            and time.perf_counter() - t0 > cfg.trainer.max_seconds
        )
        stop = stopping.requested() is not None
        due = (step + 1) % cfg.trainer.checkpoint_every == 0 or step == end - 1
        if due or out_of_time or stop:
            self.checkpoint(step)
        stopping.stop_now(step=step, checkpoint=self.last_checkpoint)
        return out_of_time
