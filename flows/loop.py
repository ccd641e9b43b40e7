"""The iteration loop of the training flow: submit prompts → generate → score → logprobs →
advantage → update, one Prefect task per stage per step, with checkpoints and reporting.

How the three modes differ here:
- ``sync``: each step submits its prompts and generates them with the current policy.
- ``colocate_async``: when a step finds no responses, the rollout wakes once and generates this
  step and the next ``max_staleness`` steps (prompts submitted ahead), saving wake/sleep cycles;
  a batch generated ``j`` steps ahead is ``j`` policy versions stale (≤ max_staleness).
- ``separate_async``: a producer thread runs the generate and score tasks of the coming steps,
  up to ``max_staleness`` steps ahead of the trainer, on the rollout and reward pools; the
  training loop waits for its step's scored rows and runs logprobs → advantage → update on the
  training pool meanwhile. Both threads' tasks belong to the flow run (the producer runs in a
  copy of the flow's context), so the UI shows generate/score of step k+1 beside update of k.
"""

from __future__ import annotations

import contextvars
import threading
import time
from pathlib import Path
from typing import Any

import torch

from flows.checkpoint import latest_checkpoint, read_state, save_checkpoint
from flows.inputs import Datasets, heldout_rows
from flows.report import RunReport
from flows.reward_model import ResolvedModels
from flows.runtime import Runtime
from infra.config import TrainConfig
from infra.transport import Jagged
from infra.workers import PPOWorker
from storage import BatchMeta
from tasks.advantage.stage import advantage
from tasks.context import StageContext
from tasks.generate.stage import generate, row_prompt_ids, submit_prompts
from tasks.kl import AdaptiveKLController, FixedKLController
from tasks.logprobs.stage import logprobs
from tasks.logprobs.stage import writes as logprob_writes
from tasks.score.stage import NonFiniteScoreError, rule_scores, score
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
    returned a bad value, a non-finite reward-model score (timeouts and lost workers retry)."""
    from infra.reward_functions import RewardFunctionError

    try:
        state.result(raise_on_failure=True)
    except RewardFunctionError as exc:
        return exc.kind in ("timeout", "died")
    except NonFiniteScoreError:
        return False
    except BaseException:  # noqa: BLE001 - anything else may be transient
        return True
    return True


def partition_id(step: int) -> str:
    return f"train/step-{step:06d}"


class StalenessError(RuntimeError):
    """A batch is older than ``resources.max_staleness`` policy versions."""


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
        )
        self.data = datasets.train
        self.val_rows = datasets.val  # user validation prompts (None: none)
        self.notes = datasets.notes
        self.heldout = heldout_rows(cfg, models, tokenizer) if cfg.data.builtin else []
        self.stages = {
            name: fn.with_options(
                retries=cfg.orchestration.retries,
                retry_delay_seconds=cfg.orchestration.retry_delay_seconds,
                timeout_seconds=cfg.orchestration.timeout_seconds,
                retry_condition_fn=retryable,
            )
            for name, fn in STAGES.items()
        }
        self.submitted: dict[int, BatchMeta] = {}
        self.produced: dict[int, BatchMeta] = {}  # separate_async: generated and scored
        self.submit_lock = threading.Condition()
        self.version = 0
        self.start_step = 0
        self.last_checkpoint: Path | None = None
        self.producer_error: BaseException | None = (
            None  # set by the separate_async producer thread
        )

    # ------------------------------------------------------------------ resume / checkpoint
    def resume(self) -> int:
        """Load the latest checkpoint when ``trainer.resume == 'auto'``; returns the first step to run."""
        ckpt = latest_checkpoint(self.run_dir) if self.cfg.trainer.resume == "auto" else None
        if ckpt is None:
            return 0
        state = read_state(ckpt)
        self.version = min(
            self.rt.train_group.call(PPOWorker.load_checkpoint, str(ckpt / "workers"))
        )
        if self.rt.rollout_group is not self.rt.train_group:
            from tasks.update.stage import sync_rollout_weights

            sync_rollout_weights(self.ctx)
        self.data.load_state_dict(state["data"])
        self.ctx.kl_controller.load_state_dict(state["kl"])
        if state["partitions"]:
            self.rt.store.load(ckpt / "store")
        self.submitted = {int(s): BatchMeta.from_json(m) for s, m in state["submitted"].items()}
        self.last_checkpoint = ckpt
        return int(state["step"]) + 1

    def checkpoint(self, step: int) -> None:
        with self.submit_lock:
            pending = {s: m for s, m in self.submitted.items() if s > step}
            state = {
                "data": self.data.state_dict(),
                "kl": self.ctx.kl_controller.state_dict(),
                "submitted": {str(s): m.to_json() for s, m in pending.items()},
            }
            self.last_checkpoint = save_checkpoint(
                self.run_dir,
                step,
                state=state,
                save_workers=lambda path: self.rt.train_group.call(PPOWorker.save_checkpoint, path),
                store=self.rt.store,
                partitions=[m.partition_id for m in pending.values()],
                keep=self.cfg.trainer.keep_checkpoints,
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

    def wait_produced(self, step: int) -> BatchMeta:
        """separate_async: the step's generated and scored partition, once the producer has it.
        A producer failure is raised at once; no rows within ``store.get_timeout_s`` is a
        TimeoutError naming the step."""
        deadline = time.monotonic() + self.ctx.get_timeout
        with self.submit_lock:
            while step not in self.produced:
                if self.producer_error is not None:
                    raise RuntimeError(
                        f"no rollout for step {step}: the producer failed: {self.producer_error!r}"
                    ) from self.producer_error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no rollout for step {step} within store.get_timeout_s="
                        f"{self.ctx.get_timeout:.0f} s"
                    )
                self.submit_lock.wait(left)
            return self.produced.pop(step)

    def _produce(self, first: int, stop: threading.Event) -> None:
        """separate_async: run the generate and score tasks up to max_staleness steps ahead."""
        step = first
        try:
            while not stop.is_set() and step < self.cfg.trainer.total_steps:
                with self.submit_lock:
                    while (
                        self.version < step - self.cfg.resources.max_staleness - self.start_step
                        and not stop.is_set()
                    ):
                        self.submit_lock.wait(0.5)
                if stop.is_set():
                    return
                meta = self.submit(step)
                t0 = time.perf_counter()
                meta = self.stages["generate"](self.ctx, [meta], step)[0]
                t1 = time.perf_counter()
                meta = self.stages["score"](self.ctx, meta, step)
                seconds = {"timing_s/generate": t1 - t0, "timing_s/score": time.perf_counter() - t1}
                self.ctx.record(step, seconds)
                with self.submit_lock:
                    self.produced[step] = meta
                    self.submit_lock.notify_all()
                step += 1
        except BaseException as exc:  # raised in the training loop by wait_produced
            self.producer_error = exc
            with self.submit_lock:
                self.submit_lock.notify_all()

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
        # producer thread has run both (see _produce), wait for its scored rows.
        if self.cfg.resources.mode == "separate_async":
            t0 = time.perf_counter()
            meta = self.wait_produced(step)
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
        self.ctx.record(step, self.rt.train_group.call(PPOWorker.timing)[0])
        # Drop the finished partition.
        lengths = self._response_lengths(meta)
        self.rt.store.kv_clear(meta.partition_id)
        self.submitted.pop(step, None)
        timing["timing_s/step"] = time.perf_counter() - t_step
        tokens = int(lengths.sum())
        return {
            **timing,
            "response_length/mean": float(lengths.float().mean()),
            "response_length/max": float(lengths.max()),
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens / timing["timing_s/step"],
        }

    def _response_lengths(self, meta: BatchMeta) -> torch.Tensor:
        td = self.rt.store.kv_batch_get(
            list(meta.keys), meta.partition_id, ["response_ids"], timeout=0
        )
        return td["response_ids"].offsets().diff()

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

    # ------------------------------------------------------------------ evaluation
    @property
    def evaluates(self) -> bool:
        """The built-in task's rule accuracy, or validation on ``data.val_files``."""
        return bool(self.heldout) or bool(self.val_rows)

    def evaluate(self, step: int) -> dict[str, float]:
        """The built-in task's greedy rule accuracy on held-out prompts (the honest metric beside
        the reward model's score), or the ``validate`` task on the user's validation prompts."""
        if self.val_rows:
            return dict(self.stages["validate"](self.ctx, self.val_rows, step))
        prompts = Jagged.from_rows([row_prompt_ids(self.ctx.tokenizer, r) for r in self.heldout])
        responses, _, _ = self.rt.rollout_group.call(
            PPOWorker.generate, prompts, n=1, seed=0, temperature=0.0
        )[0]
        accuracy = rule_scores(self.ctx, responses, [r.ground_truth for r in self.heldout])
        return {"eval/rule_accuracy": float(accuracy.mean())}

    # ------------------------------------------------------------------ the run
    def run(self, report_factory: Any = RunReport) -> dict[str, Any]:
        cfg = self.cfg
        self.start_step = first = self.resume()
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
        stop = threading.Event()
        producer = None
        if cfg.resources.mode == "separate_async":
            producer = threading.Thread(  # in the flow run's context: its tasks belong to it
                target=contextvars.copy_context().run,
                args=(self._produce, first, stop),
                daemon=True,
                name="rollout-producer",
            )
            producer.start()
        t0 = time.perf_counter()
        step = first
        per_run = cfg.trainer.steps_per_run
        end = (
            cfg.trainer.total_steps
            if per_run is None
            else min(cfg.trainer.total_steps, first + per_run)
        )
        try:
            for step in range(first, end):
                # Evaluation before the step's update every eval_every steps, and after the last.
                due = self.evaluates and step % cfg.trainer.eval_every == 0
                pre = self.evaluate(step) if due else {}
                metrics = {**pre, **self.iteration(step)}
                if step == first:
                    metrics.update(self.notes)
                if step == end - 1 and self.evaluates:
                    metrics.update(self.evaluate(step + 1))
                report.log(step, {**self.ctx.metrics.pop(step, {}), **metrics})
                out_of_time = (
                    cfg.trainer.max_seconds is not None
                    and time.perf_counter() - t0 > cfg.trainer.max_seconds
                )
                if (step + 1) % cfg.trainer.checkpoint_every == 0 or step == end - 1 or out_of_time:
                    self.checkpoint(step)
                if out_of_time:
                    break
        finally:
            report.close()
            stop.set()
            with self.submit_lock:
                self.submit_lock.notify_all()
            if producer is not None:
                producer.join(timeout=cfg.orchestration.call_timeout_s)
        return {
            "report": report,
            "last_step": step,
            "checkpoint": self.last_checkpoint,
            "first_step": first,
        }
