"""Prefect flows: the PPO training flow, the reward-model flow, deployments and the CLI."""
