"""Calls bounded in time inside spawned worker processes, shared by the reward-function pool
(``infra.reward_functions``) and the tool pool (``infra.tools``).

Inside a worker, ``call_with_timeout`` interrupts a Python call after ``timeout_s`` with SIGALRM
(the alarm repeats until the call gives up control); in the parent, ``kill_executor`` terminates
a pool whose call is stuck where the alarm cannot reach (C code), and ``spawn_executor`` starts
a fresh one. Standard library only: this module is on the workers' import path.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Collection
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Self

__all__ = [
    "CallTimeout",
    "PoolOwner",
    "call_with_timeout",
    "kill_executor",
    "spawn_executor",
    "wait_until",
]

REFIRE_S = 0.05  # after a timeout the alarm repeats until the call gives up control


class CallTimeout(BaseException):
    """Raised by SIGALRM inside a call; a BaseException so `except Exception` does not eat it."""


@dataclass
class _Alarm:
    armed: bool = False
    fired: bool = False


_ALARM = _Alarm()  # one per worker process: a worker runs one call at a time


def _on_alarm(signum: int, frame: object) -> None:
    _ALARM.fired = True
    if _ALARM.armed:
        raise CallTimeout


def call_with_timeout(
    function: Callable[..., Any], timeout_s: float, /, *args: Any, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)``, raising ``CallTimeout`` after ``timeout_s`` (main thread of
    a worker process only).

    The handler is set again per call: a function that sets its own SIGALRM handler or
    ``signal.alarm`` replaces this timer, and then only the parent's backstop bounds that call.
    """
    signal.signal(signal.SIGALRM, _on_alarm)
    _ALARM.fired, _ALARM.armed = False, True
    signal.setitimer(signal.ITIMER_REAL, timeout_s, REFIRE_S)
    try:
        try:
            value = function(*args, **kwargs)
        finally:
            _ALARM.armed = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if _ALARM.fired:
        raise CallTimeout
    return value


def spawn_executor(
    workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]
) -> ProcessPoolExecutor:
    """A pool of ``workers`` spawned processes, each running ``initializer(*initargs)`` first."""
    return ProcessPoolExecutor(
        workers, mp_context=get_context("spawn"), initializer=initializer, initargs=initargs
    )


def wait_until(
    futures: Collection[Future[Any]], deadline: float, *, first: bool
) -> tuple[set[Future[Any]], set[Future[Any]]]:
    """``(done, pending)`` once the first of ``futures`` (``first``) or all of them are done, or
    at ``deadline`` (a ``time.monotonic()`` time; one already past only collects what is done):
    the parent's backstop against calls stuck where the alarm cannot reach."""
    timeout = max(0.0, deadline - time.monotonic())
    done, pending = wait(futures, timeout, FIRST_COMPLETED if first else ALL_COMPLETED)
    return done, pending


def kill_executor(executor: ProcessPoolExecutor | None) -> None:
    """Terminate the pool's processes at once (a stuck call never returns), then shut it down."""
    if executor is None:
        return
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.kill()
    executor.shutdown(wait=True, cancel_futures=True)


class PoolOwner:
    """Holds a pool of worker processes started on first use (``_executor``); as a context
    manager, stops it on exit. ``close`` stops the processes; the next use starts new ones."""

    _executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
