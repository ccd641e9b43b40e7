"""Stopping ``ppoflow train`` on SIGTERM, SIGINT or SIGHUP.

1. ``enable()`` (the CLI) arms the handlers; a flow run called from Python, a test or a
   deployment keeps Prefect's own signal handling.
2. ``signals(grace_s)`` installs the handlers for a block. The flow installs them again inside
   its body, because Prefect's engine replaces SIGTERM's handler for the duration of a flow run,
   and once more (``reinstall``) after Ray starts, whose driver sets a SIGTERM handler of its
   own.
3. Inside ``safe_points()`` (the RL loop) the first signal only records itself: the loop ends the
   current step, writes a checkpoint and raises ``RunStopped``. If that takes longer than
   ``grace_s``, or a second signal arrives, the handler raises ``RunStopped`` at once.
4. Outside the loop (start-up, the warm start) a signal raises ``RunStopped`` at once.

``RunStopped`` is a BaseException, as KeyboardInterrupt is: Prefect marks the flow run Crashed,
every ``finally`` on the way out releases its workers, pools and Ray, and the CLI exits with
128 + the signal's number (143, 130, 129) after the temporary Prefect server stops at exit.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "SIGNALS",
    "RunStopped",
    "enable",
    "reinstall",
    "requested",
    "safe_points",
    "signals",
    "stop_now",
]

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class RunStopped(BaseException):
    """The run stopped on a signal; ``exit_code`` is 128 + its number."""

    def __init__(self, signum: int, *, step: int | None = None, checkpoint: Path | None = None):
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        if checkpoint is not None:
            where = (
                f"after step {step}, checkpoint {checkpoint}; "
                "run the same command to resume (trainer.resume=auto)"
            )
        else:
            where = "before a new checkpoint; run the same command to resume from the latest one"
        super().__init__(f"stopped by {name} {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class _State:
    enabled: bool = False
    grace_s: float = 120.0
    signum: int | None = None
    deferring: int = 0  # depth of safe_points() blocks
    installed: int = 0  # depth of signals() blocks that installed the handlers
    timer: threading.Timer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def enable() -> None:
    """Let ``signals()`` install the handlers (the CLI's runs)."""
    _STATE.enabled = True
    _STATE.signum = None


def requested() -> int | None:
    """The signal that asked the run to stop, if any."""
    return _STATE.signum


def stop_now(*, step: int | None = None, checkpoint: Path | None = None) -> None:
    """Raise ``RunStopped`` when a stop was requested (the loop's safe point)."""
    signum = _STATE.signum
    if signum is None:
        return
    _cancel_timer()
    raise RunStopped(signum, step=step, checkpoint=checkpoint)


def _cancel_timer() -> None:
    with _STATE.lock:
        if _STATE.timer is not None:
            _STATE.timer.cancel()
            _STATE.timer = None


def _handler(signum: int, frame: FrameType | None) -> None:
    first = _STATE.signum is None
    if first:
        _STATE.signum = signum
    if not first or not _STATE.deferring:
        _cancel_timer()
        raise RunStopped(_STATE.signum or signum)
    name = signal.Signals(signum).name
    print(
        f"ppoflow: {name}: stopping after this step's checkpoint, at most "
        f"{_STATE.grace_s:.0f} s (trainer.stop_grace_s); send it again to stop at once",
        file=sys.stderr,
        flush=True,
    )
    timer = threading.Timer(_STATE.grace_s, _thread.interrupt_main, args=(signum,))
    timer.daemon = True
    with _STATE.lock:
        _STATE.timer = timer
    timer.start()


@contextmanager
def signals(grace_s: float) -> Iterator[None]:
    """Handle SIGTERM, SIGINT and SIGHUP as this module says, when enabled and on the main
    thread; the previous handlers come back afterwards."""
    if not _STATE.enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE.grace_s = grace_s
    previous: dict[int, Any] = {s: signal.signal(s, _handler) for s in SIGNALS}
    _STATE.installed += 1
    try:
        yield
    finally:
        _STATE.installed -= 1
        for s, handler in previous.items():
            signal.signal(s, handler)


def reinstall() -> None:
    """Put the handlers back inside a ``signals()`` block after a library replaced them (Ray's
    driver installs its own SIGTERM handler when it starts)."""
    if _STATE.installed and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _handler)


@contextmanager
def safe_points() -> Iterator[None]:
    """A block whose code reaches a safe point often (``stop_now``): a first signal waits there."""
    _STATE.deferring += 1
    try:
        if _STATE.signum is not None:
            stop_now()
        yield
    finally:
        _STATE.deferring -= 1
        if not _STATE.deferring:
            _cancel_timer()
