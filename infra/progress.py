"""Progress of a run's long work besides the RL steps' own report: the work calls
``progress(done, total)`` (each SFT or reward-model optimizer step, each part of an asset build
or an evaluation, each dynamic-sampling round of a step).

``LineProgress`` prints one line on stderr when a phase starts, at least every ``interval_s``
while it runs (between two calls too, inside ``heartbeat()``), and when it ends; it pickles
(its lock left behind), so it also travels to a process of its own. ``Parts`` reports a job
made of a few parts. The flow side (``flows.progress``) adds a terminal bar and the Prefect
progress artifact.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LineProgress", "Parts", "Progress"]

Progress = Callable[[int, int], None]  # (done, in all)


@dataclass
class LineProgress:
    """``ppoflow: <label>: <done>/<total> (<pct>%) after <s> s`` on stderr.

    A line at the first call, then at least every ``interval_s`` (checked at each call, and by
    the heartbeat thread between calls), and at the last step. With ``quiet_s`` the first line
    waits until the phase has run that long, so a phase that ends sooner prints nothing. The
    clock starts at the first call or at ``heartbeat()``, whichever comes first."""

    label: str
    interval_s: float = 30.0
    quiet_s: float = 0.0
    started: float | None = field(default=None, init=False)
    printed: float | None = field(default=None, init=False)  # when the last line was printed
    last: tuple[int, int] | None = field(default=None, init=False)  # the last (done, total)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            now = time.monotonic()
            if self.started is None:
                self.started = now
            self.last = (done, total)
            if self._due(now, finished=done >= total):
                self._print(now)

    @contextmanager
    def heartbeat(self) -> Iterator[None]:
        """While inside, a daemon thread repeats the last line (with the time gone on) when
        ``interval_s`` passes without one, so a long part between two calls still shows a line.
        The thread stops when the block ends."""
        with self._lock:
            self.started = time.monotonic() if self.started is None else self.started
        stop = threading.Event()
        beat = threading.Thread(  # in the caller's context: a flow run that logs prints logs these
            target=contextvars.copy_context().run,
            args=(self._beat, stop),
            daemon=True,
            name="ppoflow-heartbeat",
        )
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self._next_line_in()):
            with self._lock:
                now = time.monotonic()
                if self._running() and self._due(now, finished=False):
                    self._print(now)

    def _running(self) -> bool:
        """A phase under way: there is a line to repeat and it is not the last one."""
        return self.last is not None and self.last[0] < self.last[1]

    def _next_line_in(self) -> float:
        """Seconds until the heartbeat may owe a line."""
        with self._lock:
            if not self._running() or self.started is None:
                return self.interval_s
            since, gap = (
                (self.started, self.quiet_s)
                if self.printed is None
                else (self.printed, self.interval_s)
            )
            return max(since + gap - time.monotonic(), 0.001)

    def _due(self, now: float, *, finished: bool) -> bool:
        assert self.started is not None
        if self.printed is None:
            return now - self.started >= self.quiet_s
        return finished or now - self.printed >= self.interval_s

    def _print(self, now: float) -> None:
        assert self.last is not None and self.started is not None
        done, total = self.last
        share = 100.0 * done / total if total else 100.0
        self.printed = now
        print(
            f"ppoflow: {self.label}: {done}/{total} ({share:.0f}%) after {now - self.started:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def __getstate__(self) -> dict[str, Any]:  # a lock does not travel to another process
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


@dataclass
class Parts:
    """Progress of a job made of ``total`` parts: ``0/total`` when made, one more part at each
    ``done()``; nothing without ``progress``."""

    progress: Progress | None
    total: int
    count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._report()

    def done(self) -> None:
        self.count += 1
        self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.count, self.total)
