"""``separate_async``: the rollout producer, a thread that runs the rollout of the coming steps
(generate → score, with dynamic sampling's filter and refill rounds: ``flows.sampling``) on the
rollout and reward pools, at most ``resources.max_staleness`` steps ahead of the trainer, while
the training loop runs logprobs → advantage → update of its own step.

The thread runs in a copy of the flow run's context, so its task runs belong to the flow run
(the UI shows generate/score of step k+1 beside update of k). A failure in the producer is
raised in the training loop at once by ``wait``.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from infra.group import WorkerDied
from storage import BatchMeta, ShardLost
from tasks.context import StageResult, Timings

if TYPE_CHECKING:
    from flows.sampling import Sampler


class RolloutProducer:
    """Produces scored partitions for steps ``first, first + 1, ...`` (see the module docstring).

    ``lock`` is the trainer's condition: it guards ``produced`` and is notified when the
    trainer finishes a step (``progress()``: the steps it has finished). ``ready``: steps a
    checkpoint saved as produced (their rows restored), handed over without running again."""

    def __init__(
        self,
        *,
        sampler: Sampler,
        submit: Callable[[int], BatchMeta],
        progress: Callable[[], int],
        ready: dict[int, StageResult],
        lock: threading.Condition,
    ) -> None:
        self.sampler, self.submit, self.progress = sampler, submit, progress
        self.ctx = sampler.ctx
        self.lock = lock
        self.produced: dict[int, StageResult] = dict(ready)  # scored, with their metrics
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, first: int) -> None:
        self._thread = threading.Thread(  # in the flow run's context: its tasks belong to it
            target=contextvars.copy_context().run,
            args=(self._produce, first),
            daemon=True,
            name="rollout-producer",
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        with self.lock:
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def finished(self) -> dict[int, StageResult]:
        """The steps produced and not yet taken by the trainer (call with ``lock`` held)."""
        return dict(self.produced)

    def wait(self, step: int) -> StageResult:
        """The step's generated and scored partition and its metrics, once produced. A producer failure is
        raised at once; no rows within ``store.get_timeout_s`` is a TimeoutError naming the step."""
        timeout = self.ctx.cfg.store.get_timeout_s
        deadline = time.monotonic() + timeout
        with self.lock:
            while step not in self.produced:
                if isinstance(self.error, (WorkerDied, ShardLost)):
                    raise self.error  # the training loop restarts
                if self.error is not None:
                    raise RuntimeError(
                        f"no rollout for step {step}: the producer failed: {self.error!r}"
                    ) from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no rollout for step {step} within store.get_timeout_s={timeout:.0f} s"
                    )
                self.lock.wait(left)
            return self.produced.pop(step)

    def _produce(self, first: int) -> None:
        cfg = self.ctx.cfg
        step = first
        try:
            while not self._stop.is_set() and step < cfg.trainer.total_steps:
                with self.lock:  # at most max_staleness steps ahead of the trainer
                    while (
                        self.progress() < step - cfg.resources.max_staleness
                        and not self._stop.is_set()
                    ):
                        self.lock.wait(0.5)
                    if step in self.produced:  # restored as produced by a checkpoint
                        step += 1
                        continue
                if self._stop.is_set():
                    return
                meta = self.submit(step)
                timed = Timings()
                produced = self.sampler([meta], step, timed)
                result = StageResult(produced.meta, {**produced.metrics, **timed.seconds})
                with self.lock:
                    self.produced[step] = result
                    self.lock.notify_all()
                step += 1
        except BaseException as exc:  # raised in the training loop by wait()
            self.error = exc
            with self.lock:
                self.lock.notify_all()
