"""Advantage estimators (pure math). The Prefect stage lives in `tasks/advantage/stage.py`."""

from tasks.advantage.core import (
    ESTIMATORS,
    AdvantageOutput,
    EstimatorSettings,
    EstimatorSpec,
    gae,
    grpo_advantage,
    reinforce_pp_advantage,
    rloo_advantage,
    run_estimator,
)

__all__ = [
    "ESTIMATORS",
    "AdvantageOutput",
    "EstimatorSettings",
    "EstimatorSpec",
    "gae",
    "grpo_advantage",
    "reinforce_pp_advantage",
    "rloo_advantage",
    "run_estimator",
]
