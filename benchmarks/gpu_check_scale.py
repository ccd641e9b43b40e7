"""GPU check at scale: the vLLM engine, the colocated pool's peak memory against its parts, and
the training variants (FSDP2, bfloat16, LoRA, gradient checkpointing) through ``ppoflow train``.

The one command, from the repository root of a fresh checkout on a CUDA machine::

    bash benchmarks/gpu_check_all.sh

(it makes ``.venv-gpu``, installs vLLM first so that vLLM chooses its CUDA build of torch, then
``pip install -e '.[gpu,test]'``, and runs ``python benchmarks/gpu_check_scale.py --out
benchmarks/results``). Other ways to run this script::

    python benchmarks/gpu_check_scale.py --out benchmarks/results   # the checks, on a GPU
    python benchmarks/gpu_check_scale.py --dry-run                  # no CUDA: assets, configs, plan
    python benchmarks/gpu_check_scale.py --cpu-smoke --out DIR      # the same code on the CPU
    python benchmarks/gpu_check_scale.py --only rollout_engine,train_base --out DIR

The policy and the reward model are Llama models of about 50M parameters built locally by
``infra.assets.build_tiny_assets`` (nothing is downloaded); the prompts are addition questions
(the training runs take the built-in task's). Every check runs in a process of its own, so one that fails, hangs (timeout) or
crashes leaves the others running, and its error goes in the report:

* ``rollout_engine``: the rollout engine alone (``make_engine`` with the config's
  ``rollout.gpu_memory_utilization``, ``tensor_parallel_size`` and ``max_model_len``): a batch
  of generation (tokens/s), weight sync (vLLM: ``collective_rpc`` into the worker extension)
  with seeded samples changed by perturbed weights (tokens or log-probs) and back after
  reloading the originals, sleep/wake with ``torch.cuda.mem_get_info`` before and after, and a
  sync given while asleep.
* ``part_reward``, ``part_ref``, ``part_actor``: one ``ModelWorker`` holding just that role, with
  the training run's config, running its stage step (score, reference log-probs, PPO update) on
  a full batch of synthetic responses.
* ``train_base``, ``train_lora``, ``train_gradient_checkpointing``: ``python -m flows.cli train``
  (what ``ppoflow train`` runs) for a few steps with ``resources.device=cuda rollout.engine=vllm
  models.dtype=bfloat16 actor.strategy=fsdp2 resources.num_workers=1``, the second adding
  ``actor.lora={rank: 8}``, the third ``actor.gradient_checkpointing=true``.

Memory is sampled every 100 ms from this process, which never uses CUDA itself: with NVML
(``pynvml``) when importable, else ``nvidia-smi --query-gpu=memory.used -lms 200``. A check's
peak is the most device memory in use while it ran minus what was in use before it started, so
it counts every process of the check (Ray workers, vLLM's engine process, CUDA contexts). The
report compares ``train_base``'s peak (one colocated pool: rollout, reward, actor and reference
taking turns on one device) with the sum and the largest of its parts' peaks. Writes
``<out>/gpu-scale.json`` (``--out`` is a folder; ``gpu-scale-cpu-smoke.json`` for a CPU smoke
run) and prints a table; exits 1 when a check fails. Without CUDA (and without ``--dry-run`` or
``--cpu-smoke``) it prints that it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 1024**3
MiB = 1024**2
DEFAULT_WORKDIR = ROOT / ".ppoflow" / "gpu-check"
PART_ROLES = ("reward", "ref", "actor")
TRAIN_VARIANTS: dict[str, list[str]] = {
    "train_base": [],
    "train_lora": ["actor.lora={rank: 8}"],
    "train_gradient_checkpointing": ["actor.gradient_checkpointing=true"],
}


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Scale:
    """Model shape and batch of one kind of run (the GPU run, or the CPU smoke run)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    positions: int
    prompts_per_step: int
    n: int
    max_new_tokens: int
    micro_batch_size: int
    max_prompt_length: int
    steps: int
    timeout_s: float

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.n


GPU_SCALE = Scale(
    hidden=768,
    layers=8,
    heads=12,
    intermediate=2048,
    positions=512,
    prompts_per_step=16,
    n=8,
    max_new_tokens=64,
    micro_batch_size=32,
    max_prompt_length=64,
    steps=2,
    timeout_s=240.0,
)
SMOKE_SCALE = Scale(
    hidden=128,
    layers=2,
    heads=4,
    intermediate=256,
    positions=64,
    prompts_per_step=4,
    n=4,
    max_new_tokens=8,
    micro_batch_size=8,
    max_prompt_length=32,
    steps=2,
    timeout_s=600.0,
)


@dataclass(frozen=True)
class Setup:
    """Where everything lives and how the runs are configured."""

    workdir: Path
    scale: Scale
    device: str  # "cuda", or "cpu" for the smoke run
    engine: str  # "vllm" or "hf"

    @property
    def assets_root(self) -> Path:
        return self.workdir / f"assets-{self.scale.hidden}x{self.scale.layers}"

    @property
    def data_assets_root(self) -> Path:
        """The built-in task's default tiny assets: its prompts (the models are not used)."""
        return self.workdir / "assets-data"

    def assets(self) -> Any:
        from infra.assets import AssetPaths

        return AssetPaths.under(self.assets_root)

    def build_assets(self) -> Any:
        from infra.assets import TinyModelSpec, build_tiny_assets

        s = self.scale
        spec = TinyModelSpec(
            hidden_size=s.hidden,
            num_layers=s.layers,
            num_heads=s.heads,
            intermediate_size=s.intermediate,
            max_positions=s.positions,
        )
        build_tiny_assets(self.data_assets_root, seed=0)
        return build_tiny_assets(self.assets_root, seed=0, policy=spec, reward=spec)

    def overrides(self, run: str) -> list[str]:
        """The training run's config (every check uses it; ``run`` names its folders)."""
        s, paths = self.scale, self.assets()
        gpu = self.device == "cuda"
        return [
            f"name=gpu-check-{run}",
            f"run_dir={self.workdir / 'runs' / run}",
            f"models.policy={paths.policy}",
            f"models.reward_model={paths.reward_model}",
            f"models.assets_dir={self.data_assets_root}",
            f"models.dtype={'bfloat16' if gpu else 'float32'}",
            f"resources.device={self.device}",
            *(["resources.accelerator_resource=GPU"] if gpu else []),
            "resources.num_workers=1",
            f"rollout.engine={self.engine}",
            "rollout.gpu_memory_utilization=0.2",
            "rollout.tensor_parallel_size=1",
            f"rollout.max_model_len={s.max_prompt_length + s.max_new_tokens}",
            f"rollout.prompts_per_step={s.prompts_per_step}",
            f"rollout.n={s.n}",
            f"rollout.max_new_tokens={s.max_new_tokens}",
            f"data.max_prompt_length={s.max_prompt_length}",
            "actor.strategy=fsdp2",
            f"actor.mini_batch_size={s.batch}",
            f"actor.micro_batch_size={s.micro_batch_size}",
            f"reward.batch_size={s.batch}",
            f"trainer.total_steps={s.steps}",
            "trainer.eval_every=1000",
            "trainer.eval_prompts=16",
            "trainer.checkpoint_every=1000",
            "trainer.progress_bar=false",
            f"store.url=ray://gpu-check-{run}?shards=1",
        ]

    def config(self, run: str = "base", extra: list[str] | None = None) -> Any:
        from infra.config import load_config

        return load_config(None, [*self.overrides(run), *(extra or [])])


def _setup_from(args: argparse.Namespace) -> Setup:
    smoke = bool(args.cpu_smoke)
    engine = args.engine
    if engine == "auto":
        from infra.engines import is_vllm_available

        engine = "vllm" if (is_vllm_available() and not smoke) else "hf"
    return Setup(
        workdir=Path(args.workdir).resolve(),
        scale=SMOKE_SCALE if smoke else GPU_SCALE,
        device="cpu" if smoke else "cuda",
        engine=engine,
    )


# ----------------------------------------------------------------------------- memory
class MemorySampler:
    """Device memory in use on GPU 0 (MiB), read in a background thread: NVML when importable,
    else a long-running ``nvidia-smi -lms 200``; on a machine with neither, no readings."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.backend = "none"
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            self.backend = "nvml"
        except Exception:  # noqa: BLE001 - no NVML: try nvidia-smi
            if self._smi_once() is not None:
                self.backend = "nvidia-smi"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self.baseline_mib: float | None = None
        self.peak_mib: float | None = None

    @staticmethod
    def _smi_once() -> float | None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            return float(out.stdout.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def read_mib(self) -> float | None:
        if self.backend == "nvml":
            return float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) / MiB
        if self.backend == "nvidia-smi":
            return self._smi_once()
        return None

    def _seen(self, value: float | None) -> None:
        if value is not None:
            self.peak_mib = value if self.peak_mib is None else max(self.peak_mib, value)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._seen(self.read_mib())

    def _follow_smi(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self._seen(float(line.split(",")[0]))
            except ValueError:
                continue

    def start(self) -> None:
        self.baseline_mib = self.read_mib()
        self.peak_mib = self.baseline_mib
        self._stop.clear()
        if self.backend == "nvml":
            self._thread = threading.Thread(target=self._poll, daemon=True)
        elif self.backend == "nvidia-smi":
            self._proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=memory.used",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "200",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._thread = threading.Thread(target=self._follow_smi, daemon=True)
        if self._thread is not None:
            self._thread.start()

    def stop(self) -> dict[str, float | None]:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._seen(self.read_mib())
        base, peak = self.baseline_mib, self.peak_mib
        return {
            "baseline_gib": None if base is None else base * MiB / GiB,
            "peak_used_gib": None if peak is None else peak * MiB / GiB,
            "peak_gib": None if base is None or peak is None else (peak - base) * MiB / GiB,
        }

    def settle(self, target_mib: float | None, timeout_s: float = 60.0) -> None:
        """Wait until memory in use is back near ``target_mib`` (processes exiting late)."""
        if target_mib is None or self.backend == "none":
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self.read_mib()
            if now is None or now <= target_mib + 256:
                return
            time.sleep(1.0)


# ----------------------------------------------------------------------------- child checks
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free_gib(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    return torch.cuda.mem_get_info()[0] / GiB


def _prompts(tokenizer: Any, count: int) -> tuple[list[Any], list[list[dict[str, str]]]]:
    import torch

    raw = [[{"role": "user", "content": f"{17 * i % 1000}+{31 * i % 1000}="}] for i in range(count)]
    ids = [
        torch.tensor(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
        )
        for m in raw
    ]
    return ids, raw


def _perturbed_state(policy: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * param.detach().float().std().clamp(min=1e-3))
    return model.state_dict()


def _differ(a: Any, b: Any) -> bool:
    """Seeded samples of two weight versions differ: other tokens, or other log-probs."""
    import torch

    for ids_a, ids_b, lp_a, lp_b in zip(
        a.response_ids, b.response_ids, a.rollout_logprobs, b.rollout_logprobs, strict=True
    ):
        if not torch.equal(ids_a, ids_b) or float((lp_a - lp_b).abs().max()) > 0.05:
            return True
    return False


def _same(a: Any, b: Any) -> bool:
    """Seeded samples of the same weights agree: the tokens, and the log-probs to bf16 noise."""
    import torch

    return all(
        torch.equal(ids_a, ids_b) and torch.allclose(lp_a, lp_b, atol=2e-2, rtol=0)
        for ids_a, ids_b, lp_a, lp_b in zip(
            a.response_ids, b.response_ids, a.rollout_logprobs, b.rollout_logprobs, strict=True
        )
    )


def child_rollout_engine(setup: Setup) -> dict[str, Any]:
    """The rollout engine alone: generation, weight sync, sleep/wake memory, sync while asleep."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.engines import engine_options, make_engine, pad_token_id, stop_token_ids

    cfg = setup.config()
    paths = setup.assets()
    tokenizer = AutoTokenizer.from_pretrained(paths.tokenizer)
    options = engine_options(cfg.rollout)
    result: dict[str, Any] = {
        "engine": cfg.rollout.engine,
        "options": options,
        "vllm_v1_multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "default"),
    }
    start = time.perf_counter()
    engine = make_engine(
        cfg.rollout.engine,
        paths.policy,
        device=cfg.resources.device,
        dtype=getattr(torch, cfg.models.dtype),
        eos_token_id=stop_token_ids(tokenizer, str(paths.policy)),
        pad_token_id=pad_token_id(tokenizer),
        **options,
    )
    result["build_s"] = time.perf_counter() - start
    prompts, _ = _prompts(tokenizer, cfg.rollout.prompts_per_step)

    def fingerprint() -> Any:
        return engine.generate(prompts, n=2, max_new_tokens=16, temperature=1.0, seed=7)

    engine.generate(prompts[:2], n=1, max_new_tokens=4, seed=0)  # warm-up
    _sync(setup.device)
    start = time.perf_counter()
    out = engine.generate(
        prompts,
        n=cfg.rollout.n,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=1.0,
        seed=1,
    )
    _sync(setup.device)
    seconds = time.perf_counter() - start
    result["generate_s"] = seconds
    result["tokens_per_s"] = sum(r.numel() for r in out.response_ids) / seconds

    original = AutoModelForCausalLM.from_pretrained(paths.policy).state_dict()
    perturbed = _perturbed_state(paths.policy)
    before = fingerprint()
    start = time.perf_counter()
    engine.load_weights(perturbed)
    result["sync_s"] = time.perf_counter() - start
    result["changed_after_sync"] = _differ(before, fingerprint())
    engine.load_weights(original)
    result["restored_after_reload"] = _same(before, fingerprint())

    free_awake = _free_gib(setup.device)
    start = time.perf_counter()
    engine.sleep()
    result["sleep_s"] = time.perf_counter() - start
    free_asleep = _free_gib(setup.device)
    engine.load_weights(perturbed)  # given asleep: loaded by wake_up
    start = time.perf_counter()
    engine.wake_up()
    result["wake_s"] = time.perf_counter() - start
    free_woken = _free_gib(setup.device)
    result["changed_after_sync_while_asleep"] = _differ(before, fingerprint())
    engine.load_weights(original)
    result["restored_after_second_reload"] = _same(before, fingerprint())
    freed_ok = True
    if free_awake is not None and free_asleep is not None and free_woken is not None:
        result["free_gib_awake_asleep_woken"] = [free_awake, free_asleep, free_woken]
        result["sleep_freed_gib"] = free_asleep - free_awake
        result["wake_took_gib"] = free_asleep - free_woken
        freed_ok = result["sleep_freed_gib"] > 0
    result["sleep_frees_memory"] = freed_ok
    result["ok"] = bool(
        result["changed_after_sync"]
        and result["restored_after_reload"]
        and result["changed_after_sync_while_asleep"]
        and result["restored_after_second_reload"]
        and freed_ok
    )
    return result


def _single_process_group(device: str) -> None:
    """A torch.distributed group of one (what FSDP2 shards over), as a pool of one worker has."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )


def _fill_store(store: Any, worker: Any, cfg: Any, name: str, role: str) -> tuple[Any, Any]:
    """A step's prompts and synthetic responses (full length) in a cleared partition: the
    inputs every stage after generation reads, less what ``role`` writes. Returns the prompt
    and sample handles."""
    import torch

    from infra.assets import CHARACTERS
    from storage import BatchMeta
    from tasks.generate.stage import sample_meta
    from tasks.io import nested

    r = cfg.rollout
    tokenizer = worker.tokenizer
    prompt_ids, raw = _prompts(tokenizer, r.prompts_per_step)
    prompts = BatchMeta(name, tuple(f"p{i}/0" for i in range(r.prompts_per_step)))
    samples = sample_meta(prompts, r.n)
    chars = torch.tensor(tokenizer.convert_tokens_to_ids(list(CHARACTERS)), dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    count = len(samples.keys)
    responses = [
        chars[torch.randint(len(chars), (r.max_new_tokens,), generator=generator)]
        for _ in range(count)
    ]
    zeros = [torch.zeros(r.max_new_tokens) for _ in range(count)]
    fields: dict[str, Any] = {
        "prompt_ids": nested([p for p in prompt_ids for _ in range(r.n)]),
        "raw_prompt": [m for m in raw for _ in range(r.n)],
        "response_ids": nested(responses),
        "rollout_logprobs": nested(zeros),
        "advantages": nested([torch.randn(r.max_new_tokens) for _ in range(count)]),
        "group_ids": torch.arange(r.prompts_per_step).repeat_interleave(r.n),
        "rollout_version": torch.zeros(count, dtype=torch.int64),
    }
    if role != "ref":
        fields["ref_logprobs"] = nested(zeros)
    store.kv_clear(name, list(samples.keys))
    store.kv_batch_put(list(samples.keys), name, fields)
    return prompts, samples


def child_part(setup: Setup, role: str) -> dict[str, Any]:
    """One role alone in a ``ModelWorker`` with the training run's config: its stage step on a
    full batch, twice (the first warms up), the second timed and its allocator peak read."""
    import torch

    from infra.workers import ModelWorker, WorkerSpec
    from storage import open_store
    from tasks.logprobs.stage import forward_rows
    from tasks.plan import StepPlan
    from tasks.score.stage import score_rows
    from tasks.update.stage import actor_settings, update_rows

    cfg = setup.config()
    paths = setup.assets()
    if role in ("actor", "ref") and cfg.strategy("actor") == "fsdp2":
        _single_process_group(setup.device)
    name = f"gpu-part-{role}"
    store = open_store(f"memory://{name}")
    spec = WorkerSpec(
        roles=(role,),
        cfg=cfg,
        policy_path=str(paths.policy),
        tokenizer_path=str(paths.tokenizer),
        reward_model_path=str(paths.reward_model) if role == "reward" else None,
        store_url=store.url,
    )
    start = time.perf_counter()
    worker = ModelWorker(spec)
    result: dict[str, Any] = {"build_s": time.perf_counter() - start, "roles": [role]}
    reads = StepPlan.from_config(cfg).update_reads  # what the run's update stage reads

    def step(index: int) -> None:
        _, samples = _fill_store(store, worker, cfg, name, role)
        if role == "reward":
            worker.run(score_rows, samples, rule=None, texts=False)
        elif role == "ref":
            worker.run(forward_rows, samples, names=("ref_logprobs",))
        else:
            if "old_logprobs" in reads:  # recomputed by the actor, as the logprobs stage does
                worker.run(forward_rows, samples, names=("old_logprobs",))
            worker.run(
                update_rows,
                samples,
                step=index,
                reads=reads,
                actor=actor_settings(cfg, 1),
                critic=None,
            )

    step(0)
    _sync(setup.device)
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step(1)
    _sync(setup.device)
    result["step_s"] = time.perf_counter() - start
    if setup.device == "cuda":
        result["allocator_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    result["update_reads"] = sorted(reads) if role == "actor" else None
    result["ok"] = True
    store.close()
    return result


def run_child(setup: Setup, name: str, out: Path) -> int:
    """Entry of a check's own process: run it, write its JSON to ``out``."""
    start = time.perf_counter()
    try:
        if name == "rollout_engine":
            result = child_rollout_engine(setup)
        elif name.startswith("part_") and name.removeprefix("part_") in PART_ROLES:
            result = child_part(setup, name.removeprefix("part_"))
        else:
            raise ValueError(f"unknown check {name!r}")
    except Exception:  # noqa: BLE001 - reported, then the process exits 1
        result = {"ok": False, "error": traceback.format_exc()}
    result["check_s"] = time.perf_counter() - start
    out.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result.get("ok") else 1


# ----------------------------------------------------------------------------- the driver
@dataclass
class Check:
    name: str
    kind: str  # "child" (this script, one check) or "train" (python -m flows.cli train)
    extra: list[str] = field(default_factory=list)
    what: str = ""


def plan() -> list[Check]:
    checks = [
        Check("rollout_engine", "child", what="engine alone: generate, sync, sleep/wake"),
        *(Check(f"part_{r}", "child", what=f"{r} alone in a ModelWorker") for r in PART_ROLES),
    ]
    for name, extra in TRAIN_VARIANTS.items():
        checks.append(Check(name, "train", extra, what="ppoflow train " + " ".join(extra)))
    return checks


def _env(setup: Setup) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PREFECT_HOME", str(setup.workdir / "prefect-home"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _command(setup: Setup, check: Check, result_file: Path, smoke: bool) -> list[str]:
    if check.kind == "child":
        command = [sys.executable, str(Path(__file__).resolve()), "--child", check.name]
        command += ["--workdir", str(setup.workdir), "--engine", setup.engine]
        command += ["--result", str(result_file)]
        return command + (["--cpu-smoke"] if smoke else [])
    overrides = setup.overrides(check.name.removeprefix("train_")) + check.extra
    return [sys.executable, "-m", "flows.cli", "train", *overrides]


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _train_summary(setup: Setup, check: Check) -> dict[str, Any]:
    """Steps logged and their mean step time, from the run's metrics.jsonl."""
    path = setup.workdir / "runs" / check.name.removeprefix("train_") / "metrics.jsonl"
    if not path.is_file():
        return {"steps_logged": 0}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "timing_s/step" in r]
    summary: dict[str, Any] = {"steps_logged": len(steps)}
    if steps:
        summary["step_s_mean"] = sum(r["timing_s/step"] for r in steps) / len(steps)
        summary["step_s_last"] = steps[-1]["timing_s/step"]
    return summary


def run_check(setup: Setup, check: Check, sampler: MemorySampler, smoke: bool) -> dict[str, Any]:
    logs = setup.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{check.name}.log"
    result_file = logs / f"{check.name}.json"
    result_file.unlink(missing_ok=True)
    if check.kind == "train":  # a fresh run: no checkpoint to resume from
        import shutil

        run_dir = setup.workdir / "runs" / check.name.removeprefix("train_")
        shutil.rmtree(run_dir, ignore_errors=True)
    command = _command(setup, check, result_file, smoke)
    timeout = setup.scale.timeout_s
    idle = sampler.read_mib()
    sampler.start()
    start = time.perf_counter()
    timed_out = False
    with log.open("w") as sink:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=_env(setup),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout ends all of it
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    seconds = time.perf_counter() - start
    memory = sampler.stop()
    sampler.settle(idle)
    result: dict[str, Any] = {}
    if result_file.is_file():
        result.update(json.loads(result_file.read_text()))
    if check.kind == "train":
        result.update(_train_summary(setup, check))
        result["ok"] = code == 0 and result.get("steps_logged", 0) >= setup.scale.steps
        result["overrides"] = check.extra
    result.update(memory, seconds=seconds, returncode=code, log=str(log))
    if timed_out:
        result["ok"] = False
        result["error"] = f"timed out after {timeout:.0f} s\n" + _tail(log)
    elif not result.get("ok") and "error" not in result:
        result["ok"] = False
        result["error"] = _tail(log)
    return result


def colocation_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The pool's peak (train_base) against the sum and the largest of its parts' peaks."""
    parts = {
        name: report[name].get("peak_gib")
        for name in ("rollout_engine", *(f"part_{r}" for r in PART_ROLES))
        if isinstance(report.get(name), dict)
    }
    pool = report.get("train_base", {}).get("peak_gib")
    known = [v for v in parts.values() if isinstance(v, (int, float))]
    summary: dict[str, Any] = {"pool_peak_gib": pool, "parts_peak_gib": parts}
    if known and len(known) == len(parts):
        summary["parts_sum_gib"] = sum(known)
        summary["parts_max_gib"] = max(known)
        if isinstance(pool, (int, float)) and sum(known) > 0:
            summary["pool_over_parts_sum"] = pool / sum(known)
    return summary


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if v is None:
        return "-"
    return str(v)


def print_table(report: dict[str, Any], checks: list[Check]) -> None:
    print(f"\n{'check':<30}{'ok':<7}{'seconds':>9}{'peak GiB':>10}  notes")
    for check in checks:
        r = report.get(check.name)
        if not isinstance(r, dict):
            continue
        if r.get("error"):
            lines = [line for line in str(r["error"]).strip().splitlines() if line.strip()]
            note = lines[-1][:90] if lines else "error"
        elif check.name == "rollout_engine":
            note = (
                f"{r.get('tokens_per_s', 0):.0f} tok/s, sync {_value(r.get('sync_s'))} s, "
                f"sleep frees {_value(r.get('sleep_freed_gib'))} GiB"
            )
        elif check.kind == "train":
            note = f"{r.get('steps_logged')} steps, {_value(r.get('step_s_mean'))} s/step"
        else:
            note = f"step {_value(r.get('step_s'))} s"
        print(
            f"{check.name:<30}{_value(r.get('ok')):<7}{_value(r.get('seconds')):>9}"
            f"{_value(r.get('peak_gib')):>10}  {note}"
        )
    c = report.get("colocation", {})
    print(
        f"\ncolocated pool peak {_value(c.get('pool_peak_gib'))} GiB; parts: sum "
        f"{_value(c.get('parts_sum_gib'))} GiB, largest {_value(c.get('parts_max_gib'))} GiB; "
        f"pool / sum {_value(c.get('pool_over_parts_sum'))}"
    )


def dry_run(setup: Setup, checks: list[Check]) -> int:
    """Build the assets, validate every run's config and inputs, print the plan."""
    from flows.inputs import check_inputs

    start = time.perf_counter()
    setup.build_assets()
    print(f"assets in {setup.assets_root} ({time.perf_counter() - start:.1f} s)")
    for check in checks:
        run = check.name.removeprefix("train_") if check.kind == "train" else "base"
        cfg = setup.config(run, check.extra)
        check_inputs(cfg)
        command = _command(setup, check, setup.workdir / "logs" / f"{check.name}.json", False)
        print(f"\n[{check.name}] {check.what}")
        print(
            f"  config ok: engine={cfg.rollout.engine} device={cfg.resources.device} "
            f"dtype={cfg.models.dtype} strategy={cfg.strategy('actor')} "
            f"lora={cfg.actor.lora.rank if cfg.actor.lora else None} "
            f"gradient_checkpointing={cfg.actor.gradient_checkpointing} "
            f"batch={cfg.batch_size} steps={cfg.trainer.total_steps}"
        )
        print("  " + " ".join(command[:4]) + (" ..." if len(command) > 4 else ""))
        if check.kind == "train":
            print("  overrides: " + " ".join(command[4:]))
    print(f"\ndry run: {len(checks)} checks planned, each within {setup.scale.timeout_s:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    parser.add_argument("--dry-run", action="store_true", help="assets, configs, plan; no CUDA")
    parser.add_argument("--cpu-smoke", action="store_true", help="the checks on the CPU, tiny")
    parser.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto")
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(_setup_from(args), args.child, args.result)
    checks = plan()
    if args.only:
        wanted = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = wanted - {c.name for c in checks}
        if unknown:
            parser.error(f"unknown checks {sorted(unknown)}; known: {[c.name for c in checks]}")
        checks = [c for c in checks if c.name in wanted]
    if args.dry_run:
        setup = _setup_from(args)
        if args.engine == "auto" and not args.cpu_smoke:  # the plan is the GPU run's
            setup = Setup(setup.workdir, setup.scale, setup.device, "vllm")
        return dry_run(setup, checks)
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check_scale: skipped (no CUDA device); nothing written")
            return 0
    setup = _setup_from(args)
    setup.workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    setup.build_assets()
    sampler = MemorySampler()
    report: dict[str, Any] = {
        "params": {
            "device": setup.device,
            "engine": setup.engine,
            "engine_note": None
            if setup.engine == "vllm" or args.cpu_smoke
            else "vLLM is not installed: the transformers engine stands in",
            "scale": setup.scale.__dict__,
            "memory_backend": sampler.backend,
            "assets_s": time.perf_counter() - start,
            "gpu": _gpu_name(),
        }
    }
    for check in checks:
        print(f"[{check.name}] {check.what} ...", flush=True)
        report[check.name] = run_check(setup, check, sampler, args.cpu_smoke)
        print(
            f"[{check.name}] ok={report[check.name].get('ok')} "
            f"{report[check.name]['seconds']:.0f} s",
            flush=True,
        )
    report["colocation"] = colocation_summary(report)
    report["ok"] = all(report[c.name].get("ok") for c in checks)
    report["total_s"] = time.perf_counter() - start
    print_table(report, checks)
    name = "gpu-scale-cpu-smoke.json" if args.cpu_smoke else "gpu-scale.json"
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / name
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}; all ok: {report['ok']} ({report['total_s']:.0f} s)")
    return 0 if report["ok"] else 1


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


if __name__ == "__main__":
    sys.exit(main())
