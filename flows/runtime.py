"""Build and tear down what a training run computes on: Ray, resource pools, worker groups, store.

Pool layout by mode (``reward.pool`` decides whether the scoring models — reward model, judge,
distillation teacher — share the training pool, ``colocated``, or get a pool of one bundle,
``own``):

| mode           | training pool (num_workers)                  | rollout pool    | own reward pool |
|----------------|----------------------------------------------|-----------------|-----------------|
| sync           | rollout, actor, ref, critic, (scoring)       | — (training)    | scoring models  |
| colocate_async | same as sync                                 | — (training)    | scoring models  |
| separate_async | actor, ref, critic, (scoring)                | rollout_workers | scoring models  |

``(scoring)``: reward, judge and teacher, each if used, with ``reward.pool: colocated``. In
``separate_async`` they never share the rollout's devices (a rollout that never pauses never
frees them): colocated, they take turns with the trainer on the training pool, the producer
thread's score and the training loop's logprobs and update calling the same workers, which run
one call at a time (``infra.workers``).
A run without a reward model, judge or teacher (reward functions only) has none of their roles
and no reward pool.
Each bundle is one device, except the rollout pool's with a tensor-parallel vLLM engine
(``rollout.tensor_parallel_size``, separate_async only): each of its bundles holds that many.
"""

from __future__ import annotations

from flows import stopping
from flows.reward_model import ResolvedModels
from infra.cluster import ResourcePool, create_pool, ensure_ray
from infra.config import TrainConfig
from infra.group import WorkerGroup
from infra.judge import template_text
from infra.reward_functions import RewardFunctionPool
from infra.runtime import Runtime
from infra.workers import Role, WorkerSpec
from storage import Store


def _reward_roles(cfg: TrainConfig) -> tuple[Role, ...]:
    """The scoring models the run loads: the reward model, the judge and the distillation
    teacher, each if used."""
    roles: list[Role] = []
    if cfg.uses_reward_model:
        roles.append("reward")
    if cfg.models.judge is not None:
        roles.append("judge")
    if cfg.algorithm.distills:
        roles.append("teacher")
    return tuple(roles)


def _train_roles(cfg: TrainConfig) -> tuple[Role, ...]:
    algo = cfg.algorithm
    roles: list[Role] = []
    if cfg.resources.mode != "separate_async":
        roles.append("rollout")
    if cfg.reward.pool == "colocated":
        roles.extend(_reward_roles(cfg))
    roles.append("actor")
    if algo.use_reference:
        roles.append("ref")
    if algo.use_critic:
        roles.append("critic")
    return tuple(roles)


def _spec(
    cfg: TrainConfig, models: ResolvedModels, roles: tuple[Role, ...], store_url: str
) -> WorkerSpec:
    return WorkerSpec(
        roles=roles,
        cfg=cfg,
        policy_path=models.policy,
        tokenizer_path=models.tokenizer,
        reference_path=models.reference,
        reward_model_path=models.reward_model,
        critic_path=models.critic,
        judge_path=models.judge if "judge" in roles else None,
        teacher_path=models.teacher if "teacher" in roles else None,
        judge_template=(
            template_text(cfg.reward.judge.template)
            if "judge" in roles and cfg.reward.judge is not None
            else None
        ),
        store_url=store_url,
    )


def _devices(cfg: TrainConfig, *, own_reward: bool) -> int:
    """The devices the run's pools reserve: the training pool's, the rollout pool's in
    ``separate_async`` (``tensor_parallel_size`` each) and the reward model's own."""
    res = cfg.resources
    rollout = res.rollout_workers * cfg.rollout.tensor_parallel_size
    return res.num_workers + (rollout if res.mode == "separate_async" else 0) + int(own_reward)


def _abandon(store: Store | None, pools: list[ResourcePool], *, started_ray: bool) -> None:
    """Undo a runtime that failed to start: close its store, release its pools and stop the
    Ray instance it started."""
    if store is not None:
        store.close()
    for pool in pools:
        pool.release()
    if started_ray:
        import ray

        ray.shutdown()


def build_runtime(cfg: TrainConfig, models: ResolvedModels) -> Runtime:
    """Start/attach Ray, reserve pools, start workers (all asleep), open the store."""
    from storage import open_store

    res = cfg.resources
    separate = res.mode == "separate_async"
    own_reward = cfg.reward.pool == "own" and bool(_reward_roles(cfg))
    rollout_devices = cfg.rollout.tensor_parallel_size  # > 1 only for vLLM in separate_async
    started = ensure_ray(res, pools_devices=_devices(cfg, own_reward=own_reward))
    stopping.reinstall()  # Ray's driver sets a SIGTERM handler of its own
    timeout = cfg.orchestration.call_timeout_s
    pools: list[ResourcePool] = []
    store: Store | None = None
    try:
        # 0. The store (this handle owns its shards: closing it ends them).
        store = open_store(cfg.store.url)
        url = store.url

        def group(name: str, size: int, roles: tuple[Role, ...], devices: int = 1) -> WorkerGroup:
            """A pool of ``size`` bundles of ``devices`` devices and its workers of ``roles``."""
            pool = create_pool(
                name, size, accelerator=res.accelerator_resource, devices_per_bundle=devices
            )
            pools.append(pool)
            return WorkerGroup(pool, _spec(cfg, models, roles, url), call_timeout_s=timeout)

        # 1. Training pool (colocated roles take turns on each of its bundles).
        train = group("train", res.num_workers, _train_roles(cfg))
        # 2. Optional own pools for the reward model / judge and the rollout.
        colocated = {"reward", "judge", "teacher"} & set(train.spec.roles)
        reward: WorkerGroup | None = train if colocated else None
        if own_reward:
            reward = group("reward", 1, _reward_roles(cfg))
        rollout = train
        if separate:
            rollout = group("rollout", res.rollout_workers, ("rollout",), rollout_devices)
        # 3. The reward-function processes.
        functions: RewardFunctionPool | None = None
        if cfg.reward.functions:
            functions = RewardFunctionPool(
                cfg.reward.functions,
                workers=cfg.reward.function_workers,
                timeout_s=cfg.reward.function_timeout_s,
            )
    except BaseException:
        _abandon(store, pools, started_ray=started)
        raise
    return Runtime(
        store=store,
        train_group=train,
        reward_group=reward,
        rollout_group=rollout,
        pools=pools,
        started_ray=started,
        reward_pool=functions,
    )
