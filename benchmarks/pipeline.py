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
from contextlib import contextmanager, suppress
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
    "TRL_EXPERIMENTAL_SILENCE": "1",
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
        "ppo",
        "trl_ppo.py",
        "trl-1.12.0",
        "trl==1.12.0",
        "from trl.experimental.ppo import PPOTrainer",
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
        d = compute(
            ctx,
            {**fields, "response_ids": responses, "scores": scores, "group_ids": group_ids},
            step,
        )
        lengths = responses.lengths
        fields.update(
            {k: Jagged.from_rows(unpad(d[k], lengths)) for k in ("advantages", "returns")}
        )
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
    cfg = ppoflow_config(
        args.mode, Path(args.work), run_dir, total_steps=total, threads=args.threads
    )
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

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.peak = {"system": 0, "tree": 0, "driver": 0, "workers": 0}
        self.seen: dict[int, str] = {}  # pid -> start time
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def sample(self) -> None:
        kinds: dict[str, int] = defaultdict(int)
        for pid, start in descendants(self.pid).items():
            self.seen[pid] = start
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


def proc_stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ..., starttime at 19]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> dict[int, str]:
    """``root`` and every process below it, each with its start time (pids get reused)."""
    children: dict[int, list[int]] = defaultdict(list)
    started: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := proc_stat(entry.name)) is not None:
            children[int(fields[1])].append(int(entry.name))
            started[int(entry.name)] = fields[19]
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        out[pid] = started.get(pid, "")
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


def run_child(
    cmd: list[str], *, env: dict[str, str], timeout_s: float, log: Path
) -> dict[str, Any]:
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
            failure = None if proc.returncode == 0 else f"exited {proc.returncode}"
        except subprocess.TimeoutExpired:
            out, failure = "", f"timed out after {timeout_s:.0f} s"
        finally:
            memory.stop()
            end_processes(memory.seen)
            proc.wait(timeout=30)
    result = next(
        (json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{")),
        None,
    )
    if result is None:
        tail = log.read_text(errors="replace")[-1500:]
        result = {
            "ok": False,
            "reason": f"{failure or 'no JSON line on stdout'}; stderr ends: {tail}",
        }
    return {**result, "peak_rss_mb": memory.peak_mb(), "load_avg": [load_before, os.getloadavg()]}


def end_processes(seen: dict[int, str]) -> None:
    """Kill what the child started and left running: the pids its tree had, if each is still
    the same process (same start time)."""
    for pid, start in seen.items():
        fields = proc_stat(pid)
        if fields is not None and fields[19] == start:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def child_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(QUIET_ENV)
    env["PREFECT_HOME"] = str(work / "prefect-home")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_ppoflow(
    mode: str, variant: str, args: argparse.Namespace, work: Path, tag: str
) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--mode", mode]
    cmd += ["--work", str(work), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--threads", str(args.threads)]
    log = work / f"ppoflow-{mode}-{variant.replace('+', '-')}-{tag}.log"
    return run_child(cmd, env=child_env(work), timeout_s=CHILD_TIMEOUT_S, log=log)


# ------------------------------------------------------------------------------- the peers
def ensure_venv(peer: Peer) -> tuple[Path | None, str]:
    """The peer venv's python, building the venv on first use; (None, reason) on failure."""
    venv = VENVS / peer.venv
    python = venv / "bin" / "python"
    probe = [str(python), "-c", peer.probe]
    env = {**os.environ, **QUIET_ENV}
    if (
        python.exists()
        and subprocess.run(probe, capture_output=True, env=env, timeout=600).returncode == 0
    ):
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


def run_peer(
    peer: Peer, python: Path, args: argparse.Namespace, work: Path, tag: str
) -> dict[str, Any]:
    cmd = [str(python), str(PEERS_DIR / peer.script), "--work", str(work)]
    cmd += ["--out", str(work / f"trl-{peer.mode}-out"), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--threads", str(args.threads), "--lr", str(WORK.lr)]
    cmd += ["--completions", str(WORK.completions), "--group-size", str(WORK.group_size)]
    cmd += ["--response-tokens", str(WORK.response_tokens), "--kl-coef", str(WORK.kl_coef)]
    cmd += ["--lam", str(WORK.lam)]
    env = {**os.environ, **QUIET_ENV}
    log = work / f"trl-{peer.mode}-{tag}.log"
    return run_child(cmd, env=env, timeout_s=PEER_TIMEOUT_S, log=log)


# ------------------------------------------------------------------------------ the report
def pooled(results: list[dict[str, Any]], key: str) -> list[float]:
    return [v for r in results if r.get("ok") and r.get(key) for v in r[key]]


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the timed steps of every round (ms), tokens/s, peak memory, load."""
    ok = [r for r in results if r.get("ok")]
    failures = [r.get("reason") for r in results if not r.get("ok")]
    if not ok:
        return {"ok": False, "reason": "; ".join(str(f) for f in failures)}
    step, tokens = statistics.median(pooled(ok, "step_s")), statistics.median(pooled(ok, "tokens"))
    peaks = [r["peak_rss_mb"] for r in ok]
    out: dict[str, Any] = {
        "ok": True,
        "step_ms": round(1e3 * step, 1),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step, 1),
        "peak_rss_mb": {k: max(p[k] for p in peaks) for k in peaks[0]},
        "rounds": [
            {
                "step_ms": round(1e3 * statistics.median(r["step_s"]), 1),
                "load_avg_before_after": [
                    round(x, 2) for x in (*r["load_avg"][0], *r["load_avg"][1])
                ],
                "wall_s": round(r["wall_s"], 1),
            }
            for r in ok
        ],
        "failed_rounds": failures,
    }
    if "iteration_s" in ok[0]:
        out["iteration_ms"] = round(1e3 * statistics.median(pooled(ok, "iteration_s")), 1)
        stages = {s: [v for r in ok for v in r["stages_s"][s]] for s in STAGES}
        out["stages_ms"] = {s: round(1e3 * statistics.median(v), 1) for s, v in stages.items()}
        if pooled(ok, "store_s"):
            out["store_ms"] = round(1e3 * statistics.median(pooled(ok, "store_s")), 2)
    for key in ("prompt_width", "peak_rss_self_mb", "versions", "settings"):
        if key in ok[0]:
            out[key] = ok[0][key]
    return out


def overhead(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Flow vs direct, and where the difference goes (ms per step)."""
    flow, staged, direct = rows["flow"], rows["ray+store"], rows["direct"]
    if not (flow["ok"] and staged["ok"] and direct["ok"]):
        return {"available": False}
    base, store = direct["iteration_ms"], staged.get("store_ms", 0.0)
    step_pct = 100 * (flow["step_ms"] / direct["step_ms"] - 1)
    return {
        "available": True,
        "step_pct": round(step_pct, 1),
        "iteration_pct": round(100 * (flow["iteration_ms"] / base - 1), 1),
        "by_stage_ms": {s: round(flow["stages_ms"][s] - direct["stages_ms"][s], 1) for s in STAGES},
        "parts_ms": {
            "store": store,
            "ray_and_loop_bookkeeping": round(staged["iteration_ms"] - base - store, 1),
            "prefect_tasks": round(flow["iteration_ms"] - staged["iteration_ms"], 1),
            "per_step_reporting": round(flow["step_ms"] - flow["iteration_ms"], 1),
        },
        "target_pct": 100 * OVERHEAD_TARGET,
        "met": step_pct <= 100 * OVERHEAD_TARGET,
    }


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    if not (ours.get("ok") and theirs.get("ok")):
        return {"speedup": None, "met": None, "reason": theirs.get("reason") or ours.get("reason")}
    speedup = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return {
        "speedup": round(speedup, 2),
        "target": SPEEDUP_TARGET,
        "met": speedup >= SPEEDUP_TARGET,
    }


def fmt(value: Any, spec: str = ".0f", width: int = 9) -> str:
    return f"{value:>{width}{spec}}" if isinstance(value, int | float) else f"{'-':>{width}}"


def print_report(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(
        f"\nms; medians of {s['steps']} steps x {s['rounds']} rounds after {s['warmup']} warm-up; "
        f"torch threads {s['torch_threads']}; RSS = driver + PPOWorker actors, tree = all processes"
    )
    head = "".join(f"{name[:9]:>10}" for name in STAGES)
    print(
        f"{'mode':<5}{'system':<11}{head}{'iter':>7}{'step':>7}{'tok/s':>7}{'RSS MB':>8}{'tree MB':>8}"
    )
    for mode, block in report["results"].items():
        for name, row in [*block["ppoflow"].items(), (block["trl_name"], block["trl"])]:
            if not row.get("ok"):
                print(f"{mode:<5}{name:<11}failed: {row.get('reason')}")
                continue
            stages = "".join(fmt(row.get("stages_ms", {}).get(n), width=10) for n in STAGES)
            mem = row["peak_rss_mb"]
            print(
                f"{mode:<5}{name:<11}{stages}{fmt(row.get('iteration_ms'), width=7)}"
                f"{fmt(row['step_ms'], width=7)}{fmt(row['tokens_per_s'], width=7)}"
                f"{fmt(mem.get('system'), width=8)}{fmt(mem.get('tree'), width=8)}"
            )
    for mode, block in report["results"].items():
        o, c = block["overhead"], block["vs_trl"]
        if o["available"]:
            print(
                f"{mode}: flow vs direct {o['step_pct']:+.1f}% per step ({o['iteration_pct']:+.1f}% "
                f"iteration only), target <= {o['target_pct']:.0f}%: {o['met']}; ms: {o['parts_ms']}"
            )
        print(
            f"{mode}: ppoflow flow tokens/s / TRL = {c['speedup']} "
            f"(target >= {SPEEDUP_TARGET}: {c['met']}{'; ' + str(c.get('reason')) if c.get('reason') else ''})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (>= 1)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every system")
    parser.add_argument("--modes", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--skip-peers", action="store_true", help="ppoflow only (no TRL venvs)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["grpo", "ppo"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (a step is timed from the previous step's end)")
    if args.child:
        child_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="ppoflow-bench-pipeline-") as tmp:
        report = run_all(args, Path(tmp))
    print_report(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """ppoflow three ways and the TRL peer, ``--rounds`` times, the order reversed every round."""
    peer = PEERS[mode]
    python, detail = (None, "skipped (--skip-peers)") if args.skip_peers else ensure_venv(peer)
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in (*VARIANTS, "trl")}
    for round_index in range(args.rounds):
        order = [*VARIANTS, "trl"][:: 1 if round_index % 2 == 0 else -1]
        for name in order:
            print(f"  {mode} round {round_index + 1}/{args.rounds}: {name} ...", flush=True)
            tag = f"r{round_index}"
            if name != "trl":
                raw[name].append(run_ppoflow(mode, name, args, work, tag))
            elif python is None:
                raw[name].append({"ok": False, "reason": detail})
            else:
                raw[name].append(run_peer(peer, python, args, work, tag))
    ours = {name: summarise(raw[name]) for name in VARIANTS}
    theirs = {**summarise(raw["trl"]), "detail": detail}
    return {
        "ppoflow": ours,
        "trl_name": f"trl {peer.requirement.split('==')[1]}",
        "trl": theirs,
        "overhead": overhead(ours),
        "vs_trl": compare(ours["flow"], theirs),
    }


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """1. Build the work, 2. per mode: ppoflow three ways and the TRL peer, in rounds."""
    import torch

    from infra.assets import build_tiny_assets

    print(f"building the work in {work} ...", flush=True)
    params = build_work(work)
    build_tiny_assets(work / "tiny-assets", seed=WORK.seed)  # ppoflow's prompt data
    load_start = os.getloadavg()
    results = {mode: run_mode(mode, args, work) for mode in args.modes}
    return {
        "work": {**asdict(WORK), **params},
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "torch_threads": args.threads,
        },
        "method": METHOD,
        "load_avg": {"start": load_start, "end": os.getloadavg()},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "results": results,
    }


METHOD = (
    "each system runs in its own subprocess, --rounds times, the order reversed every round; "
    "a step is the time between the ends of consecutive steps (ppoflow flow: its metrics row "
    "logged; ray+store and direct: the loop; TRL: on_step_end), medians pooled over rounds; "
    "iteration = ppoflow's timing_s/step (without per-step reporting); tokens/s = generated "
    "tokens per step / median step; peak RSS sampled every 0.5 s from /proc: system = driver + "
    "Ray PPOWorker actors (TRL: its process), tree = every descendant process (Ray daemons, "
    "idle Ray workers, Prefect's temporary server)"
)


if __name__ == "__main__":
    main()
