"""How every stage task of a run is retried (``orchestration.*``): the options each task is
called with (``retry_options``) and which failures a retry could mend (``retryable``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from infra.group import WorkerDied
from storage import ShardLost
from tasks.score.stage import NonFiniteScoreError

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import State, TaskRun

    from infra.config import TrainConfig


class RetryOptions(TypedDict):
    """What every stage task of a run is called with (``orchestration.*``)."""

    retries: int
    retry_delay_seconds: float
    timeout_seconds: float | None
    retry_condition_fn: Callable[[Task[..., Any], TaskRun, State[Any]], bool]


def retry_options(cfg: TrainConfig) -> RetryOptions:
    orch = cfg.orchestration
    return RetryOptions(
        retries=orch.retries,
        retry_delay_seconds=orch.retry_delay_seconds,
        timeout_seconds=orch.timeout_seconds,
        retry_condition_fn=retryable,
    )


def retryable(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry a failed stage unless its error would repeat: a reward function that raised or
    returned a bad value, a non-finite reward-model score, a rollout engine that failed the
    weight-sync probe (a retry could sync again and hide it); a dead worker or a lost store shard
    is for the loop's restart (timeouts retry)."""
    from infra.engines.probe import WeightSyncError
    from infra.reward_functions import RewardFunctionError

    try:
        state.result(raise_on_failure=True)
    except RewardFunctionError as exc:
        return exc.kind in ("timeout", "died")
    except (NonFiniteScoreError, WorkerDied, ShardLost):  # the loop restarts for these
        return False
    except WeightSyncError:
        return False
    except BaseException:  # noqa: BLE001 - anything else may be transient
        return True
    return True
