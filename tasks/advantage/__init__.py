"""Advantage estimators (pure math). The Prefect stage lives in `tasks/advantage/stage.py`."""

from tasks.advantage.core import (
    ESTIMATOR_INPUTS,
    ESTIMATORS,
    AdvantageOutput,
    gae,
    grpo_advantage,
    reinforce_pp_advantage,
    rloo_advantage,
)

__all__ = [
    "ESTIMATORS",
    "ESTIMATOR_INPUTS",
    "AdvantageOutput",
    "gae",
    "grpo_advantage",
    "reinforce_pp_advantage",
    "rloo_advantage",
]
