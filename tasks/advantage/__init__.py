"""Advantage estimators (pure math). The Prefect stage lives in `tasks/advantage/stage.py`."""

from tasks.advantage.core import (
    ESTIMATOR_INPUTS,
    ESTIMATOR_SETTINGS,
    ESTIMATORS,
    AdvantageOutput,
    gae,
    grpo_advantage,
    reinforce_pp_advantage,
    rloo_advantage,
    run_estimator,
)

__all__ = [
    "ESTIMATORS",
    "ESTIMATOR_INPUTS",
    "ESTIMATOR_SETTINGS",
    "AdvantageOutput",
    "gae",
    "grpo_advantage",
    "reinforce_pp_advantage",
    "rloo_advantage",
    "run_estimator",
]
