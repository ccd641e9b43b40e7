"""Progress of the long work before the RL steps (SFT, each reward model): the training loops
call ``progress(done, total)`` after every optimizer step.

``LineProgress`` prints one line on stderr when a phase starts, at least every ``interval_s``
while it runs, and when it ends; it holds no handle, so it also travels to a process of its
own. The flow side (``flows.progress``) adds a terminal bar and the Prefect progress artifact.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LineProgress", "Progress"]

Progress = Callable[[int, int], None]  # (steps done, steps in all)


@dataclass
class LineProgress:
    """``ppoflow: <label>: <done>/<total> (<pct>%) after <s> s`` on stderr: at the first call,
    then at least every ``interval_s``, and at the last step."""

    label: str
    interval_s: float = 30.0
    started: float | None = field(default=None, init=False)
    printed: float = field(default=0.0, init=False)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.started is None:
            self.started = self.printed = now
            self._print(done, total, now)
            return
        if done >= total or now - self.printed >= self.interval_s:
            self.printed = now
            self._print(done, total, now)

    def _print(self, done: int, total: int, now: float) -> None:
        share = 100.0 * done / total if total else 100.0
        elapsed = now - (self.started or now)
        print(
            f"ppoflow: {self.label}: {done}/{total} ({share:.0f}%) after {elapsed:.0f} s",
            file=sys.stderr,
            flush=True,
        )
