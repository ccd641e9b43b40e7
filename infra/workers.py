"""The worker that holds the models of one device and runs each stage's compute on it.

A ``PPOWorker`` owns some of the roles ``rollout`` (generation engine), ``reward`` (reward
model), ``actor`` (policy + optimizer), ``ref`` (frozen reference policy) and ``critic`` (value
model + optimizer). Roles in one worker share its device and take turns: every method wakes
exactly the role it needs through a ``ColocatedGroup`` and puts it back to sleep afterwards, even
when the compute raises. Workers are plain classes; ``WorkerGroup`` (infra.group) runs them as
Ray actors in a resource pool. Data arrives and leaves as columnar ``Jagged`` buffers.

Data-parallel workers (``world_size > 1``) join a torch.distributed group (gloo on CPU, nccl on
CUDA) and SUM their gradients: each worker's loss is already divided by the global token (or
sequence) count, so N workers make the same update as one worker over the whole batch.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from infra.colocate import ColocatedGroup
from infra.config import AlgorithmConfig, OptimConfig, RolloutConfig
from infra.kernels import fuse_activations
from infra.transport import Jagged

ROLES = ("rollout", "reward", "actor", "ref", "critic")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its roles (picklable: travels to the Ray actor)."""

    roles: tuple[str, ...]
    policy_path: str
    tokenizer_path: str
    reference_path: str | None = None
    reward_model_path: str | None = None
    critic_path: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    dist_address: str | None = None
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor_optim: OptimConfig = field(default_factory=OptimConfig)
    critic_optim: OptimConfig = field(default_factory=OptimConfig)
    reward_batch_size: int = 64
    reward_max_length: int | None = None
    total_steps: int = 1


def pad_token_id(tokenizer: Any) -> int:
    """The pad id; tokenizers without one (Llama-3 style) pad with EOS (padding is masked)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def stop_token_ids(tokenizer: Any, model_path: str) -> tuple[int, ...]:
    """Tokens that end a response: the tokenizer's EOS and the model's generation-config EOS
    ids (chat models end a turn with e.g. ``<|im_end|>`` or ``<|eot_id|>``)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        eos = None
    for value in [eos] if isinstance(eos, int) else list(eos or []):
        if int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _warmup_lambda(warmup: int):  # noqa: ANN202 - a LambdaLR closure
    return lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def _load_weights(module: torch.nn.Module, path: Path) -> None:
    """Load a ``save_pretrained`` safetensors file; only tied duplicates may be absent from it."""
    from safetensors.torch import load_file

    state = load_file(path)
    result = module.load_state_dict(state, strict=False)
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    untied = [k for k in result.missing_keys if k not in params or id(params[k]) not in loaded]
    if untied or result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint {path} does not match the model: missing {untied}, unexpected {result.unexpected_keys}"
        )


class PPOWorker:
    """Holds models for some roles on one device; see the module docstring."""

    def __init__(self, spec: WorkerSpec) -> None:
        # 1. Process settings: threads, seeds, distributed group.
        torch.set_num_threads(spec.threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _seed_everything(spec.seed + 1000 * spec.rank)
        self.spec = spec
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.group = ColocatedGroup(f"worker-{spec.rank}")
        self.version = 0
        if spec.world_size > 1:
            self._init_distributed()
        # 2. Models, each registered asleep in the colocated group.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        self.eos_ids = stop_token_ids(self.tokenizer, spec.policy_path)
        self.pad_id = pad_token_id(self.tokenizer)
        for role in spec.roles:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
            getattr(self, f"_build_{role}")()
            self.group.put_all_to_sleep()  # models load awake; each waits asleep for its turn

    # ----------------------------------------------------------------- building roles
    def _init_distributed(self) -> None:
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{self.spec.dist_address}",
            rank=self.spec.rank,
            world_size=self.spec.world_size,
        )

    def _build_rollout(self) -> None:
        from infra.engines import make_engine

        self.engine = make_engine(
            self.spec.rollout.engine,
            self.spec.policy_path,
            device=self.spec.device,
            dtype=self.dtype,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        self.group.register("rollout", self.engine)

    def _build_reward(self) -> None:
        from infra.reward_model import RewardScorer

        assert self.spec.reward_model_path is not None, "reward role needs reward_model_path"
        self.scorer = RewardScorer(
            self.spec.reward_model_path,
            policy_tokenizer_path=self.spec.tokenizer_path,
            device=self.spec.device,
            dtype=self.dtype,
            batch_size=self.spec.reward_batch_size,
            max_length=self.spec.reward_max_length,
        )
        self.group.register("reward", self.scorer)

    def _make_trainable(self, model: torch.nn.Module, optim: OptimConfig) -> Any:
        from infra.colocate import TrainableModel

        model.to(self.device)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, eps=1e-8
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_lambda(optim.warmup_steps))
        return TrainableModel(model, optimizer, device=self.spec.device, scheduler=scheduler)

    def _build_actor(self) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.spec.policy_path, dtype=self.dtype)
        fuse_activations(model)
        self.actor = self._make_trainable(model, self.spec.actor_optim)
        self.group.register("actor", self.actor)

    def _build_ref(self) -> None:
        from transformers import AutoModelForCausalLM

        from infra.colocate import TrainableModel

        path = self.spec.reference_path or self.spec.policy_path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        fuse_activations(model)
        model.requires_grad_(False).eval()
        self.ref = TrainableModel(model, None, device=self.spec.device)
        self.group.register("ref", self.ref)

    def _build_critic(self) -> None:
        from transformers import AutoModelForTokenClassification

        path = self.spec.critic_path or self.spec.policy_path
        model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=self.dtype
        )
        fuse_activations(model)
        self.critic = self._make_trainable(model, self.spec.critic_optim)
        self.group.register("critic", self.critic)

    # ----------------------------------------------------------------- stage compute
    def ping(self) -> dict[str, Any]:
        return {
            "rank": self.spec.rank,
            "roles": list(self.spec.roles),
            "pid": os.getpid(),
            "version": self.version,
        }

    def awake_roles(self) -> list[str]:
        return self.group.awake_roles()

    def timing(self) -> dict[str, float]:
        """Wake/sleep seconds per role since the last call (``timing_s/wake/<role>`` ...)."""
        return self.group.pop_stats()

    def generate(
        self, prompts: Jagged, *, n: int, seed: int, temperature: float | None = None
    ) -> tuple[Jagged, Jagged, int]:
        """Sample ``n`` responses per prompt; returns responses, rollout logprobs, policy version.

        ``temperature`` overrides the rollout setting (0 = greedy, used by evaluation)."""
        cfg = self.spec.rollout
        with self.group.awake("rollout"):
            out = self.engine.generate(
                prompts.rows(),
                n=n,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature if temperature is None else temperature,
                top_p=cfg.top_p,
                seed=seed,
                min_new_tokens=cfg.min_new_tokens if temperature is None else 0,
            )
        return (
            Jagged.from_rows(out.response_ids),
            Jagged.from_rows(out.rollout_logprobs),
            self.version,
        )

    def score(
        self, prompts: Jagged, responses: Jagged, raw_prompt: list[Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Reward-model score per sample and whether its re-tokenised input was truncated."""
        with self.group.awake("reward"):
            out = self.scorer.score(
                prompt_ids=prompts.rows(), response_ids=responses.rows(), raw_prompt=raw_prompt
            )
        return out.scores.float().numpy(), out.truncated.numpy()

    def _packed(self, prompts: Jagged, responses: Jagged) -> Any:
        from tasks.batching import pack_batch

        return pack_batch(
            prompt_ids=prompts.rows(), response_ids=responses.rows(), pad_id=self.pad_id
        )

    @torch.no_grad()
    def _micro_forward(
        self,
        model: torch.nn.Module,
        batch: Any,
        micro: int,
        gather: Callable[[Tensor, Any], Tensor],
    ) -> Tensor:
        """``gather(logits, micro_batch)`` over micro-batches of ``batch``, concatenated."""
        outs = []
        for start in range(0, batch.input_ids.shape[0], micro):
            mb = batch.slice(start, start + micro)
            logits = model(
                input_ids=mb.input_ids.to(self.device),
                attention_mask=mb.attention_mask.long().to(self.device),
            ).logits
            outs.append(gather(logits, mb))
        return torch.cat(outs)

    def _logprobs(self, model: torch.nn.Module, batch: Any, micro: int) -> Tensor:
        from tasks.batching import gather_response_logprobs

        def gather(logits: Tensor, mb: Any) -> Tensor:
            return gather_response_logprobs(
                logits=logits.float().cpu(), batch=mb, temperature=self._temperature
            )

        return self._micro_forward(model, batch, micro, gather)

    @property
    def _temperature(self) -> float:
        return self.spec.rollout.temperature or 1.0

    def _values(self, batch: Any, micro: int) -> Tensor:
        from tasks.batching import gather_response_values

        def gather(logits: Tensor, mb: Any) -> Tensor:
            return gather_response_values(values=logits[..., 0].float().cpu(), batch=mb)

        return self._micro_forward(self.critic.module, batch, micro, gather)

    def forward(
        self, prompts: Jagged, responses: Jagged, *, actor: bool = True
    ) -> dict[str, Jagged]:
        """``old_logprobs`` (actor, unless ``actor=False``), ``ref_logprobs`` (reference) and
        ``values`` (critic) for the roles held."""
        from tasks.batching import unpad

        batch = self._packed(prompts, responses)
        lengths = batch.response_lengths
        out: dict[str, Jagged] = {}
        micro = max(self.spec.actor_optim.micro_batch_size, 1)
        if actor and "actor" in self.spec.roles:
            with self.group.awake("actor"):
                out["old_logprobs"] = Jagged.from_rows(
                    unpad(self._logprobs(self.actor.module, batch, micro), lengths)
                )
        if "ref" in self.spec.roles:
            with self.group.awake("ref"):
                out["ref_logprobs"] = Jagged.from_rows(
                    unpad(self._logprobs(self.ref.module, batch, micro), lengths)
                )
        if "critic" in self.spec.roles:
            with self.group.awake("critic"):
                out["values"] = Jagged.from_rows(unpad(self._values(batch, micro), lengths))
        return out

    def _global_units(self, batch: Any, mini_batch_size: int, agg: str) -> list[float] | None:
        """Each mini-batch's loss denominator summed over data-parallel workers (None: one worker)."""
        if self.spec.world_size == 1:
            return None
        import torch.distributed as dist

        from tasks.update.optimize import count_minibatch_units

        units = torch.tensor(
            count_minibatch_units(
                response_mask=batch.response_mask, mini_batch_size=mini_batch_size, agg=agg
            ),
            dtype=torch.float64,
        )
        dist.all_reduce(units, op=dist.ReduceOp.SUM)
        return units.tolist()

    def _reducer(self) -> Any:
        if self.spec.world_size == 1:
            return None
        from tasks.update.optimize import sync_gradients

        world = self.spec.world_size
        return lambda model: sync_gradients(model, world)

    def update(
        self, prompts: Jagged, responses: Jagged, fields: dict[str, Jagged]
    ) -> dict[str, float]:
        """One PPO update of the actor (and critic) on this worker's shard of the batch."""
        from infra.trainer_settings import actor_settings, critic_settings
        from tasks.update.optimize import actor_update, critic_update

        batch = self._packed(prompts, responses)
        width = batch.response_mask.shape[1]

        def padded(name: str) -> Tensor:
            return fields[name].padded(width=width).float()

        metrics: dict[str, float] = {}
        acfg = actor_settings(self.spec)
        units = self._global_units(batch, acfg.mini_batch_size, acfg.agg)
        with self.group.awake("actor"):
            metrics.update(
                actor_update(
                    model=self.actor.module,
                    optimizer=self.actor.optimizer,
                    scheduler=self.actor.scheduler,
                    batch=batch,
                    old_logprobs=padded("old_logprobs") if "old_logprobs" in fields else None,
                    advantages=padded("advantages"),
                    ref_logprobs=padded("ref_logprobs") if "ref_logprobs" in fields else None,
                    cfg=acfg,
                    grad_reducer=self._reducer(),
                    global_tokens=units,
                    global_seqs=units,
                )
            )
        if "critic" in self.spec.roles:
            ccfg = critic_settings(self.spec)
            units = self._global_units(batch, ccfg.mini_batch_size, ccfg.agg)
            with self.group.awake("critic"):
                metrics.update(
                    critic_update(
                        model=self.critic.module,
                        optimizer=self.critic.optimizer,
                        scheduler=self.critic.scheduler,
                        batch=batch,
                        old_values=padded("values"),
                        returns=padded("returns"),
                        cfg=ccfg,
                        grad_reducer=self._reducer(),
                        global_tokens=units,
                        global_seqs=units,
                    )
                )
        self.version += 1
        if "rollout" in self.spec.roles:
            self.engine.load_weights(self.actor.module.state_dict())
        return metrics

    # ----------------------------------------------------------------- weights and checkpoints
    def policy_state(self) -> dict[str, np.ndarray]:
        """The actor's weights as numpy arrays (zero-copy through Ray) for another pool's engine."""
        return {k: v.detach().cpu().numpy() for k, v in self.actor.module.state_dict().items()}

    def load_policy(self, state: dict[str, np.ndarray], version: int) -> None:
        self.engine.load_weights({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
        self.version = version

    def parameters_digest(self) -> dict[str, float]:
        """Per-tensor sums of the actor's weights (tests compare runs with these)."""
        return {k: float(v.double().sum()) for k, v in self.actor.module.state_dict().items()}

    def save_checkpoint(self, path: str) -> None:
        """Models (save_pretrained), optimizer and scheduler states, RNG states of this worker."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {
            "version": self.version,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        if "actor" in self.spec.roles:
            if self.spec.rank == 0:
                self.actor.module.save_pretrained(out / "actor", safe_serialization=True)
                self.tokenizer.save_pretrained(out / "actor")
            state["actor_optimizer"] = self.actor.optimizer.state_dict()
            state["actor_scheduler"] = self.actor.scheduler.state_dict()
        if "critic" in self.spec.roles:
            if self.spec.rank == 0:
                self.critic.module.save_pretrained(out / "critic", safe_serialization=True)
            state["critic_optimizer"] = self.critic.optimizer.state_dict()
            state["critic_scheduler"] = self.critic.scheduler.state_dict()
        torch.save(state, out / f"worker-{self.spec.rank}.pt")

    def load_checkpoint(self, path: str) -> int:
        """Restore what ``save_checkpoint`` wrote; returns the policy version."""
        src = Path(path)
        state = torch.load(src / f"worker-{self.spec.rank}.pt", weights_only=False)
        if "actor" in self.spec.roles:
            _load_weights(self.actor.module, src / "actor" / "model.safetensors")
            self.actor.optimizer.load_state_dict(state["actor_optimizer"])
            self.actor.scheduler.load_state_dict(state["actor_scheduler"])
            if "rollout" in self.spec.roles:
                self.engine.load_weights(self.actor.module.state_dict())
        if "critic" in self.spec.roles:
            _load_weights(self.critic.module, src / "critic" / "model.safetensors")
            self.critic.optimizer.load_state_dict(state["critic_optimizer"])
            self.critic.scheduler.load_state_dict(state["critic_scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.version = int(state["version"])
        return self.version
