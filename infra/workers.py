"""The worker that holds the models of one device and runs the stages' worker-side steps on it.

A ``ModelWorker`` owns some of the roles ``rollout`` (generation engine), ``reward`` (reward
model, or an ensemble whose members wake and sleep together), ``judge`` (an LLM judge,
``infra.judge_model``), ``teacher`` (on-policy distillation's frozen teacher), ``actor`` (policy +
optimizer), ``ref`` (frozen reference policy) and ``critic`` (value model + optimizer), and a
handle on the run's store. It knows nothing of the stages: a stage hands it a function,
``worker.run(fn, shard, ...)`` calls ``fn(worker, shard, ...)`` in the worker's process, and
that function runs the stage's declared steps (``tasks.step.run_steps``): read the shard's rows
from the store, wake the role each step needs (``worker.awake``), compute, write the rows
back. The flow process moves only ``BatchMeta`` handles and metrics. Roles in one worker share
its device and take turns through a ``ColocatedGroup``: a role is put back to sleep when its
block ends, even when the compute raises. ``WorkerGroup`` (infra.group) runs workers as Ray
actors in a pool.

A worker's Ray actor runs one call at a time, so two callers (``separate_async``: the producer's
score and the trainer's update on one training pool) already take turns. ``awake`` also holds a
per-worker lock for the whole block, so two threads in one worker (a threaded actor, or direct
calls in one process) wait for each other's turn instead of waking two models at once.

Data-parallel workers (``world_size > 1``, or ``fsdp2`` on one) join a torch.distributed group
(gloo on CPU, nccl on CUDA) that meets on rank 0's node (``rendezvous_address``, ``join_group``),
so they may run on different nodes. Trained models are wrapped by their strategy
(``infra.training``): under ``fsdp2`` their parameters, gradients and optimizer state are sharded
over the group and the gradients summed (each worker's loss is already divided by the global token
or sequence count, so N workers make the same update as one).
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Literal,
    ParamSpec,
    TypeVar,
    cast,
    get_args,
    overload,
)

import numpy as np
import torch

from infra.colocate import ColocatedGroup, TrainableModel
from infra.config import OptimConfig, Strategy, TrainConfig
from infra.engines import pad_token_id, stop_token_ids
from infra.engines.probe import (
    ProbeExpectation,
    WeightSyncError,
    probe_ids,
    probe_max_abs_diff,
    trainer_probe_logprobs,
)
from infra.faults import EXIT_STATUS, WorkerFault
from infra.kernels import fuse_activations
from storage.schema import dtype_name

if TYPE_CHECKING:
    from infra.engines.base import GenerationEngine, Sleepable
    from infra.judge_model import Judge
    from infra.reward_model import RewardScorer

P = ParamSpec("P")
R = TypeVar("R")

Role = Literal["rollout", "reward", "judge", "teacher", "actor", "ref", "critic"]
ROLES: tuple[Role, ...] = get_args(Role)
SHARDABLE: tuple[Role, ...] = ("actor", "ref", "critic")  # a training strategy may shard these


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its roles (picklable: travels to the Ray actor). Settings
    come from ``cfg``, the run's config, read where they are used; ``store_url`` is the store
    the worker opens (a run's ``store.url``; a test in one process may give ``memory://``)."""

    roles: tuple[Role, ...]
    cfg: TrainConfig
    policy_path: str
    tokenizer_path: str
    store_url: str
    reference_path: str | None = None
    reward_model_path: str | tuple[str, ...] | None = None  # several: an ensemble
    critic_path: str | None = None
    judge_path: str | None = None
    judge_template: str | None = None  # the template's text (``infra.judge.template_text``)
    teacher_path: str | None = None
    rank: int = 0
    world_size: int = 1

    @property
    def trains(self) -> bool:
        """Holds the actor: a data-parallel trainer (one of ``world_size``)."""
        return "actor" in self.roles


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def lr_factor(optim: OptimConfig, total: int) -> Callable[[int], float]:
    """The learning rate of optimizer step ``step`` (from 0) over ``optim.lr``: a linear warmup
    over ``optim.warmup_steps``, then 1, or (``lr_schedule: cosine``) a cosine from 1 after the
    warmup down to ``optim.min_lr_ratio`` at step ``total - 1``, held there after it."""
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def optimizer_steps(cfg: TrainConfig, optim: OptimConfig) -> int:
    """Optimizer steps in a whole run: ``trainer.total_steps`` iterations, each ``ppo_epochs``
    passes over the mini-batches of its ``prompts_per_step × n`` samples."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n
    per_step = optim.ppo_epochs * -(-samples // optim.mini_batch_size)
    return cfg.trainer.total_steps * per_step


class ModelWorker:
    """Holds models for some roles on one device and runs worker-side steps; see the module
    docstring."""

    def __init__(self, spec: WorkerSpec) -> None:
        # 1. Process settings: threads, seeds, distributed group, the store.
        cfg = spec.cfg
        torch.set_num_threads(cfg.resources.threads_per_worker)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _seed_everything(cfg.seed + 1000 * spec.rank)
        self.spec = spec
        self.cfg = cfg
        self.device = torch.device(cfg.resources.device)
        self.dtype = getattr(torch, cfg.models.dtype)
        self.group = ColocatedGroup(f"worker-{spec.rank}")
        self.turn = threading.RLock()  # held through an awake() block (module docstring)
        self.version = 0
        self.applied: dict[str, Any] = {}  # results of work applied once (see ``once``)
        # The weight-sync probe (infra.engines.probe): what the trainer expects the rollout
        # engine to answer after the last sync, checked when the engine next wakes.
        self.expected_probe: ProbeExpectation | None = None
        self.sync_stats: dict[str, float] = {}
        self.corrupt_next_sync = False  # the corrupt_sync fault (infra.faults)
        from storage import open_store

        self.store = open_store(spec.store_url)
        # 2. Models, each registered asleep in the colocated group.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(spec.policy_path).vocab_size
        self.probe = probe_ids(min(len(self.tokenizer), int(vocab)))
        self.eos_ids = stop_token_ids(self.tokenizer, spec.policy_path)
        self.pad_id = pad_token_id(self.tokenizer)
        for role in spec.roles:
            if role not in BUILDERS:
                raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        # Sharded models are built once the group exists (``join_group``); the rest now.
        self.deferred = tuple(
            r for r in spec.roles if r in SHARDABLE and self.strategy(r) == "fsdp2"
        )
        self._build([r for r in spec.roles if r not in self.deferred])

    def _build(self, roles: list[Role] | tuple[Role, ...]) -> None:
        for role in roles:
            BUILDERS[role](self)
            self.group.put_all_to_sleep()  # models load awake; each waits asleep for its turn
        if "actor" in roles and "rollout" in self.spec.roles:
            # The engine and the trainer loaded the same folder: the first wake checks that too.
            with self.awake("actor") as actor:
                probe = self.trainer_probe(actor.module)
            self.expected_probe = None if probe is None else ProbeExpectation(0, probe)

    # ----------------------------------------------------------------- building roles
    def rendezvous_address(self) -> str:
        """``host:port`` on this worker's node where the data-parallel group meets (rank 0's)."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        # ray's get_node_ip_address is unannotated
        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return f"{host}:{port}"

    def join_group(self, address: str) -> None:
        """Join the data-parallel torch.distributed group meeting at ``address``, then build the
        models it shards (``deferred``)."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=self.spec.rank,
            world_size=self.spec.world_size,
        )
        self._build(self.deferred)

    def _build_rollout(self) -> None:
        from infra.engines import engine_options, make_engine

        # engine_options: vLLM's rollout.gpu_memory_utilization, tensor_parallel_size and
        # max_model_len when rollout.engine == "vllm"; nothing for the transformers engine.
        self.engine = make_engine(
            self.cfg.rollout.engine,
            self.spec.policy_path,
            device=str(self.device),
            dtype=self.dtype,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            **engine_options(self.cfg.rollout),
        )
        torch.set_num_threads(
            self.cfg.resources.threads_per_worker
        )  # vLLM's CPU worker sets its own
        self.group.register("rollout", self.engine)

    def _build_reward(self) -> None:
        from infra.reward_model import RewardScorer

        assert self.spec.reward_model_path is not None, "reward role needs reward_model_path"
        self.scorer = RewardScorer(
            self.spec.reward_model_path,
            policy_tokenizer_path=self.spec.tokenizer_path,
            device=str(self.device),
            dtype=self.dtype,
            batch_size=self.cfg.reward.batch_size,
            max_tokens_per_batch=self.cfg.reward.max_tokens_per_batch,
            max_length=self.cfg.reward.max_length,
        )
        self.group.register("reward", self.scorer)

    def _build_judge(self) -> None:
        from infra.engines import vllm_options
        from infra.judge_model import Judge

        judge = self.cfg.reward.judge
        assert self.spec.judge_path is not None and judge is not None, "judge role needs both"
        assert self.spec.judge_template is not None, "judge role needs judge_template"
        self.judge = Judge(
            self.spec.judge_path,
            template=self.spec.judge_template,
            device=str(self.device),
            dtype=self.dtype,
            max_new_tokens=judge.max_new_tokens,
            temperature=judge.temperature,
            batch_size=self.cfg.reward.batch_size,
            engine=judge.engine,
            # vLLM: the rollout's memory settings, one rank, the judge model's own length limit.
            engine_options=(
                {**vllm_options(self.cfg.rollout), "tensor_parallel_size": 1, "max_model_len": None}
                if judge.engine == "vllm"
                else {}
            ),
        )
        self.group.register("judge", self.judge)

    def _build_teacher(self) -> None:
        """The distillation teacher: frozen, whole on each worker that holds it (a scoring
        model: each worker scores its own rows), in the run's compute dtype."""
        from transformers import AutoModelForCausalLM

        from infra.training import prepare_frozen

        assert self.spec.teacher_path is not None, "teacher role needs teacher_path"
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            self.spec.teacher_path, dtype=self.dtype
        )
        fuse_activations(model)
        model = prepare_frozen(model, strategy="none", device=self.device)
        self.teacher = TrainableModel(model, None, device=str(self.device))
        self.group.register("teacher", self.teacher)

    def strategy(self, role: Role) -> Strategy:
        """The training engine of ``role``'s model (the reference follows the actor)."""
        return self.cfg.strategy("critic" if role == "critic" else "actor", self.spec.world_size)

    def _make_trainable(
        self, model: torch.nn.Module, optim: OptimConfig, role: Role
    ) -> TrainableModel:
        from infra.training import prepare_trainable

        fuse_activations(model)
        module = prepare_trainable(
            model,
            strategy=self.strategy(role),
            compute_dtype=self.dtype,
            device=self.device,
            gradient_checkpointing=optim.gradient_checkpointing,
            role="critic" if role == "critic" else "actor",
        )
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            eps=1e-8,
        )
        total = optimizer_steps(self.cfg, optim)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(optim, total))
        return TrainableModel(module, optimizer, device=str(self.device), scheduler=scheduler)

    @property
    def lora(self) -> bool:
        return self.cfg.actor.lora is not None

    def _build_actor(self) -> None:
        from transformers import AutoModelForCausalLM

        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            self.spec.policy_path, dtype=torch.float32
        )
        if self.cfg.actor.lora is not None:
            from infra.lora import apply_lora

            model = apply_lora(model, self.cfg.actor.lora)
        self.actor = self._make_trainable(model, self.cfg.actor, "actor")
        self.group.register("actor", self.actor)

    @property
    def reference_is_actor(self) -> bool:
        """The reference policy is the actor with its LoRA adapter disabled (no second model):
        with LoRA, unless the reference is another folder than the policy's (a flow always names
        one: ``models.reference`` resolves to the policy's folder when unset)."""
        ref = self.spec.reference_path
        return self.lora and (
            ref is None or Path(ref).resolve() == Path(self.spec.policy_path).resolve()
        )

    def _build_ref(self) -> None:
        from transformers import AutoModelForCausalLM

        from infra.training import prepare_frozen

        if self.reference_is_actor:
            return
        path = self.spec.reference_path or self.spec.policy_path
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        fuse_activations(model)
        model = prepare_frozen(model, strategy=self.strategy("ref"), device=self.device)
        self.ref = TrainableModel(model, None, device=str(self.device))
        self.group.register("ref", self.ref)

    def _build_critic(self) -> None:
        from transformers import AutoModelForTokenClassification

        path = self.spec.critic_path or self.spec.policy_path
        model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32
        )
        self.critic = self._make_trainable(model, self.cfg.critic, "critic")
        self.group.register("critic", self.critic)

    # ----------------------------------------------------------------- running stage steps
    def run(
        self, fn: Callable[Concatenate[ModelWorker, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``fn(self, *args, **kwargs)``: a stage's worker-side step, in this process."""
        return fn(self, *args, **kwargs)

    def run_faulty(
        self,
        fault: WorkerFault,
        fn: Callable[Concatenate[ModelWorker, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``run`` with an injected fault (infra.faults): the process of rank
        ``fault.kill_rank`` exits before the step; every worker waits ``fault.delay_s`` after
        it, before replying."""
        if fault.kill_rank == self.spec.rank:
            os._exit(EXIT_STATUS)
        self.corrupt_next_sync = self.corrupt_next_sync or fault.corrupt_sync
        result = fn(self, *args, **kwargs)
        time.sleep(fault.delay_s)
        return result

    def once(self, name: str, apply: Callable[[], R]) -> R:
        """``apply()`` the first time ``name`` (e.g. ``update@12``) is asked for; every later
        call returns that first result without applying anything. A retried stage whose first
        call is still running queues behind it (a worker runs one call at a time) and then gets
        its result, so the work is applied exactly once."""
        if name not in self.applied:
            self.applied[name] = apply()
        return cast(R, self.applied[name])

    def has(self, role: Role) -> bool:
        return role in self.spec.roles

    @overload
    def awake(self, role: Literal["rollout"]) -> AbstractContextManager[GenerationEngine]: ...

    @overload
    def awake(self, role: Literal["reward"]) -> AbstractContextManager[RewardScorer]: ...

    @overload
    def awake(self, role: Literal["judge"]) -> AbstractContextManager[Judge]: ...

    @overload
    def awake(
        self, role: Literal["actor", "ref", "critic", "teacher"]
    ) -> AbstractContextManager[TrainableModel]: ...

    def awake(self, role: Role) -> AbstractContextManager[Sleepable]:
        """The model of ``role``, awake inside the block and asleep again after it; another
        thread's ``awake`` waits until the block ends (``turn``)."""
        return self._turn_awake(role)

    @contextmanager
    def _turn_awake(self, role: Role) -> Iterator[Sleepable]:
        with self.turn, self.group.awake(role) as model:
            if role == "rollout" and self.expected_probe is not None:
                self._check_sync(self.expected_probe)
            yield model

    @contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy's module, awake inside the block: the frozen reference model,
        or the actor with its LoRA adapter disabled (``reference_is_actor``)."""
        if not self.reference_is_actor:
            with self.awake("ref") as ref:
                yield ref.module
            return
        from infra.lora import adapter_disabled

        with self.awake("actor") as actor, adapter_disabled(actor.module):
            yield actor.module

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The actor's weights, whole, under the plain model's names (LoRA merged in): what a
        rollout engine loads. A collective under ``fsdp2``: every training worker calls it."""
        from infra.training import full_state_dict

        module = self.actor.module
        if self.lora:
            from infra.lora import merged_state_dict
            from infra.training import gather_full

            return merged_state_dict(module, full=gather_full)
        return full_state_dict(module)

    def trainer_probe(
        self, module: torch.nn.Module, *, for_pool: bool = False
    ) -> torch.Tensor | None:
        """The trainer's log-probs of the weight-sync probe under ``module`` (the actor, awake;
        a collective under ``fsdp2``): for this worker's own rollout engine, or ``for_pool``
        another pool's; None when there is no such engine or ``rollout.sync_check`` is off."""
        if not self.cfg.rollout.sync_check or not (for_pool or self.has("rollout")):
            return None
        return trainer_probe_logprobs(module, self.probe)

    def publish_policy(self, probe: torch.Tensor | None = None) -> None:
        """After an update: a new policy version, and its weights in a colocated rollout engine,
        checked against ``probe`` (``trainer_probe``) when the engine next wakes."""
        self.version += 1
        if "rollout" in self.spec.roles:
            self._sync_engine(self.policy_weights(), probe)

    def _sync_engine(self, weights: dict[str, torch.Tensor], probe: torch.Tensor | None) -> None:
        """Load ``weights`` (policy ``self.version``) into the rollout engine; ``probe`` is what
        the engine must answer to the probe once they are in (checked at its next wake)."""
        weights = self._maybe_corrupted(weights)
        start = time.perf_counter()
        self.engine.load_weights(weights)
        self.sync_stats["sync/seconds"] = self.sync_stats.get("sync/seconds", 0.0) + (
            time.perf_counter() - start
        )
        self.sync_stats["sync/bytes"] = float(
            sum(t.numel() * t.element_size() for t in weights.values())
        )
        self.expected_probe = None if probe is None else ProbeExpectation(self.version, probe)

    def _maybe_corrupted(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``weights``, perturbed once when the ``corrupt_sync`` fault is armed."""
        if not self.corrupt_next_sync:
            return weights
        self.corrupt_next_sync = False
        return _perturbed(weights)

    def _check_sync(self, expected: ProbeExpectation) -> None:
        """Score the probe with the (awake) engine and compare with the trainer's; raises
        ``WeightSyncError`` above ``rollout.sync_tolerance`` (the expectation stays: every wake
        fails the same way until another sync; stages do not retry this error)."""
        start = time.perf_counter()
        diff = probe_max_abs_diff(self.engine.probe_logprobs(self.probe), expected)
        self.sync_stats["sync/seconds"] = self.sync_stats.get("sync/seconds", 0.0) + (
            time.perf_counter() - start
        )
        self.sync_stats["sync/probe_max_abs_diff"] = diff
        tolerance = self.cfg.sync_tolerance
        if not diff <= tolerance:
            raise WeightSyncError(
                f"policy version {expected.version}: the rollout engine's log-probs of the "
                f"weight-sync probe differ from the trainer's by {diff:.4g} (more than "
                f"rollout.sync_tolerance={tolerance:g}): the engine is not serving the weights "
                "it was sent"
            )
        self.expected_probe = None

    def pop_sync_stats(self) -> dict[str, float]:
        """``sync/*`` metrics of the last sync and probe check, then reset."""
        stats, self.sync_stats = self.sync_stats, {}
        return stats

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
        """Wake/sleep seconds per role since the last call (``timing_s/wake/<role>`` ...), and
        the ``sync/*`` metrics of a rollout engine this worker holds."""
        return {**self.group.pop_stats(), **self.pop_sync_stats()}

    # ----------------------------------------------------------------- weights and checkpoints
    def policy_state(self) -> PolicySnapshot:
        """The actor's weights as numpy arrays (zero-copy through Ray) for another pool's engine,
        with the trainer's probe log-probs: rank 0's reply; every training worker takes part in
        gathering them (and in the probe's forward) and the others reply with nothing."""
        weights = self.policy_weights()
        with self.awake("actor") as actor:
            probe = self.trainer_probe(actor.module, for_pool=True)
        weights = self._maybe_corrupted(weights)
        if self.spec.rank != 0:
            return PolicySnapshot({}, None)
        return PolicySnapshot(
            {k: v.cpu().numpy() for k, v in weights.items()},
            None if probe is None else probe.numpy(),
        )

    def load_policy(self, snapshot: PolicySnapshot, version: int) -> dict[str, float]:
        """Load another pool's policy ``version`` into this worker's engine and check it with the
        probe at once; returns the ``sync/*`` metrics."""
        self.version = version
        weights = {k: torch.from_numpy(np.array(v)) for k, v in snapshot.weights.items()}
        probe = None if snapshot.probe is None else torch.from_numpy(snapshot.probe)
        self._sync_engine(weights, probe)
        with self.awake("rollout"):
            pass  # waking checks the probe (``_turn_awake``)
        return self.pop_sync_stats()

    def parameters_digest(self) -> dict[str, float]:
        """Per-tensor sums of the actor's weights, whole (tests compare runs with these; a
        collective under ``fsdp2``)."""
        from infra.training import full_state_dict

        return {k: float(v.double().sum()) for k, v in full_state_dict(self.actor.module).items()}

    def _save_hf(self, role: str, out: Path) -> None:
        """A ``save_pretrained`` folder of ``role``'s model, written by rank 0 from the whole
        state in ``models.dtype`` (the actor with its LoRA adapter merged, plus the adapter
        alone in ``actor-adapter/``)."""
        from infra.training import full_state_dict, plain_model

        trained = getattr(self, role)
        module = trained.module
        if role == "actor" and self.lora:
            from infra.lora import adapter_state_dict, merged_state_dict, save_adapter
            from infra.training import gather_full

            weights = merged_state_dict(module, full=gather_full)
            adapter = adapter_state_dict(module, full=gather_full)
            if self.spec.rank == 0:
                save_adapter(module, out / "actor-adapter", state=adapter)
        else:
            weights = full_state_dict(module)
        if self.spec.rank != 0:
            return
        cast = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in weights.items()}
        plain_model(module).save_pretrained(out / role, state_dict=cast, safe_serialization=True)
        # save_pretrained records the parameters' dtype (float32 masters); the folder holds these.
        config = out / role / "config.json"
        fields = json.loads(config.read_text())
        fields["dtype"] = dtype_name(self.dtype)
        config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
        if role == "actor":
            self.tokenizer.save_pretrained(out / role)

    def save_checkpoint(self, path: str) -> None:
        """Each trained model twice: its sharded state with the optimizer's (DCP, ``dcp/<role>``,
        reshardable to another worker count) and a ``save_pretrained`` folder (``<role>/``);
        then this worker's scheduler and RNG states and the policy version (``worker-<rank>.pt``).
        Every training worker calls it."""
        from infra.training import save_sharded

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {
            "version": self.version,
            "world_size": self.spec.world_size,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        for role in ("actor", "critic"):
            if role in self.spec.roles:
                trained = getattr(self, role)
                save_sharded(out / "dcp" / role, trained.module, trained.optimizer)
                self._save_hf(role, out)
                state[f"{role}_scheduler"] = trained.scheduler.state_dict()
        torch.save(state, out / f"worker-{self.spec.rank}.pt")

    def load_checkpoint(self, path: str) -> int:
        """Restore what ``save_checkpoint`` wrote, by any number of workers; returns the policy
        version. A worker whose rank did not save keeps its own seeded RNG streams."""
        from infra.training import load_sharded

        src = Path(path)
        own = src / f"worker-{self.spec.rank}.pt"
        state = torch.load(own if own.exists() else src / "worker-0.pt", weights_only=False)
        self.applied.clear()  # work recorded after the checkpoint is undone by loading it
        for role in ("actor", "critic"):
            if role in self.spec.roles:
                trained = getattr(self, role)
                load_sharded(src / "dcp" / role, trained.module, trained.optimizer)
                trained.scheduler.load_state_dict(state[f"{role}_scheduler"])
        if "actor" in self.spec.roles and "rollout" in self.spec.roles:
            with self.awake("actor") as actor:
                probe = self.trainer_probe(actor.module)
            self.version = int(state["version"])
            self._sync_engine(self.policy_weights(), probe)
        if own.exists():
            torch.set_rng_state(state["rng"]["torch"])
            np.random.set_state(state["rng"]["numpy"])
            random.setstate(state["rng"]["python"])
        self.version = int(state["version"])
        return self.version


@dataclass(frozen=True)
class PolicySnapshot:
    """A policy version on its way to another pool's rollout engine: the weights (HF names) and
    the trainer's log-probs of the weight-sync probe (None: ``rollout.sync_check`` is off)."""

    weights: dict[str, np.ndarray]
    probe: np.ndarray | None


def _perturbed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with noise added to a copy of the largest floating tensor that no other entry
    repeats (a tied output head arrives twice and an engine keeps either copy): the
    ``corrupt_sync`` fault, a broken sync the probe must catch."""

    def repeated(name: str) -> bool:
        value = weights[name]
        return any(
            other != name and v.shape == value.shape and torch.equal(v, value)
            for other, v in weights.items()
        )

    name = max(
        (k for k, v in weights.items() if v.is_floating_point() and not repeated(k)),
        key=lambda k: weights[k].numel(),
    )
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(weights[name].shape, generator=generator)
    return {**weights, name: weights[name] + noise.to(weights[name])}


# How each role's model is built, one entry per role.
BUILDERS: dict[Role, Callable[[ModelWorker], None]] = {
    "rollout": ModelWorker._build_rollout,
    "reward": ModelWorker._build_reward,
    "judge": ModelWorker._build_judge,
    "teacher": ModelWorker._build_teacher,
    "actor": ModelWorker._build_actor,
    "ref": ModelWorker._build_ref,
    "critic": ModelWorker._build_critic,
}
