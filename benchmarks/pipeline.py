"""Benchmark: one ppoflow iteration, stage by stage, through the flow and as plain calls; and
ppoflow beside TRL (GRPO and PPO) on the same small work, on CPU.

Run:  make bench-pipeline   (= .venv/bin/python benchmarks/pipeline.py)
      .venv/bin/python benchmarks/pipeline.py [--steps 10] [--warmup 3] [--skip-peers]

The work: a GPT-2 style policy (4 layers, width 256, 4 heads, ~3.2M parameters), a GPT-2 reward
model (4 layers, width 128, ~0.8M), a character tokenizer of 56 tokens (pad != eos), 27-token
prompts, 16 completions per step of exactly 64 tokens (min_new_tokens = max_new_tokens). GRPO
takes 4 prompts x 4 samples; PPO takes 16 prompts x 1 with a critic (GAE, lambda 0.95), a
reference and a k1 KL penalty of 0.05 in the reward (TRL's PPO always has both). One PPO epoch,
one optimizer step per batch, the same lr and torch thread count everywhere. The models are
built here with fixed seeds, saved with ``save_pretrained`` into a temporary folder and loaded
from there by every system.

What is measured, each system in its own subprocess (warm-up steps dropped, then the median of
``--steps`` steps; a step is the time between the ends of consecutive steps; tokens/s is the
generated tokens of a step over its median time):

1. ppoflow three ways: ``flow`` (``flows.train.ppo_train``: Prefect tasks, Ray workers, the
   ``memory://`` store; stage times from ``metrics.jsonl``), ``ray+store`` (the same
   ``Trainer.iteration`` with each Prefect task replaced by its plain function, store calls
   timed) and ``direct`` (the same ``PPOWorker`` methods called in-process: no Prefect, no store,
   no Ray). Overhead = flow / direct - 1, split into store, Ray and Prefect.
2. TRL in its own venvs under ``benchmarks/.venvs/`` (git-ignored), built on first use:
   ``trl==1.16.0`` for GRPOTrainer, ``trl==1.12.0`` for PPOTrainer (``trl.experimental.ppo``,
   the last release with it); scripts in ``benchmarks/peers/``. A peer that cannot be built or
   fails leaves its row with the reason.
3. Peak memory: summed RSS sampled from /proc every 0.2 s: for ppoflow the driver plus its Ray
   worker actors (and, separately, the whole process tree: Ray daemons, Prefect's server); for
   TRL its process.

Prints a table and writes ``benchmarks/results/pipeline.json`` (with the load average: the
machine is shared, numbers are noisy). A test never runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEERS_DIR = ROOT / "benchmarks" / "peers"
VENVS = ROOT / "benchmarks" / ".venvs"
RESULTS = ROOT / "benchmarks" / "results" / "pipeline.json"
STAGES = ("generate", "score", "logprobs", "advantage", "update")
VARIANTS = ("direct", "ray+store", "flow")
OVERHEAD_TARGET, SPEEDUP_TARGET = 0.05, 1.5
CHILD_TIMEOUT_S, PEER_TIMEOUT_S, INSTALL_TIMEOUT_S = 900, 1200, 3600
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "PYTHONWARNINGS": "ignore",
}


@dataclass(frozen=True)
class Work:
    """The shared work (see the module docstring)."""

    prompt_tokens: int = 27
    response_tokens: int = 64
    completions: int = 16
    group_size: int = 4
    lr: float = 1e-4
    kl_coef: float = 0.05
    lam: float = 0.95
    vocab: int = 56
    seed: int = 0


WORK = Work()


@dataclass(frozen=True)
class Peer:
    mode: str
    script: str
    venv: str
    requirement: str
    probe: str


PEERS = {
    "grpo": Peer("grpo", "trl_grpo.py", "trl-1.16.0", "trl==1.16.0", "from trl import GRPOTrainer"),
    "ppo": Peer(
        "ppo", "trl_ppo.py", "trl-1.12.0", "trl==1.12.0", "from trl.experimental.ppo import PPOTrainer"
    ),
}

# ---------------------------------------------------------------------------------- the work
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>")
CHARACTERS = tuple("0123456789abcdefghijklmnopqrstuvwxyz") + tuple(" +-=?:.,!'()*/")
# <bos> <|user|> + 18 characters + "ab+cd=" + <|assistant|> = 27 tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>please add these: {{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> Any:
    """Character-level WordLevel tokenizer, 56 tokens, pad != eos, with the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        extra_special_tokens=list(SPECIALS[4:]),
        padding_side="right",
        model_max_length=128,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_work(out: Path) -> dict[str, Any]:
    """Save tokenizer + policy to ``out/policy`` and tokenizer + reward model to
    ``out/reward_model``; return parameter counts and the checked prompt length."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    tokenizer = build_tokenizer()
    ids = dict(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_head=4,
        n_layer=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(WORK.seed)
    policy = GPT2LMHeadModel(GPT2Config(n_embd=256, **ids))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(policy.generation_config, key, ids[key])
    torch.manual_seed(WORK.seed + 1)
    reward = GPT2ForSequenceClassification(GPT2Config(n_embd=128, num_labels=1, **ids))
    for name, model in (("policy", policy), ("reward_model", reward)):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, return_dict=False
    )
    if len(prompt) != WORK.prompt_tokens or len(tokenizer) != WORK.vocab:
        raise RuntimeError(f"prompt has {len(prompt)} tokens, vocabulary {len(tokenizer)}")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {"policy_params": count(policy), "reward_model_params": count(reward)}


# ---------------------------------------------------------------------------- ppoflow config
def ppoflow_config(mode: str, work: Path, run_dir: Path, *, total_steps: int, threads: int) -> Any:
    from infra.config import load_config

    prompts, n = (WORK.completions // WORK.group_size, WORK.group_size)
    algorithm = ["algorithm.estimator=grpo"]
    if mode == "ppo":
        prompts, n = WORK.completions, 1
        algorithm = [
            "algorithm.estimator=gae",
            f"algorithm.lam={WORK.lam}",
            "algorithm.kl.in_reward=true",
            "algorithm.kl.kind=k1",
            f"algorithm.kl.coef={WORK.kl_coef}",
        ]
    batch = [f"mini_batch_size={WORK.completions}", f"micro_batch_size={WORK.completions}"]
    optim = [f"lr={WORK.lr}", "ppo_epochs=1", *batch]
    return load_config(
        None,
        [
            f"name=bench-{mode}",
            f"seed={WORK.seed}",
            f"run_dir={run_dir}",
            f"models.assets_dir={work / 'tiny-assets'}",
            f"models.policy={work / 'policy'}",
            f"models.tokenizer={work / 'policy'}",
            f"models.reward_model={work / 'reward_model'}",
            "warmstart.enabled=false",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.n={n}",
            f"rollout.max_new_tokens={WORK.response_tokens}",
            f"rollout.min_new_tokens={WORK.response_tokens}",
            *algorithm,
            *[f"actor.{o}" for o in optim],
            *[f"critic.{o}" for o in optim],
            f"resources.threads_per_worker={threads}",
            f"trainer.total_steps={total_steps}",
            "trainer.eval_every=1000000",
            "trainer.eval_prompts=1",
            "trainer.checkpoint_every=1000000",
            "trainer.resume=never",
            "trainer.progress_bar=false",
        ],
    )


def resolved_models(cfg: Any) -> Any:
    from flows.reward_model import ResolvedModels
    from infra.assets import build_tiny_assets

    assets = build_tiny_assets(cfg.models.assets_dir, seed=cfg.seed)  # the prompt data
    return ResolvedModels(
        policy=str(cfg.models.policy),
        tokenizer=str(cfg.models.tokenizer),
        reward_model=str(cfg.models.reward_model),
        critic=None,
        train_data=str(assets.train_data),
        heldout_data=str(assets.heldout_data),
    )


# ------------------------------------------------------------------- ppoflow, three ways
def run_flow(cfg: Any) -> tuple[list[dict[str, float]], list[float], list[float]]:
    """The real ``ppo_train``; each step's end is stamped when its metrics row is logged."""
    import flows.report
    from flows.train import ppo_train

    stamps: list[float] = []
    log = flows.report.RunReport.log

    def stamped_log(self: Any, step: int, metrics: dict[str, float]) -> None:
        log(self, step, metrics)
        stamps.append(time.perf_counter())

    flows.report.RunReport.log = stamped_log  # type: ignore[method-assign]
    summary = ppo_train(cfg)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], stamps, []


class TimedStore:
    """Forwards to a store; adds up the seconds spent in its ``kv_*`` calls."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not name.startswith("kv_"):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run_staged(cfg: Any) -> tuple[list[dict[str, float]], list[float], list[float]]:
    """``Trainer.iteration`` on Ray workers and the store, each Prefect task's plain ``.fn``."""
    import storage
    from flows.loop import STAGES as TASKS
    from flows.loop import Trainer
    from flows.runtime import build_runtime

    models = resolved_models(cfg)
    opened: list[TimedStore] = []
    open_store = storage.open_store
    storage.open_store = lambda url: opened.append(TimedStore(open_store(url))) or opened[-1]
    runtime = build_runtime(cfg, models)
    rows, stamps, store_s = [], [], []
    try:
        trainer = Trainer(cfg, runtime, models, cfg.resolved_run_dir)
        trainer.stages = {name: task.fn for name, task in TASKS.items()}
        for step in range(cfg.trainer.total_steps):
            opened[0].seconds = 0.0
            rows.append(trainer.iteration(step))
            stamps.append(time.perf_counter())
            store_s.append(opened[0].seconds)
            trainer.ctx.metrics.pop(step, None)
    finally:
        runtime.shutdown()
    return rows, stamps, store_s


@contextmanager
def timed(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[f"timing_s/{name}"] = time.perf_counter() - start


def direct_iteration(worker: Any, ctx: Any, data: Any, step: int) -> dict[str, float]:
    """One iteration as plain calls: the stages' worker methods and pure functions, in order."""
    import torch

    from infra.transport import Jagged
    from tasks.advantage.stage import compute
    from tasks.batching import unpad
    from tasks.generate.stage import generation_seed
    from tasks.score.stage import rule_scores
    from tasks.update.stage import reads

    cfg, n, t = ctx.cfg, ctx.cfg.rollout.n, {}
    start = time.perf_counter()
    # 1. Prompts (the flow's submit), 2. generate, 3. score, 4. logprobs, 5. advantage, 6. update.
    rows = data.next_batch(cfg.rollout.prompts_per_step)
    ids = [
        torch.tensor(
            ctx.tokenizer.apply_chat_template(
                r.raw_prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in rows
    ]
    prompts = Jagged.from_rows([p for p in ids for _ in range(n)])
    with timed(t, "generate"):
        seed = generation_seed(cfg.seed, step)
        responses, _, _ = worker.generate(Jagged.from_rows(ids), n=n, seed=seed)
    with timed(t, "score"):
        raw = [r.raw_prompt for r in rows for _ in range(n)]
        rm, _ = worker.score(prompts, responses, raw)
        rule = rule_scores(ctx, responses, [r.ground_truth for r in rows for _ in range(n)])
        scores = cfg.reward.model_weight * torch.from_numpy(rm) + cfg.reward.rule_weight * rule
    with timed(t, "logprobs"):
        fields = worker.forward(prompts, responses)
    with timed(t, "advantage"):
        group_ids = torch.arange(len(rows)).repeat_interleave(n)  # (B,)
        d = compute(ctx, {**fields, "response_ids": responses, "scores": scores, "group_ids": group_ids}, step)
        lengths = responses.lengths
        fields.update({k: Jagged.from_rows(unpad(d[k], lengths)) for k in ("advantages", "returns")})
    with timed(t, "update"):
        names = [k for k in reads(ctx) if k not in ("prompt_ids", "response_ids")]
        worker.update(prompts, responses, {k: fields[k] for k in names})
    t["timing_s/step"] = time.perf_counter() - start
    t["perf/total_num_tokens"] = float(responses.lengths.sum())
    return t


def run_direct(cfg: Any) -> tuple[list[dict[str, float]], list[float], list[float]]:
    """One ``PPOWorker`` with the flow's roles and spec, in this process."""
    from transformers import AutoTokenizer

    from flows.runtime import _spec, _train_roles
    from infra.data import PromptDataset
    from infra.workers import PPOWorker
    from tasks.context import StageContext
    from tasks.kl import FixedKLController

    models = resolved_models(cfg)
    worker = PPOWorker(_spec(cfg, models, _train_roles(cfg)))
    ctx = StageContext(
        cfg=cfg,
        store=None,
        tokenizer=AutoTokenizer.from_pretrained(models.tokenizer),
        train_group=None,
        kl_controller=FixedKLController(coef=cfg.algorithm.kl.coef),
    )
    data = PromptDataset(Path(models.train_data), seed=cfg.seed)
    rows, stamps = [], []
    for step in range(cfg.trainer.total_steps):
        rows.append(direct_iteration(worker, ctx, data, step))
        stamps.append(time.perf_counter())
    return rows, stamps, []


RUNNERS = {"flow": run_flow, "ray+store": run_staged, "direct": run_direct}


def child_main(args: argparse.Namespace) -> None:
    """Inside the subprocess: run one ppoflow variant, print its timed steps as one JSON line."""
    started = time.perf_counter()
    total = args.warmup + args.steps + 1  # the last step also evaluates: never timed
    run_dir = Path(args.work) / "runs" / f"{args.mode}-{args.child.replace('+', '-')}"
    cfg = ppoflow_config(args.mode, Path(args.work), run_dir, total_steps=total, threads=args.threads)
    rows, stamps, store_s = RUNNERS[args.child](cfg)
    timed_steps = range(args.warmup, args.warmup + args.steps)
    print(
        json.dumps(
            {
                "ok": True,
                "step_s": [stamps[k] - stamps[k - 1] for k in timed_steps],
                "iteration_s": [rows[k]["timing_s/step"] for k in timed_steps],
                "stages_s": {s: [rows[k][f"timing_s/{s}"] for k in timed_steps] for s in STAGES},
                "store_s": [store_s[k] for k in timed_steps] if store_s else None,
                "tokens": [rows[k]["perf/total_num_tokens"] for k in timed_steps],
                "wall_s": time.perf_counter() - started,
            }
        ),
        flush=True,
    )


# ----------------------------------------------------------------- subprocesses and memory
class TreeMemory(threading.Thread):
    """Samples the summed RSS of a process tree from /proc; keeps peaks by process kind:
    ``driver`` (the root), ``workers`` (Ray ``PPOWorker`` actors), ``other`` (Ray daemons, idle
    Ray workers, Prefect's server ...)."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.peak = {"system": 0, "tree": 0, "driver": 0, "workers": 0}
        self.seen: set[int] = set()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def sample(self) -> None:
        kinds: dict[str, int] = defaultdict(int)
        for pid in descendants(self.pid):
            self.seen.add(pid)
            kinds[process_kind(pid, self.pid)] += rss_bytes(pid)
        now = {
            "system": kinds["driver"] + kinds["workers"],
            "tree": sum(kinds.values()),
            "driver": kinds["driver"],
            "workers": kinds["workers"],
        }
        self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def peak_mb(self) -> dict[str, float]:
        return {k: round(v / 2**20, 1) for k, v in self.peak.items()}


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from each /proc/PID/stat's parent id)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError):
        return 0


def process_kind(pid: int, root: int) -> str:
    if pid == root:
        return "driver"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return "other"
    return "workers" if cmdline.startswith(b"ray::PPOWorker") else "other"


def run_child(cmd: list[str], *, env: dict[str, str], timeout_s: float, log: Path) -> dict[str, Any]:
    """Run ``cmd``; its last JSON line on stdout plus peak memory and load, or the failure."""
    load_before = os.getloadavg()
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        memory = TreeMemory(proc.pid)
        memory.start()
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            failure = None if proc.returncode == 0 else f"exited {proc.returncode} (see {log})"
        except subprocess.TimeoutExpired:
            out, failure = "", f"timed out after {timeout_s:.0f} s (see {log})"
        finally:
            memory.stop()
            end_processes(memory.seen)
    result = next(
        (json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{")),
        None,
    )
    if result is None:
        result = {"ok": False, "reason": failure or f"no JSON result on stdout (see {log})"}
    return {**result, "peak_rss_mb": memory.peak_mb(), "load_avg": [load_before, os.getloadavg()]}


def end_processes(pids: set[int]) -> None:
    """Kill what the child started and left running (pids this run saw in its tree)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def child_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(QUIET_ENV)
    env["PREFECT_HOME"] = str(work / "prefect-home")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_ppoflow(mode: str, variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--mode", mode]
    cmd += ["--work", str(work), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--threads", str(args.threads)]
    log = work / f"ppoflow-{mode}-{variant.replace('+', '-')}.log"
    print(f"  ppoflow {mode} {variant} ...", flush=True)
    return run_child(cmd, env=child_env(work), timeout_s=CHILD_TIMEOUT_S, log=log)


# ------------------------------------------------------------------------------- the peers
def ensure_venv(peer: Peer) -> tuple[Path | None, str]:
    """The peer venv's python, building the venv on first use; (None, reason) on failure."""
    venv = VENVS / peer.venv
    python = venv / "bin" / "python"
    probe = [str(python), "-c", peer.probe]
    env = {**os.environ, **QUIET_ENV}
    if python.exists() and subprocess.run(probe, capture_output=True, env=env, timeout=600).returncode == 0:
        return python, f"{peer.requirement} (venv reused)"
    print(f"  building {venv} (torch==2.13.0 numpy, then {peer.requirement}) ...", flush=True)
    steps = [
        ["python3", "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"],
        [str(python), "-m", "pip", "install", "-q", peer.requirement],
        probe,
    ]
    log_path = VENVS / f"{peer.venv}-install.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        for step in steps:
            try:
                done = subprocess.run(
                    step, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=INSTALL_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as error:
                return None, f"{' '.join(step[:5])} failed: {error}"
            if done.returncode != 0:
                return None, f"{' '.join(step[:5])} exited {done.returncode} (see {log_path})"
    return python, f"{peer.requirement} (venv built)"


def run_peer(peer: Peer, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    python, detail = ensure_venv(peer)
    if python is None:
        return {"ok": False, "reason": detail}
    cmd = [str(python), str(PEERS_DIR / peer.script), "--work", str(work)]
    cmd += ["--out", str(work / f"trl-{peer.mode}-out"), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--threads", str(args.threads), "--lr", str(WORK.lr)]
    cmd += ["--completions", str(WORK.completions), "--group-size", str(WORK.group_size)]
    cmd += ["--response-tokens", str(WORK.response_tokens), "--kl-coef", str(WORK.kl_coef)]
    cmd += ["--lam", str(WORK.lam)]
    print(f"  {peer.requirement} {peer.mode} ...", flush=True)
    env = {**os.environ, **QUIET_ENV}
    result = run_child(cmd, env=env, timeout_s=PEER_TIMEOUT_S, log=work / f"trl-{peer.mode}.log")
    return {**result, "detail": detail}


# ------------------------------------------------------------------------------ the report
def med(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Medians of a child's timed steps (ms), tokens/s, peak memory, load."""
    if not result.get("ok"):
        return {"ok": False, "reason": result.get("reason"), "peak_rss_mb": result.get("peak_rss_mb")}
    step = med(result["step_s"])
    tokens = med(result["tokens"])
    out = {
        "ok": True,
        "step_ms": round(1e3 * step, 1),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step, 1),
        "peak_rss_mb": result["peak_rss_mb"],
        "load_avg_before_after": result["load_avg"],
        "step_s_all": [round(s, 4) for s in result["step_s"]],
    }
    if "iteration_s" in result:
        out["iteration_ms"] = round(1e3 * med(result["iteration_s"]), 1)
        out["stages_ms"] = {s: round(1e3 * med(v), 1) for s, v in result["stages_s"].items()}
        if result.get("store_s"):
            out["store_ms"] = round(1e3 * med(result["store_s"]), 2)
    for key in ("detail", "prompt_width", "rows", "peak_rss_self_mb", "versions", "settings"):
        if key in result:
            out[key] = result[key]
    return out


def overhead(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Flow vs direct, and where the difference goes (ms per step; % of the direct iteration)."""
    flow, staged, direct = rows["flow"], rows["ray+store"], rows["direct"]
    if not (flow["ok"] and staged["ok"] and direct["ok"]):
        return {"available": False}
    base = direct["iteration_ms"]
    store = staged.get("store_ms", 0.0)
    parts = {
        "store_ms": store,
        "ray_and_bookkeeping_ms": round(staged["iteration_ms"] - base - store, 1),
        "prefect_tasks_ms": round(flow["iteration_ms"] - staged["iteration_ms"], 1),
        "per_step_reporting_ms": round(flow["step_ms"] - flow["iteration_ms"], 1),
    }
    return {
        "available": True,
        "iteration_pct": round(100 * (flow["iteration_ms"] / base - 1), 1),
        "step_pct": round(100 * (flow["step_ms"] / direct["step_ms"] - 1), 1),
        "by_stage_ms": {s: round(flow["stages_ms"][s] - direct["stages_ms"][s], 1) for s in STAGES},
        "parts": parts,
        "target_pct": 100 * OVERHEAD_TARGET,
        "met": flow["step_ms"] / direct["step_ms"] - 1 <= OVERHEAD_TARGET,
    }


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    if not (ours.get("ok") and theirs.get("ok")):
        return {"speedup": None, "met": None, "reason": theirs.get("reason") or ours.get("reason")}
    speedup = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return {"speedup": round(speedup, 2), "target": SPEEDUP_TARGET, "met": speedup >= SPEEDUP_TARGET}


def fmt(value: Any, spec: str = ".1f", width: int = 9) -> str:
    return f"{value:>{width}{spec}}" if isinstance(value, int | float) else f"{'-':>{width}}"


def print_report(report: dict[str, Any]) -> None:
    print(f"\nmedians of {report['settings']['steps']} steps after {report['settings']['warmup']} warm-up; ms")
    head = "".join(f"{s[:9]:>10}" for s in STAGES)
    print(f"{'mode':<5}{'system':<17}{head}{'iter':>8}{'step':>8}{'tok/s':>8}{'RSS MB':>8}{'tree MB':>8}")
    for mode, block in report["results"].items():
        for name, row in [*block["ppoflow"].items(), ("trl", block["trl"])]:
            if not row.get("ok"):
                print(f"{mode:<5}{name:<17}failed: {row.get('reason')}")
                continue
            stages = "".join(fmt(row.get("stages_ms", {}).get(s), width=10) for s in STAGES)
            mem = row["peak_rss_mb"]
            print(
                f"{mode:<5}{name:<17}{stages}{fmt(row.get('iteration_ms'), width=8)}"
                f"{fmt(row['step_ms'], width=8)}{fmt(row['tokens_per_s'], '.0f', 8)}"
                f"{fmt(mem['system'], '.0f', 8)}{fmt(mem['tree'], '.0f', 8)}"
            )
    for mode, block in report["results"].items():
        o, c = block["overhead"], block["vs_trl"]
        if o["available"]:
            print(
                f"{mode}: flow overhead vs direct {o['step_pct']:+.1f}% per step "
                f"({o['iteration_pct']:+.1f}% iteration only; target <= {o['target_pct']:.0f}%: "
                f"{o['met']}); parts ms {o['parts']}"
            )
        print(f"{mode}: ppoflow flow / TRL tokens/s = {c['speedup']} (target >= {SPEEDUP_TARGET}: {c['met']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (>= 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--modes", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--skip-peers", action="store_true", help="ppoflow only (no TRL venvs)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["grpo", "ppo"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (a step's time is measured from the previous step's end)")
    if args.child:
        child_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="ppoflow-bench-pipeline-") as tmp:
        report = run_all(args, Path(tmp))
    print_report(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """1. Build the work, 2. ppoflow three ways per mode, 3. the TRL peer per mode."""
    import torch

    from infra.assets import build_tiny_assets

    print(f"building the work in {work} ...", flush=True)
    params = build_work(work)
    build_tiny_assets(work / "tiny-assets", seed=WORK.seed)
    results: dict[str, Any] = {}
    for mode in args.modes:
        ours = {v: summarise(run_ppoflow(mode, v, args, work)) for v in VARIANTS}
        theirs = (
            {"ok": False, "reason": "skipped (--skip-peers)"}
            if args.skip_peers
            else summarise(run_peer(PEERS[mode], args, work))
        )
        results[mode] = {
            "ppoflow": ours,
            "trl": theirs,
            "overhead": overhead(ours),
            "vs_trl": compare(ours["flow"], theirs),
        }
    return {
        "work": {**asdict(WORK), **params},
        "settings": {"steps": args.steps, "warmup": args.warmup, "torch_threads": args.threads},
        "method": "each system in its own subprocess; step = time between consecutive step ends "
        "(ppoflow flow: metrics rows logged; TRL: on_step_end); tokens/s = generated tokens per "
        "step / median step; peak RSS summed over the driver and PPOWorker actors (tree: every "
        "descendant process), sampled every 0.2 s from /proc",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "results": results,
    }


if __name__ == "__main__":
    main()
