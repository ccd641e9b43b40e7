"""How a worker group turns its workers' failures into the run's errors, on a real local Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from infra.engines.vllm_engine import VLLMEngineFailedError
from infra.group import WorkerDied, WorkerGroup


def _group() -> WorkerGroup:
    """A group's error handling alone (``get``), without starting its workers."""
    group = object.__new__(WorkerGroup)
    group.pool = SimpleNamespace(name="train")  # type: ignore[assignment]
    group.roles = ("actor", "rollout")
    group.call_timeout_s = 60.0
    return group


def test_a_worker_whose_engine_failed_is_replaced_as_a_dead_one(ray_local) -> None:
    """An engine that serves no more makes its call raise ``WorkerDied`` (the loop restarts
    the group from the last checkpoint), not an error a stage retry would repeat."""
    ray = ray_local

    @ray.remote
    def serve() -> None:
        raise VLLMEngineFailedError("the vLLM engine failed in an earlier call (generate: boom)")

    group = _group()
    with pytest.raises(
        WorkerDied,
        match=r"pool 'train' \(roles actor, rollout\) cannot serve "
        r"generate_rows: the vLLM engine failed",
    ) as err:
        group.get(serve.remote(), "generate_rows")
    assert err.value.group is group


def test_a_steps_own_error_reaches_the_stage_as_it_is(ray_local) -> None:
    ray = ray_local

    @ray.remote
    def serve() -> None:
        raise ValueError("a non-finite score for keys ['a/0']")

    with pytest.raises(ValueError, match="non-finite score"):
        _group().get(serve.remote(), "score_rows")
