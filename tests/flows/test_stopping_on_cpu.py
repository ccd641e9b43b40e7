"""flows.stopping in this process, with real signals: outside the RL loop a signal stops at once;
inside it the first one waits for the safe point, a second one or the grace period stops at once;
the previous handlers come back."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows import stopping


@pytest.fixture(autouse=True)
def armed() -> Iterator[None]:
    stopping.enable()
    yield
    stopping._STATE.enabled = False
    stopping._STATE.signum = None


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_outside_the_loop_a_signal_stops_at_once_with_its_exit_code() -> None:
    before = signal.getsignal(signal.SIGHUP)
    with pytest.raises(stopping.RunStopped) as stop, stopping.signals(grace_s=60):
        _send(signal.SIGHUP)
    assert stop.value.exit_code == 129
    assert signal.getsignal(signal.SIGHUP) is before


def test_in_the_loop_the_first_signal_waits_for_the_safe_point() -> None:
    with stopping.signals(grace_s=60), stopping.safe_points():
        _send(signal.SIGTERM)  # no exception: the step goes on
        assert stopping.requested() == signal.SIGTERM
        with pytest.raises(stopping.RunStopped) as stop:
            stopping.stop_now(step=4, checkpoint=Path("run/checkpoints/step-000004"))
    assert stop.value.exit_code == 143
    assert str(stop.value) == (
        "stopped by SIGTERM after step 4, checkpoint run/checkpoints/step-000004; "
        "run the same command to resume (trainer.resume=auto)"
    )


def test_a_second_signal_stops_at_once() -> None:
    with (
        pytest.raises(stopping.RunStopped) as stop,
        stopping.signals(grace_s=60),
        stopping.safe_points(),
    ):
        _send(signal.SIGINT)
        _send(signal.SIGINT)
    assert stop.value.exit_code == 130
    assert stop.value.checkpoint is None


def test_past_the_grace_period_the_step_is_interrupted() -> None:
    started = time.monotonic()
    with (
        pytest.raises(stopping.RunStopped) as stop,
        stopping.signals(grace_s=0.2),
        stopping.safe_points(),
    ):
        _send(signal.SIGTERM)
        while time.monotonic() - started < 30:  # a step that does not end
            time.sleep(0.01)
    assert stop.value.signum == signal.SIGTERM


def test_not_enabled_leaves_the_handlers_alone() -> None:
    stopping._STATE.enabled = False
    before = signal.getsignal(signal.SIGTERM)
    with stopping.signals(grace_s=1):
        assert signal.getsignal(signal.SIGTERM) is before
    with stopping.safe_points():
        stopping.stop_now(step=1)  # nothing requested: no-op
