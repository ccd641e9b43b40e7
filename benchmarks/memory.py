"""Benchmark: peak memory of a PPO step under the training strategies `none` and `fsdp2`, with
and without LoRA.

Run:  .venv/bin/python benchmarks/memory.py [--steps 2] [--variants none,fsdp2,lora,lora-fsdp2]
      (`make bench-memory`; --help for the sampling period, the allocator setting, a work folder)

Workload: a policy of about 50M parameters (a Llama of hidden 512, 16 layers, intermediate
1408, on the built-in task's character tokenizer), built locally and saved with
`save_pretrained`; the critic is the policy's weights with a value head (`models.critic` unset)
and the reference is the policy. Each variant is a real training run, `flows.train.ppo_train`
in this process on a Ray instance this script starts: PPO with a critic
(`algorithm.estimator=gae`), a KL loss against the reference (`algorithm.kl.loss_coef=0.05`)
and the addition reward function (`infra/presets/examples/addition_reward.py`) on the built-in
addition prompts: 4 prompts x 4 samples a step, 24 response tokens each (fixed length), one
optimizer step per batch for the actor and the critic, float32, mode `sync` (the rollout engine
shares each training worker). Variants:

    none        actor.strategy=none,  1 worker
    fsdp2       actor.strategy=fsdp2, 2 workers (critic and reference sharded too)
    lora        actor.lora (rank 16, all-linear), strategy none, 1 worker
    lora-fsdp2  actor.lora (rank 16, all-linear), strategy fsdp2, 2 workers

With LoRA the reference is the actor with its adapter disabled: no reference model is built.

Measured, per Ray `ModelWorker` process of the run (found by its process title among this
script's descendants; its rank and roles come from `ModelWorker.ping`, which names its pid):

- peak RSS per phase: `load` (start until the first step), `steps` (the PPO steps: evaluation,
  generate, score, logprobs, advantage, update, policy sync), `end` (final checkpoint, shutdown).
  The exact figure is the kernel's high-water mark (`VmHWM`), reset at each phase boundary
  (`/proc/PID/clear_refs`); RSS is also sampled with psutil every `--period-ms` (the sampled
  peak, a lower bound, and its private part: RSS minus file-backed and shared pages);
- the same high-water mark around each worker-group call, named by the step function it runs
  (`generate_rows`, `score_rows`, `forward_rows` (reference log-probs and values),
  `advantage_rows`, `update_rows` (actor and critic updates, then the rollout's weight sync)),
  with the RSS and its anonymous / file / shared parts after the call;
- the sum over the run's workers;
- the RSS of an idle worker: a `ModelWorker` with no roles that has imported what the roles
  import (torch, transformers, peft, the stages), so that RSS minus it is model memory.

Weights load as views of the memory-mapped safetensors files: they enter RSS (as file-backed
pages) when first touched, not when loaded, and a trained model's pages become private memory
when the optimizer first writes them. The workers run with glibc's `MALLOC_MMAP_THRESHOLD_`
fixed (`--mmap-threshold`, 64 KiB by default; 0 keeps glibc's dynamic threshold): blocks from
that size are mapped and returned to the system when freed, so RSS follows the live tensors.
Under the dynamic threshold freed activations can stay in the heap, pinned by smaller live
blocks, so peaks vary from one run to the next; the actor + reference measurement below shows
both settings.

Analytic bytes per worker, from the models themselves (parameter counts; under `fsdp2` each
parameter's dim-0 shard of the world size): parameters of the rollout engine (a full copy on
every worker), actor, reference and critic; gradients and AdamW state (two float32 tensors) of
the trainable parameters. Gradients exist during one model's update only (the update sets them
to None after its optimizer step), so the analytic peak of model state is parameters + AdamW
state + the larger of the two gradient sets. Activations, the batch, the KV cache and the
allocator's slack come on top of it.

Actor + reference alone (the LoRA question): in a fresh subprocess each, a `ModelWorker` with
roles ("actor", "ref") is built with and without `actor.lora` (the reference named as the
policy's folder, as a flow names it), then takes one update-like step
(a reference forward, an actor forward and backward, an AdamW step) on a batch of the run's
shape; reported: RSS growth over the imports after building and at the step's peak, and the
bytes of the tensors it holds (parameters by model, gradients, optimizer state, and the
activations autograd saved for the backward pass), under both allocator settings.

Prints tables and writes `benchmarks/results/memory.json`. RSS on a CPU machine counts what the
allocator holds, not only live tensors; the JSON records the machine and its load.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "memory.json"
REWARD_FILE = ROOT / "infra" / "presets" / "examples" / "addition_reward.py"
MIB = 2**20
FLOAT32 = 4
PHASES = ("load", "steps", "end")
WORKER_TITLE = "ray::ModelWorker"
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
# What a training worker imports before holding any model (the idle baseline imports these).
WORKER_MODULES = (
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers.models.llama.modeling_llama",
    "peft",
    "infra.workers",
    "infra.training",
    "infra.lora",
    "infra.engines.hf",
    "tasks.generate.stage",
    "tasks.score.stage",
    "tasks.logprobs.stage",
    "tasks.advantage.stage",
    "tasks.update.stage",
)


@dataclass(frozen=True)
class Shape:
    """The policy's Llama shape (about 50M parameters with the 21-token character vocabulary)."""

    hidden: int = 512
    layers: int = 16
    heads: int = 8
    intermediate: int = 1408
    max_positions: int = 64


@dataclass(frozen=True)
class Work:
    """One PPO step's batch and the LoRA adapter of the LoRA variants."""

    prompts_per_step: int = 4
    n: int = 4
    response_tokens: int = 24
    kl_loss_coef: float = 0.05
    lora_rank: int = 16
    lora_alpha: float = 32.0


@dataclass(frozen=True)
class Variant:
    name: str
    strategy: str
    workers: int
    lora: bool


VARIANTS = {
    v.name: v
    for v in (
        Variant("none", "none", 1, False),
        Variant("fsdp2", "fsdp2", 2, False),
        Variant("lora", "none", 1, True),
        Variant("lora-fsdp2", "fsdp2", 2, True),
    )
}
SHAPE, WORK = Shape(), Work()


# -- process memory ------------------------------------------------------------------------------


def status_kib(pid: int | str, field: str) -> int | None:
    """A ``VmRSS``/``VmHWM``-style field of /proc/PID/status, in KiB (None: process gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def rss_parts(pid: int | str) -> dict[str, float]:
    """The process's RSS now and its anonymous, file-backed and shared-memory parts (MiB)."""
    names = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    parts = {}
    for field, name in names.items():
        kib = status_kib(pid, field)
        if kib is not None:
            parts[name] = round(kib / 1024, 1)
    return parts


def reset_peak(pid: int | str) -> bool:
    """Reset the process's RSS high-water mark to its current RSS (Linux, same user)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def mib(n_bytes: float | None) -> float | None:
    return None if n_bytes is None else round(n_bytes / MIB, 1)


class WorkerMemory(threading.Thread):
    """Samples the RSS of this process's Ray ``ModelWorker`` descendants every ``period_s``,
    keeping per-process peaks per phase; ``switch(phase)`` closes a phase with each process's
    exact high-water mark and resets it for the next."""

    def __init__(self, period_s: float) -> None:
        super().__init__(daemon=True)
        import psutil

        self.period_s = period_s
        self.root = psutil.Process(os.getpid())
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.clear()

    def clear(self) -> None:
        """Forget every process (a new run starts)."""
        with self.lock:
            self.phase = "load"
            self.procs: dict[int, Any] = {}
            self.sampled: dict[int, dict[str, int]] = {}  # pid -> "rss/steps" ... -> peak
            self.hwm: dict[int, dict[str, int]] = {}  # pid -> phase -> VmHWM (closed windows)
            self.calls: dict[int, dict[str, int]] = {}  # pid -> "steps/update_rows" -> VmHWM
            self.after: dict[int, dict[str, dict[str, float]]] = {}  # RSS parts after the call
            self.last_hwm: dict[int, int] = {}  # pid -> latest VmHWM read (the open phase)
            self.total: dict[str, int] = {}  # "rss/steps" ... -> peak of the sum over workers
            self.resets_ok = True

    def discover(self) -> None:
        import psutil

        for child in self.root.children(recursive=True):
            if child.pid in self.procs:
                continue
            try:
                title = " ".join(child.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if title.startswith(WORKER_TITLE):
                self.procs[child.pid] = child

    def sample(self) -> None:
        import psutil

        total = 0
        for pid, proc in list(self.procs.items()):
            try:
                info = proc.memory_info()  # /proc/PID/statm: cheap (smaps would not be)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                del self.procs[pid]
                continue
            hwm = status_kib(pid, "VmHWM")
            if hwm is not None:
                self.last_hwm[pid] = hwm * 1024
            peaks = self.sampled.setdefault(pid, {})
            for kind, value in (("rss", info.rss), ("private", info.rss - info.shared)):
                key = f"{kind}/{self.phase}"
                peaks[key] = max(peaks.get(key, 0), value)
            total += info.rss
        key = f"rss/{self.phase}"
        self.total[key] = max(self.total.get(key, 0), total)

    def run(self) -> None:
        tick = 0
        while not self.stopped.wait(self.period_s):
            with self.lock:
                if tick % 10 == 0:
                    self.discover()
                self.sample()
            tick += 1

    def close_window(self, label: str | None = None) -> None:
        """Read every process's high-water mark since the last reset into its phase's peak (and
        into ``label``'s, a worker call's, when given), then reset it."""
        with self.lock:
            self.discover()
            self.sample()
            for pid in list(self.procs):
                hwm = status_kib(pid, "VmHWM")
                if hwm is not None:
                    own = self.hwm.setdefault(pid, {})
                    own[self.phase] = max(own.get(self.phase, 0), hwm * 1024)
                    if label is not None:
                        key, calls = f"{self.phase}/{label}", self.calls.setdefault(pid, {})
                        calls[key] = max(calls.get(key, 0), hwm * 1024)
                        self.after.setdefault(pid, {})[key] = rss_parts(pid)
                self.resets_ok &= reset_peak(pid)
            self.last_hwm.clear()

    def switch(self, phase: str) -> None:
        """Close the current phase (exact peaks from VmHWM), reset the peaks, open ``phase``."""
        self.close_window()
        with self.lock:
            self.phase = phase

    def finish(self) -> None:
        """Close the last phase with the latest high-water marks read (its processes are gone)."""
        with self.lock:
            for pid, value in self.last_hwm.items():
                own = self.hwm.setdefault(pid, {})
                own[self.phase] = max(own.get(self.phase, 0), value)

    def stop(self) -> None:
        self.stopped.set()
        self.join()


# -- models and analytic bytes -------------------------------------------------------------------


def build_policy(work: Path) -> dict[str, Any]:
    """The built-in task's assets (its prompts) and the ~50M policy with the character
    tokenizer in ``work/policy``; returns parameter counts and shapes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

    from infra.assets import build_char_tokenizer, build_tiny_assets
    from infra.config import LoraConfig
    from infra.lora import apply_lora

    build_tiny_assets(work / "tiny-assets", seed=0)
    folder = work / "policy"
    tokenizer = build_char_tokenizer(folder, variant="policy")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=SHAPE.hidden,
        num_hidden_layers=SHAPE.layers,
        num_attention_heads=SHAPE.heads,
        num_key_value_heads=SHAPE.heads,
        intermediate_size=SHAPE.intermediate,
        max_position_embeddings=SHAPE.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(policy.generation_config, key, getattr(tokenizer, key))
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shapes = {"policy": [tuple(p.shape) for p in policy.parameters()]}
    critic_config = copy.deepcopy(config)
    critic_config.num_labels = 1
    with torch.device("meta"):
        critic = LlamaForTokenClassification(critic_config)
    shapes["critic"] = [tuple(p.shape) for p in critic.parameters()]
    lora = apply_lora(policy, LoraConfig(rank=WORK.lora_rank, alpha=WORK.lora_alpha))
    shapes["lora_actor"] = [tuple(p.shape) for p in lora.parameters()]
    shapes["lora_adapter"] = [tuple(p.shape) for p in lora.parameters() if p.requires_grad]
    counts = {k: sum(math.prod(s) for s in v) for k, v in shapes.items()}
    return {"shapes": shapes, "params": counts, "vocab": len(tokenizer)}


def shard_numel(shapes: list[tuple[int, ...]], world: int) -> int:
    """Elements one worker holds when each parameter is split on dim 0 over ``world`` workers
    (FSDP2 pads dim 0 up to a multiple of the world size)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        total += math.ceil(rows / world) * (math.prod(shape) // max(rows, 1))
    return total


def analytic(models: dict[str, Any], variant: Variant) -> dict[str, int]:
    """Bytes of model state one worker of ``variant`` holds (see the module docstring)."""
    shapes, world = models["shapes"], variant.workers if variant.strategy == "fsdp2" else 1
    whole = shard_numel(shapes["policy"], 1)
    actor_shapes = shapes["lora_actor"] if variant.lora else shapes["policy"]
    trainable = shapes["lora_adapter"] if variant.lora else shapes["policy"]
    out = {
        "rollout_params": whole * FLOAT32,
        "actor_params": shard_numel(actor_shapes, world) * FLOAT32,
        "actor_grads": shard_numel(trainable, world) * FLOAT32,
        "actor_adamw": 2 * shard_numel(trainable, world) * FLOAT32,
        "ref_params": 0 if variant.lora else shard_numel(shapes["policy"], world) * FLOAT32,
        "critic_params": shard_numel(shapes["critic"], world) * FLOAT32,
        "critic_grads": shard_numel(shapes["critic"], world) * FLOAT32,
        "critic_adamw": 2 * shard_numel(shapes["critic"], world) * FLOAT32,
    }
    params = sum(v for k, v in out.items() if k.endswith("_params"))
    adamw = out["actor_adamw"] + out["critic_adamw"]
    out["params"] = params
    out["grads_peak"] = max(out["actor_grads"], out["critic_grads"])
    out["adamw"] = adamw
    out["state_peak"] = params + adamw + out["grads_peak"]
    return out


# -- the runs ------------------------------------------------------------------------------------


def overrides(work: Path, variant: Variant, steps: int) -> list[str]:
    batch = WORK.prompts_per_step * WORK.n
    optim = [
        f"mini_batch_size={batch}",
        f"micro_batch_size={batch}",
        f"strategy={variant.strategy}",
    ]
    lora = (
        [f"actor.lora={{rank: {WORK.lora_rank}, alpha: {WORK.lora_alpha}}}"] if variant.lora else []
    )
    return [
        f"name=memory-{variant.name}",
        "seed=0",
        f"run_dir={work / 'runs' / variant.name}",
        f"models.assets_dir={work / 'tiny-assets'}",
        f"models.policy={work / 'policy'}",
        f"models.tokenizer={work / 'policy'}",
        "warmstart.enabled=false",
        f"reward.functions=[{{path: {REWARD_FILE}, name: compute_score}}]",
        "reward.function_workers=1",
        f"rollout.prompts_per_step={WORK.prompts_per_step}",
        f"rollout.n={WORK.n}",
        f"rollout.max_new_tokens={WORK.response_tokens}",
        f"rollout.min_new_tokens={WORK.response_tokens}",
        "algorithm.estimator=gae",
        "algorithm.lam=0.95",
        f"algorithm.kl.loss_coef={WORK.kl_loss_coef}",
        *[f"actor.{o}" for o in optim],
        *[f"critic.{o}" for o in optim],
        *lora,
        f"resources.num_workers={variant.workers}",
        "resources.threads_per_worker=1",
        f"store.url=ray://memory-{variant.name}?shards=1",
        f"trainer.total_steps={steps}",
        "trainer.eval_every=1000000",
        "trainer.eval_prompts=1",
        "trainer.checkpoint_every=1000000",
        "trainer.resume=never",
        "trainer.progress_bar=false",
    ]


class Hooks:
    """Phase marks from the flow's report (first step started, last step logged), a peak window
    around every worker-group call (named by the step function or method it runs: the stages'
    ``generate_rows``, ``forward_rows``, ``update_rows`` ...), and the pids, ranks and roles of
    every worker group the run starts (``ModelWorker.ping``)."""

    def __init__(self, sampler: WorkerMemory) -> None:
        self.sampler = sampler
        self.workers: list[dict[str, Any]] = []
        self.marks: dict[str, float] = {}

    def install(self) -> None:
        from flows.report import RunReport
        from infra.group import WorkerGroup
        from infra.workers import ModelWorker

        hooks, start, log, group_start = self, RunReport.start, RunReport.log, WorkerGroup.start

        def report_start(report: Any, step: int) -> None:
            start(report, step)
            hooks.marks["steps"] = time.perf_counter()
            hooks.sampler.switch("steps")

        def report_log(report: Any, step: int, metrics: dict[str, float]) -> None:
            log(report, step, metrics)
            if step + 1 >= report.total:
                hooks.marks["end"] = time.perf_counter()
                hooks.sampler.switch("end")

        def worker_group_start(group: Any) -> None:
            group_start(group)
            for info in group.call(ModelWorker.ping):
                hooks.workers.append({**info, "pool": group.pool.name})

        def windowed(method: Any) -> Any:
            def call(group: Any, *args: Any, **kwargs: Any) -> Any:
                label = next((getattr(a, "__name__", "?") for a in args if callable(a)), "?")
                hooks.sampler.close_window()
                try:
                    return method(group, *args, **kwargs)
                finally:
                    hooks.sampler.close_window(label)

            return call

        RunReport.start = report_start  # type: ignore[method-assign]
        RunReport.log = report_log  # type: ignore[method-assign]
        WorkerGroup.start = worker_group_start  # type: ignore[method-assign]
        for name in ("call", "run", "run_on", "run_each", "run_sharded"):
            setattr(WorkerGroup, name, windowed(getattr(WorkerGroup, name)))


def run_variant(
    variant: Variant, work: Path, steps: int, sampler: WorkerMemory, hooks: Hooks
) -> dict[str, Any]:
    """One training run of ``variant``; per-worker peaks by phase."""
    from flows.train import ppo_train
    from infra.config import load_config

    args = overrides(work, variant, steps)
    cfg = load_config(None, args)
    sampler.clear()
    hooks.workers, hooks.marks = [], {}
    begin = time.perf_counter()
    error = None
    try:
        summary = ppo_train(cfg)
        if summary.get("steps") != steps:
            error = f"ran {summary.get('steps')} steps, not {steps}"
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    seconds = time.perf_counter() - begin
    time.sleep(3 * sampler.period_s)
    sampler.finish()
    by_pid = {w["pid"]: w for w in hooks.workers}
    workers = []
    for pid in sorted(sampler.sampled, key=lambda p: by_pid.get(p, {}).get("rank", 99)):
        info = by_pid.get(pid, {})
        workers.append(
            {
                "pid": pid,
                "rank": info.get("rank"),
                "pool": info.get("pool"),
                "roles": info.get("roles"),
                "peak_rss_mib": {p: mib(sampler.hwm.get(pid, {}).get(p)) for p in PHASES},
                "peak_rss_by_call_mib": {k: mib(v) for k, v in sampler.calls.get(pid, {}).items()},
                "rss_after_call_mib": sampler.after.get(pid, {}),
                **{
                    f"sampled_peak_{kind}_mib": {
                        p: mib(sampler.sampled[pid].get(f"{kind}/{p}")) for p in PHASES
                    }
                    for kind in ("rss", "private")
                },
            }
        )
    step_s = (
        (hooks.marks["end"] - hooks.marks["steps"]) / steps
        if {"steps", "end"} <= hooks.marks.keys()
        else None
    )
    return {
        "variant": asdict(variant),
        "command": "flows.train.ppo_train(load_config(None, overrides))",
        "overrides": [a.replace(str(work), "WORK").replace(str(ROOT), ".") for a in args],
        "error": error,
        "seconds": round(seconds, 1),
        "seconds_per_step": None if step_s is None else round(step_s, 1),
        "workers": workers,
        "peak_reset_ok": sampler.resets_ok,
        "sum_peak_rss_mib": {
            p: round(sum(w["peak_rss_mib"][p] or 0.0 for w in workers), 1) for p in PHASES
        },
        "sampled_peak_total_rss_mib": {p: mib(sampler.total.get(f"rss/{p}")) for p in PHASES},
    }


def import_worker_modules(_worker: Any = None) -> dict[str, float]:
    """Import what a training worker imports; return this process's RSS (MiB) afterwards."""
    import importlib

    for name in WORKER_MODULES:
        importlib.import_module(name)
    gc.collect()
    return {"pid": os.getpid(), "rss_mib": (status_kib("self", "VmRSS") or 0) / 1024}


def idle_baseline(work: Path, sampler: WorkerMemory) -> dict[str, Any]:
    """RSS of a ``ModelWorker`` with no roles, after the imports (a Ray actor like the runs')."""
    import ray

    from infra.config import load_config
    from infra.workers import ModelWorker, WorkerSpec

    cfg = load_config(None, overrides(work, VARIANTS["none"], 1))
    spec = WorkerSpec(
        roles=(),
        cfg=cfg,
        policy_path=str(work / "policy"),
        tokenizer_path=str(work / "policy"),
        store_url="memory://",
    )
    sampler.clear()
    worker = ray.remote(ModelWorker).options(num_cpus=0.5).remote(spec)
    try:
        reply = ray.get(worker.run.remote(import_worker_modules), timeout=300)
        time.sleep(0.5)
        reply["rss_mib"] = round(reply["rss_mib"], 1)
        reply["peak_rss_mib"] = round((status_kib(reply["pid"], "VmHWM") or 0) / 1024, 1)
        return reply
    finally:
        ray.kill(worker)


def start_ray(workers: int) -> str:
    import ray

    temp = tempfile.mkdtemp(prefix="rm")  # short: Ray's socket paths are length-limited
    ray.init(
        address="local",
        num_cpus=4,
        resources={"gpu_slot": workers},
        include_dashboard=False,
        _temp_dir=temp,
        log_to_driver=False,
        configure_logging=False,
    )
    return temp


# -- actor + reference alone (a subprocess each) -------------------------------------------------


def tensor_bytes(tensors: Any) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def actor_ref_child(work: Path, lora: bool) -> dict[str, Any]:
    """In this (fresh) process: a ``ModelWorker`` with roles actor + ref, then one update-like
    step; RSS and the bytes of what it holds."""
    import torch

    from infra.config import load_config
    from infra.workers import ModelWorker, WorkerSpec

    variant = VARIANTS["lora" if lora else "none"]
    rss = lambda: (status_kib("self", "VmRSS") or 0) * 1024  # noqa: E731
    peak = lambda: (status_kib("self", "VmHWM") or 0) * 1024  # noqa: E731
    import_worker_modules()
    cfg = load_config(None, overrides(work, variant, 1))
    torch.set_num_threads(1)
    before = rss()
    spec = WorkerSpec(
        roles=("actor", "ref"),
        cfg=cfg,
        policy_path=str(work / "policy"),
        tokenizer_path=str(work / "policy"),
        reference_path=str(work / "policy"),  # as a flow names it (models.reference unset)
        store_url="memory://",
    )
    worker = ModelWorker(spec)
    gc.collect()
    built, build_peak = rss(), peak()
    actor = worker.actor
    held = {
        "actor_params": tensor_bytes(actor.module.parameters()),
        "actor_trainable": tensor_bytes(p for p in actor.module.parameters() if p.requires_grad),
        "ref_params": tensor_bytes(worker.ref.module.parameters()) if hasattr(worker, "ref") else 0,
    }
    # One update-like step on a batch of the run's shape: prompt (9 tokens) + response.
    reset_peak("self")
    rows, width = WORK.prompts_per_step * WORK.n, 9 + WORK.response_tokens
    ids = torch.randint(
        len(worker.tokenizer), (rows, width), generator=torch.Generator().manual_seed(0)
    )
    with worker.reference() as ref, torch.no_grad():
        ref_logprobs = ref(input_ids=ids).logits.log_softmax(-1)
    params = {t.untyped_storage().data_ptr() for t in actor.module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with worker.awake("actor") as trained:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs = trained.module(input_ids=ids).logits.log_softmax(-1)
        held["activations"] = sum(saved.values())
        loss = (logprobs - ref_logprobs).pow(2).mean()
        loss.backward()
        held["grads"] = tensor_bytes(p.grad for p in trained.module.parameters())
        trained.optimizer.step()
        held["adamw"] = tensor_bytes(
            v for s in trained.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        )
        trained.optimizer.zero_grad(set_to_none=True)
    return {
        "lora": lora,
        "roles": ["actor", "ref"],
        "reference_model_built": hasattr(worker, "ref"),
        "rss_imports_mib": mib(before),
        "rss_built_mib": mib(built),
        "peak_while_building_mib": mib(build_peak),
        "peak_during_step_mib": mib(peak()),
        "built_over_imports_mib": mib(built - before),
        "step_peak_over_imports_mib": mib(peak() - before),
        "held_mib": {k: mib(v) for k, v in held.items()},
    }


def actor_ref(work: Path, threshold: int) -> dict[str, Any]:
    """``actor_ref_child`` in a fresh subprocess each: without and with LoRA, under glibc's
    default allocator and under the runs' fixed mmap threshold (when it is set)."""
    out = {}
    allocators = {"glibc-default": None, f"mmap-threshold-{threshold}": threshold}
    for allocator, value in allocators.items():
        if allocator != "glibc-default" and not threshold:
            continue
        env = {k: v for k, v in os.environ.items() if k != MMAP_THRESHOLD_ENV}
        if value:
            env[MMAP_THRESHOLD_ENV] = str(value)
        for name in ("full", "lora"):
            proc = subprocess.run(
                [sys.executable, __file__, "--actor-ref-child", name, "--work", str(work)],
                capture_output=True,
                text=True,
                timeout=600,
                env=env,
            )
            lines = proc.stdout.strip().splitlines()
            key = f"{name}/{allocator}"
            if proc.returncode != 0 or not lines:
                out[key] = {"error": " | ".join(proc.stderr.strip().splitlines()[-3:])}
            else:
                out[key] = {"allocator": allocator, **json.loads(lines[-1])}
    return out


# -- report --------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}"
    return str(value)


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header, *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for index, row in enumerate(cells):
        print(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
        if index == 0:
            print("  ".join("-" * w for w in widths))


def report(result: dict[str, Any]) -> None:
    base = result["idle_worker"]["rss_mib"]
    print(
        f"\npolicy {result['models']['params']['policy'] / 1e6:.1f}M parameters, critic "
        f"{result['models']['params']['critic'] / 1e6:.1f}M, LoRA adapter "
        f"{result['models']['params']['lora_adapter'] / 1e6:.2f}M; idle worker RSS {base:.0f} MiB"
    )
    print("\nPeak RSS of the training workers (MiB; exact VmHWM per phase)")
    rows = []
    for run in result["runs"]:
        peaks = [w["peak_rss_mib"]["steps"] for w in run["workers"]]
        load = [w["peak_rss_mib"]["load"] for w in run["workers"]]
        a = mib(run["analytic_per_worker"]["state_peak"])
        rows.append(
            [
                run["variant"]["name"],
                run["variant"]["workers"],
                " / ".join(_cell(p) for p in peaks) or "-",
                run["sum_peak_rss_mib"]["steps"],
                " / ".join(_cell(None if p is None else p - base) for p in peaks) or "-",
                a,
                " / ".join(_cell(p) for p in load) or "-",
                run["seconds_per_step"],
                run["error"] or "ok",
            ]
        )
    print_table(
        [
            "variant",
            "workers",
            "per worker, steps",
            "sum",
            "per worker - idle",
            "analytic state/worker",
            "per worker, load",
            "s/step",
            "status",
        ],
        rows,
    )
    print("\nPeak RSS of rank 0 during each stage's worker call, max over the steps (MiB)")
    labels: list[str] = []
    for run in result["runs"]:
        for key in run["workers"][0]["peak_rss_by_call_mib"] if run["workers"] else ():
            if key.startswith("steps/") and key.endswith("_rows") and key[6:] not in labels:
                labels.append(key[6:])
    print_table(
        ["variant", *labels],
        [
            [
                run["variant"]["name"],
                *[
                    run["workers"][0]["peak_rss_by_call_mib"].get(f"steps/{label}")
                    if run["workers"]
                    else None
                    for label in labels
                ],
            ]
            for run in result["runs"]
        ],
    )
    print("\nAnalytic model state per worker (MiB)")
    keys = [
        "rollout_params",
        "actor_params",
        "actor_grads",
        "actor_adamw",
        "ref_params",
        "critic_params",
        "critic_grads",
        "critic_adamw",
        "state_peak",
    ]
    print_table(
        ["variant", *keys],
        [
            [run["variant"]["name"], *[mib(run["analytic_per_worker"][k]) for k in keys]]
            for run in result["runs"]
        ],
    )
    print(
        "\nActor + reference alone: one ModelWorker(roles=actor, ref), strategy none, one "
        "update-like step (MiB)"
    )
    rows = []
    for name, r in result["actor_ref"].items():
        if "error" in r:
            rows.append([name, *["-"] * 8, r["error"]])
            continue
        held = r["held_mib"]
        total = sum(
            held[k] for k in ("actor_params", "ref_params", "grads", "adamw", "activations")
        )
        rows.append(
            [
                name,
                "yes" if r["reference_model_built"] else "no",
                held["actor_params"] + held["ref_params"],
                held["grads"],
                held["adamw"],
                held["activations"],
                total,
                r["built_over_imports_mib"],
                r["step_peak_over_imports_mib"],
            ]
        )
    print_table(
        [
            "actor / allocator",
            "ref model",
            "params",
            "grads",
            "AdamW",
            "activations",
            "sum",
            "RSS built - imports",
            "RSS step peak - imports",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="PPO steps per run")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--period-ms", type=float, default=50.0, help="RSS sampling period")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="glibc MALLOC_MMAP_THRESHOLD_ of the workers: blocks from this size are mmap'd and "
        "returned on free, so RSS follows live memory (0 = glibc's default, dynamic threshold)",
    )
    parser.add_argument("--skip-actor-ref", action="store_true")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--actor-ref-child", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }.items():
        os.environ.setdefault(key, value)
    if args.actor_ref_child:
        print(json.dumps(actor_ref_child(args.work, args.actor_ref_child == "lora")))
        return
    variants = [VARIANTS[name] for name in args.variants.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="ppoflow-memory-"))
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    load_start = round(os.getloadavg()[0], 2)
    begin = time.perf_counter()
    temp = None
    try:
        # 1. The models, the analytic figures, the actor + reference subprocesses.
        models = build_policy(work)
        actor_ref_result = {} if args.skip_actor_ref else actor_ref(work, args.mmap_threshold)
        # 2. Ray (its workers inherit the allocator setting), the sampler and the hooks; the
        # idle worker; each variant's run.
        import ray

        if args.mmap_threshold:
            os.environ[MMAP_THRESHOLD_ENV] = str(args.mmap_threshold)
        else:
            os.environ.pop(MMAP_THRESHOLD_ENV, None)
        temp = start_ray(max(v.workers for v in variants))
        sampler = WorkerMemory(args.period_ms / 1000)
        sampler.start()
        hooks = Hooks(sampler)
        hooks.install()
        idle = idle_baseline(work, sampler)
        runs = []
        for variant in variants:
            print(
                f"--- {variant.name}: {variant.workers} worker(s), strategy {variant.strategy}"
                f"{', LoRA' if variant.lora else ''}",
                flush=True,
            )
            run = run_variant(variant, work, args.steps, sampler, hooks)
            run["analytic_per_worker"] = analytic(models, variant)
            run["analytic_per_worker_mib"] = {
                k: mib(v) for k, v in run["analytic_per_worker"].items()
            }
            runs.append(run)
        sampler.stop()
        ray.shutdown()
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    import torch

    result = {
        "workload": {
            "shape": asdict(SHAPE),
            **asdict(WORK),
            "steps": args.steps,
            "dtype": "float32",
            "mode": "sync",
            "reward": "infra/presets/examples/addition_reward.py:compute_score",
            "data": "built-in addition prompts",
        },
        "models": {"params": models["params"], "vocab": models["vocab"]},
        "measurement": {
            "peak_rss": "VmHWM of each ModelWorker process, reset at phase boundaries "
            "(/proc/PID/clear_refs)",
            "sampled": f"psutil RSS every {args.period_ms:.0f} ms (private = rss - shared)",
            "allocator": f"{MMAP_THRESHOLD_ENV}={args.mmap_threshold}"
            if args.mmap_threshold
            else "glibc default (dynamic mmap threshold)",
            "phases": {
                "load": "workers starting, models built",
                "steps": "from the first step's start to the last step's metrics row",
                "end": "final checkpoint and shutdown",
            },
            "idle_worker": "a ModelWorker with no roles after importing "
            + ", ".join(WORKER_MODULES),
        },
        "idle_worker": idle,
        "runs": runs,
        "actor_ref": actor_ref_result,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
        },
        "seconds": round(time.perf_counter() - begin, 1),
    }
    report(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nwrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}"
    )


if __name__ == "__main__":
    main()
