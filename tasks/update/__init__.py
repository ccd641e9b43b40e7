"""PPO-family losses and training loops (torch only). The Prefect stage lives in `tasks/update/stage.py`."""

from tasks.update.core import (
    AGGREGATIONS,
    POLICY_LOSSES,
    ActorLossOutput,
    PolicyLossOutput,
    PolicyLossSettings,
    ValueLossOutput,
    actor_loss,
    aggregate_loss,
    cispo_policy_loss,
    count_loss_units,
    entropy_from_logits,
    gspo_policy_loss,
    ppo_policy_loss,
    sapo_policy_loss,
    value_loss,
)
from tasks.update.optimize import (
    ActorUpdateSettings,
    CriticUpdateSettings,
    actor_update,
    count_minibatch_units,
    critic_update,
)

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "ActorLossOutput",
    "ActorUpdateSettings",
    "CriticUpdateSettings",
    "PolicyLossOutput",
    "PolicyLossSettings",
    "ValueLossOutput",
    "actor_loss",
    "actor_update",
    "aggregate_loss",
    "cispo_policy_loss",
    "count_loss_units",
    "count_minibatch_units",
    "critic_update",
    "entropy_from_logits",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "sapo_policy_loss",
    "value_loss",
]
