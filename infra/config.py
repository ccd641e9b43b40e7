"""The typed configuration tree of a ppoflow run.

One frozen pydantic model validates the YAML file, the ``key=value`` CLI overrides and the
Prefect deployment's parameter form (the flow takes a ``TrainConfig``, so Prefect generates the
form from this schema). Derived values are properties, never stored copies.

    cfg = load_config("configs/grpo.yaml", ["trainer.total_steps=20", "rollout.n=4"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Estimator = Literal["gae", "grpo", "rloo", "reinforce_pp"]
Mode = Literal["sync", "colocate_async", "separate_async"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLKind = Literal["k1", "abs", "k2", "k3"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the setting and what to change."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelsConfig(_Section):
    """Where the models come from. Empty paths mean: build the tiny local assets."""

    assets_dir: Path = Field(
        Path(".ppoflow/assets"), description="Where tiny assets are built (shared by runs)."
    )
    policy: Path | None = Field(
        None, description="Policy checkpoint (HF folder); None = tiny asset, warm-started."
    )
    tokenizer: Path | None = Field(
        None, description="Policy tokenizer folder; None = the policy folder's."
    )
    reward_model: Path | None = Field(
        None, description="Reward model folder; None = train one (warmstart.reward_model)."
    )
    critic: Path | None = Field(
        None, description="Critic init; None = the policy weights with a new value head."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Model dtype on the device."
    )


class WarmstartConfig(_Section):
    """Supervised warm start of the policy and reward-model training before RL (main job)."""

    enabled: bool = Field(
        True, description="Run SFT + reward-model training when no checkpoints are given."
    )
    sft_steps: int = Field(4000, ge=0, description="SFT optimizer steps.")
    sft_max_seconds: float | None = Field(None, gt=0, description="Wall-clock cap on SFT.")
    rm_steps: int = Field(1000, ge=0, description="Reward-model optimizer steps.")
    rm_max_seconds: float | None = Field(
        None, gt=0, description="Wall-clock cap on reward-model training."
    )
    min_rm_pair_accuracy: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Fail the run if the RM's held-out pair accuracy is below this.",
    )


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation engine: transformers or vLLM (GPU)."
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompts per iteration.")
    n: int = Field(8, ge=1, description="Samples per prompt (the GRPO/RLOO group size).")
    max_new_tokens: int = Field(8, ge=1, description="Response length cap.")
    min_new_tokens: int = Field(
        0, ge=0, description="Forbid EOS before this many tokens (fixed-length benchmarks)."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")


class RewardConfig(_Section):
    pool: Literal["colocated", "own"] = Field(
        "colocated",
        description="'colocated': the RM shares the training pool and wakes in turn; 'own': the RM gets its own pool.",
    )
    batch_size: int = Field(64, ge=1, description="Scoring batch size.")
    max_length: int | None = Field(
        None, ge=1, description="RM input cap after re-tokenisation (None = model max)."
    )
    model_weight: float = Field(1.0, description="Weight of the reward-model score in `scores`.")
    rule_weight: float = Field(
        0.0, description="Weight of the rule reward (0 = logged only, the honest metric)."
    )
    rule: Literal["exact_match", "hash_answer_match"] = Field(
        "exact_match", description="Rule that checks a response against ground_truth."
    )


class KLConfig(_Section):
    in_reward: bool = Field(False, description="Subtract a KL penalty from token rewards.")
    kind: KLKind = Field("k1", description="KL estimator for the reward penalty.")
    coef: float = Field(0.0, ge=0, description="Initial KL coefficient.")
    adaptive: bool = Field(
        False, description="Adaptive controller (target, horizon) instead of a fixed coefficient."
    )
    target: float = Field(6.0, gt=0, description="Adaptive controller target KL.")
    horizon: int = Field(10000, gt=0, description="Adaptive controller horizon.")
    loss_coef: float = Field(0.0, ge=0, description="KL-as-loss coefficient in the actor loss.")
    loss_kind: KLKind = Field("k3", description="KL estimator for the loss term.")
    monitor: bool = Field(
        True,
        description="Compute the reference's log-probs to log actor/kl_to_ref (needs the ref model).",
    )


class AlgorithmConfig(_Section):
    estimator: Estimator = Field("grpo", description="Advantage estimator; 'gae' uses a critic.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    norm_by_std: bool = Field(True, description="GRPO: divide by the group std.")
    whiten_advantages: bool = Field(
        True, description="GAE/REINFORCE++: whiten advantages over real tokens."
    )
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus in the actor loss.")
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto",
        description=(
            "'recompute': a forward pass of the actor before the update gives old_logprobs. "
            "'auto': skip it when the update is one on-policy optimizer step per batch (mode "
            "sync, one PPO epoch, one mini-batch, no KL in the reward); the update then takes "
            "the detached log-probs of its own forward pass as old_logprobs, which are the same "
            "numbers (the weights have not changed yet); otherwise recompute. 'rollout': the "
            "rollout engine's log-probs of the sampled tokens (the behaviour policy that made "
            "the batch, at the sampling temperature) are old_logprobs: no recompute pass, and in "
            "the async modes the ratio is taken against the policy that really sampled."
        ),
    )

    @property
    def use_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.kl.in_reward or self.kl.loss_coef > 0 or self.kl.monitor


class OptimConfig(_Section):
    lr: float = Field(1e-4, gt=0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="Linear warmup (optimizer steps).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    mini_batch_size: int = Field(64, ge=1, description="Samples per optimizer step.")
    micro_batch_size: int = Field(
        64,
        ge=1,
        description="Samples per forward/backward (gradient accumulation = mini // micro).",
    )
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1.")
    clip_high: float = Field(0.2, ge=0, description="PPO ratio clip above 1.")
    dual_clip: float | None = Field(
        3.0, gt=1, description="Dual-clip bound for negative advantages (None = off)."
    )
    value_clip: float = Field(0.2, ge=0, description="Critic value clip range.")
    loss_agg: LossAgg = Field(
        "token-mean", description="Loss aggregation over tokens and sequences."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping.")

    @model_validator(mode="after")
    def _micro_divides_mini(self) -> OptimConfig:
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"mini_batch_size={self.mini_batch_size} must be a multiple of micro_batch_size={self.micro_batch_size}"
            )
        return self


class ResourcesConfig(_Section):
    mode: Mode = Field("sync", description="sync | colocate_async | separate_async (see DESIGN).")
    max_staleness: int = Field(
        1, ge=0, description="Max policy versions a consumed batch may lag (async modes)."
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to attach to (else RAY_ADDRESS, else a local instance)."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs for a local Ray instance (None = all)."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device of the worker models.")
    num_workers: int = Field(
        1, ge=1, description="Data-parallel workers in the training pool (one per device)."
    )
    rollout_workers: int = Field(
        1, ge=1, description="Workers in the rollout pool (separate_async)."
    )
    accelerator_resource: str = Field(
        "gpu_slot",
        description="Ray resource standing for one device on CPU machines ('GPU' on GPU clusters).",
    )
    threads_per_worker: int = Field(1, ge=1, description="torch threads in each worker process.")


class StoreConfig(_Section):
    url: str = Field("memory://", description="memory:// (in-process) or ray://NAME?shards=N.")
    get_timeout_s: float = Field(
        120.0, gt=0, description="How long a stage waits for fields that are not there yet."
    )


class OrchestrationConfig(_Section):
    retries: int = Field(1, ge=0, description="Prefect task retries per stage.")
    retry_delay_seconds: float = Field(1.0, ge=0)
    timeout_seconds: float = Field(600.0, gt=0, description="Prefect task timeout per stage.")
    call_timeout_s: float = Field(
        300.0, gt=0, description="Timeout of every blocking Ray call inside a stage."
    )


class TrainerConfig(_Section):
    total_steps: int = Field(25, ge=1, description="RL iterations.")
    max_seconds: float | None = Field(
        None, gt=0, description="Stop after this much RL time (checkpointed)."
    )
    eval_every: int = Field(5, ge=1, description="Rule accuracy on held-out prompts every N steps.")
    eval_prompts: int = Field(200, ge=1, description="Held-out prompts per evaluation.")
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1)
    resume: Literal["auto", "never"] = Field(
        "auto", description="'auto' continues from the latest checkpoint in run_dir."
    )
    steps_per_run: int | None = Field(
        None,
        ge=1,
        description="At most this many steps per flow run; a scheduled deployment then continues one run.",
    )
    progress_bar: bool = Field(True, description="Terminal progress bar.")
    artifact_interval_s: float = Field(
        10.0,
        ge=0,
        description=(
            "Least seconds between updates of the Prefect metrics-table and progress artifacts "
            "(each costs ~15-30 ms of server round trips); the first and last steps always "
            "update them. metrics.jsonl and the per-step event are written every step."
        ),
    )


class TrainConfig(_Section):
    """A whole ppoflow run. Every field has a default: `TrainConfig()` is the embedded main job."""

    name: str = Field("default", description="Run name (directory under runs/).")
    seed: int = Field(0, description="Seed of everything random.")
    run_dir: Path | None = Field(None, description="Run directory; None = runs/<name>.")
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: OptimConfig = Field(default_factory=OptimConfig)
    critic: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-4))
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @model_validator(mode="after")
    def _check_modes(self) -> TrainConfig:
        if self.resources.mode == "separate_async" and self.reward.pool == "colocated":
            raise ValueError(
                "resources.mode='separate_async' cannot use a colocated reward model: the rollout never "
                "pauses, so the devices the reward model would wake on are never free. "
                "Set reward.pool='own' to give the reward model its own pool, or use mode 'sync' / 'colocate_async'."
            )
        if self.batch_size % self.resources.num_workers:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.n = {self.batch_size} must be divisible by "
                f"resources.num_workers={self.resources.num_workers}"
            )
        return self

    @property
    def batch_size(self) -> int:
        """Samples per iteration."""
        return self.rollout.prompts_per_step * self.rollout.n

    @property
    def old_logprobs_field(self) -> str | None:
        """The stored field the update takes as old log-probs (see ``algorithm.old_logprobs``):
        ``old_logprobs`` (recomputed by the logprobs stage), ``rollout_logprobs`` (the rollout
        engine's), or None (the update's own first forward pass, detached)."""
        if self.algorithm.old_logprobs == "rollout":
            return "rollout_logprobs"
        one_step = self.actor.ppo_epochs == 1 and self.actor.mini_batch_size >= self.batch_size
        on_policy = self.resources.mode == "sync" and one_step
        if self.algorithm.old_logprobs == "recompute" or self.algorithm.kl.in_reward:
            return "old_logprobs"
        return None if on_policy else "old_logprobs"

    @property
    def recompute_old_logprobs(self) -> bool:
        """Whether the logprobs stage computes ``old_logprobs`` (see ``algorithm.old_logprobs``)."""
        return self.old_logprobs_field == "old_logprobs"

    @property
    def resolved_run_dir(self) -> Path:
        return self.run_dir if self.run_dir is not None else Path("runs") / self.name


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not of the form key=value (e.g. trainer.total_steps=20)"
            )
        _set_path(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def build_config(data: dict[str, Any]) -> TrainConfig:
    """Validate a plain dict; errors name every offending field by its dotted path."""
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid ppoflow config: {problems}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML file (optional), apply ``key=value`` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded or {}
    return build_config(_merge(data, parse_overrides(overrides or [])))
