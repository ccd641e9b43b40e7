"""Benchmark: one ppoflow iteration, stage by stage, through the flow and as plain calls; and
ppoflow beside TRL (GRPO and PPO) on the same small work, on CPU.

Run:  make bench-pipeline   (= .venv/bin/python benchmarks/pipeline.py)
      .venv/bin/python benchmarks/pipeline.py [--steps 10] [--warmup 3] [--rounds 2]
                                              [--threads 1] [--machine-threads N]
                                              [--modes grpo ppo] [--skip-peers]

The work: a GPT-2 style policy (4 layers, width 256, 4 heads, ~3.2M parameters), a GPT-2 reward
model (4 layers, width 128, ~0.8M), a character tokenizer of 56 tokens (pad != eos), 27-token
prompts, 16 completions per step of exactly 64 tokens (min_new_tokens = max_new_tokens). GRPO
takes 4 prompts x 4 samples, no reference; PPO takes 16 prompts x 1 with a critic (GAE, lambda
0.95), a reference and a k1 KL penalty of 0.05 in the reward (TRL's PPO always has both). One
PPO epoch, one optimizer step per batch, lr 1e-4 everywhere, fp32, and the same thread count
in every process (torch.set_num_threads and OMP/MKL_NUM_THREADS; default 1: on a shared 2-core
machine a second OpenMP thread made steps up to 20x slower under load). The models are built here with fixed seeds, saved with
``save_pretrained`` into a temporary folder and loaded from there by every system.

What is measured, each system in its own subprocess; the first ``--warmup`` steps are dropped,
then ``--steps`` steps are timed, ``--rounds`` times; medians pool the rounds; tokens/s is the
generated tokens of a step over the median step:

1. ppoflow three ways, started together and then taking turns step by step (step k of flow,
   then of ray+store, then of direct), so paired steps see the same machine load:
   ``flow`` (``flows.train.ppo_train``: Prefect tasks, Ray workers, the ``memory://`` store;
   stage times from ``metrics.jsonl``; a step runs from taking the turn to its metrics row being
   logged), ``ray+store`` (the same ``Trainer.iteration`` with each Prefect task replaced by its
   plain ``.fn``, store calls timed) and ``direct`` (the same ``PPOWorker`` methods called
   in-process: no Prefect, no store, no Ray). Overhead = median over paired steps of
   flow / direct - 1, split into store, Ray (and the loop's bookkeeping), Prefect tasks and
   per-step reporting.
2. TRL alone, in its own venv under ``benchmarks/.venvs/`` (git-ignored), built on first use
   (``python3 -m venv``, ``pip install torch==2.13.0 numpy`` first, then ``trl==1.16.0`` for
   GRPOTrainer or ``trl==1.12.0`` for PPOTrainer, the last release with ``trl.experimental.ppo``);
   scripts in ``benchmarks/peers/``; a step is the time between consecutive ``on_step_end``.
   A peer that cannot be built or fails leaves its row with the reason.
3. The whole machine, each run alone (``--machine-threads``, default: all CPUs; 0 skips): TRL
   with that many torch threads (``trl@all``); ppoflow's sync flow with that many threads per
   worker (``flow@all``); and ppoflow's flow in ``separate_async`` (``flow-async``: the rollout
   and reward pools and the training pool each one process of one thread, generate/score of
   step k+1 overlapping the update of step k, one policy version of staleness at most,
   ``algorithm.old_logprobs=rollout``). The best ppoflow row is compared with the best TRL row.
   On 2 vCPUs the second CPU adds ~40 % of throughput, not 100 % (TRL: 1.45 s -> 1.03 s a
   GRPO step at 1 -> 2 threads), so this comparison is the one a user with the machine sees.
4. Peak memory: summed RSS sampled from /proc every 0.5 s: for ppoflow the driver plus its Ray
   ``PPOWorker`` actors (``tree``: every process below the driver, Ray's daemons and Prefect's
   temporary server included); for TRL its process.

Prints a table and writes ``benchmarks/results/pipeline.json`` with the load average of every
run (the machine is shared: numbers are noisy). A test never runs this.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEERS_DIR = ROOT / "benchmarks" / "peers"
VENVS = ROOT / "benchmarks" / ".venvs"
RESULTS = ROOT / "benchmarks" / "results" / "pipeline.json"
STAGES = ("generate", "score", "logprobs", "advantage", "update")
VARIANTS = ("direct", "ray+store", "flow")
# Runs alone, each using the whole machine (see --machine-threads): ppoflow's flow in
# separate_async (rollout + reward pools and the training pool, one thread each, overlapping
# generate/score of step k+1 with the update of step k; old_logprobs from the rollout), and the
# sync flow with every worker at the machine's thread count.
ASYNC_OVERRIDES = (
    "resources.mode=separate_async",
    "reward.pool=own",
    "algorithm.old_logprobs=rollout",
)
SOLO = ("flow-async", "flow@all")
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
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
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
def ppoflow_config(
    mode: str,
    work: Path,
    run_dir: Path,
    *,
    total_steps: int,
    threads: int,
    extra: Sequence[str] = (),
) -> Any:
    from infra.config import load_config

    prompts, n = (WORK.completions // WORK.group_size, WORK.group_size)
    algorithm = ["algorithm.estimator=grpo", "algorithm.kl.monitor=false"]  # TRL: no reference
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
            *extra,
        ],
    )


def resolved_models(cfg: Any) -> Any:
    from dataclasses import asdict

    from flows.reward_model import resolve_models
    from infra.assets import build_tiny_assets

    assets = build_tiny_assets(cfg.models.assets_dir, seed=cfg.seed)  # the prompt data
    return resolve_models(cfg, {k: str(v) for k, v in asdict(assets).items()})


# ------------------------------------------------------------------- ppoflow, three ways
class Baton:
    """Turn-taking between ppoflow variants run side by side: a file names whose step is next.

    The three variants start together and then run their steps in turn (direct, ray+store,
    flow, direct, ...), so step k of each sees nearly the same machine load: their ratio is
    measured on paired steps even while other work comes and goes. Without a path, no-ops.
    It also reads the process tree's CPU seconds: at the start of turns ``first`` and ``last``
    (everything, the background between turns included) and around each turn in between (own
    turns only).
    """

    def __init__(self, path: str | None, name: str, *, first: int, last: int) -> None:
        self.path = Path(path) if path else None
        self.name = name
        turn_order = VARIANTS if name in VARIANTS else (name,)  # a solo run passes to itself
        self.next = turn_order[(turn_order.index(name) + 1) % len(turn_order)]
        self.turn, self.first, self.last = -1, first, last
        self.window_cpu_s: dict[int, float] = {}
        self.own_cpu_s = 0.0

    def wait(self) -> None:
        """Block until it is this variant's turn."""
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while self.path is not None:
            turn = self.path.read_text() if self.path.exists() else ""
            if turn == self.name:
                break
            if turn == "abort" or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the paired run stopped ({turn or 'timeout'})")
            time.sleep(0.005)
        self.turn += 1
        if self.first <= self.turn <= self.last:
            self.window_cpu_s[self.turn] = tree_cpu_s(os.getpid())

    def pass_on(self) -> None:
        if self.first <= self.turn < self.last:
            self.own_cpu_s += tree_cpu_s(os.getpid()) - self.window_cpu_s[self.turn]
        if self.path is not None:
            tmp = self.path.with_name(f"{self.path.name}.{self.name.replace('+', '-')}")
            tmp.write_text(self.next)
            tmp.replace(self.path)

    def cpu_per_step(self) -> dict[str, float]:
        steps = self.last - self.first
        window = self.window_cpu_s[self.last] - self.window_cpu_s[self.first]
        return {"cpu_s_per_step": window / steps, "own_turn_cpu_s_per_step": self.own_cpu_s / steps}


@dataclass
class Run:
    """Per-step metrics rows, seconds of each step's turn, and store seconds (ray+store)."""

    rows: list[dict[str, float]]
    step_s: list[float]
    store_s: list[float] = field(default_factory=list)


def run_flow(cfg: Any, baton: Baton) -> Run:
    """The real ``ppo_train``; a step runs from taking the turn to its metrics row being logged."""
    import flows.report
    from flows.train import ppo_train

    begins, ends = [], []
    start, log = flows.report.RunReport.start, flows.report.RunReport.log

    def take_turn() -> None:
        baton.wait()
        begins.append(time.perf_counter())

    def hooked_start(self: Any, step: int) -> None:
        start(self, step)
        take_turn()

    def hooked_log(self: Any, step: int, metrics: dict[str, float]) -> None:
        log(self, step, metrics)
        ends.append(time.perf_counter())
        baton.pass_on()
        if step < cfg.trainer.total_steps - 1:
            take_turn()

    flows.report.RunReport.start = hooked_start  # type: ignore[method-assign]
    flows.report.RunReport.log = hooked_log  # type: ignore[method-assign]
    summary = ppo_train(cfg)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return Run([json.loads(line) for line in lines], [e - b for b, e in zip(begins, ends)])


def turns(baton: Baton, steps: int, iteration: Any) -> Iterator[tuple[dict[str, float], float]]:
    """Each step's metrics row and seconds, run in turn."""
    for step in range(steps):
        baton.wait()
        begin = time.perf_counter()
        row = iteration(step)
        seconds = time.perf_counter() - begin
        baton.pass_on()
        yield row, seconds


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


def run_staged(cfg: Any, baton: Baton) -> Run:
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
    run = Run([], [])
    try:
        from transformers import AutoTokenizer

        from flows.inputs import load_datasets

        tokenizer = AutoTokenizer.from_pretrained(models.tokenizer)
        datasets = load_datasets(cfg, models, tokenizer)
        trainer = Trainer(cfg, runtime, models, cfg.resolved_run_dir, datasets, tokenizer)
        trainer.stages = {name: task.fn for name, task in TASKS.items()}
        for row, seconds in turns(baton, cfg.trainer.total_steps, trainer.iteration):
            run.rows.append(row)
            run.step_s.append(seconds)
            run.store_s.append(opened[0].seconds)
            opened[0].seconds = 0.0
    finally:
        runtime.shutdown()
    return run


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
    from tasks.logprobs.stage import writes
    from tasks.score.stage import rule_scores
    from tasks.update.stage import update_fields

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
        responses, rollout_logprobs, _ = worker.generate(Jagged.from_rows(ids), n=n, seed=seed)
    with timed(t, "score"):
        raw = [r.raw_prompt for r in rows for _ in range(n)]
        rm, _ = worker.score(prompts, responses, raw)
        rule = rule_scores(ctx, responses, [r.ground_truth for r in rows for _ in range(n)])
        scores = cfg.reward.model_weight * torch.from_numpy(rm) + cfg.reward.rule_weight * rule
    with timed(t, "logprobs"):
        needed = writes(ctx)  # nothing for one on-policy step without reference or critic
        actor = "old_logprobs" in needed
        fields = worker.forward(prompts, responses, actor=actor) if needed else {}
        fields["rollout_logprobs"] = rollout_logprobs
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
        worker.update(prompts, responses, update_fields(ctx, fields))
    t["timing_s/step"] = time.perf_counter() - start
    t["perf/total_num_tokens"] = float(responses.lengths.sum())
    return t


def run_direct(cfg: Any, baton: Baton) -> Run:
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
    steps = turns(baton, cfg.trainer.total_steps, lambda k: direct_iteration(worker, ctx, data, k))
    rows, seconds = zip(*steps)
    return Run(list(rows), list(seconds))


RUNNERS = {
    "flow": run_flow,
    "ray+store": run_staged,
    "direct": run_direct,
    "flow-async": run_flow,
    "flow@all": run_flow,
}


def child_main(args: argparse.Namespace) -> None:
    """Inside the subprocess: run one ppoflow variant, print its timed steps as one JSON line."""
    started = time.perf_counter()
    total = args.warmup + args.steps + 1  # the last step also evaluates: never timed
    run_dir = Path(args.work) / "runs" / f"{args.mode}-{args.child.replace('+', '-')}"
    extra = ASYNC_OVERRIDES if args.child == "flow-async" else ()
    cfg = ppoflow_config(
        args.mode, Path(args.work), run_dir, total_steps=total, threads=args.threads, extra=extra
    )
    first, last = args.warmup, args.warmup + args.steps
    baton = Baton(args.baton, args.child, first=first, last=last)
    run = RUNNERS[args.child](cfg, baton)
    timed_steps = range(first, last)
    result = {
        "ok": True,
        "step_s": [run.step_s[k] for k in timed_steps],
        "iteration_s": [run.rows[k]["timing_s/step"] for k in timed_steps],
        "stages_s": {
            s: [run.rows[k].get(f"timing_s/{s}", 0.0) for k in timed_steps] for s in STAGES
        },
        "store_s": [run.store_s[k] for k in timed_steps] if run.store_s else None,
        "tokens": [run.rows[k]["perf/total_num_tokens"] for k in timed_steps],
        **baton.cpu_per_step(),
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(result), flush=True)


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
        for pid, fields in descendants(self.pid).items():
            self.seen[pid] = fields[19]  # the start time: pids get reused
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


def descendants(root: int) -> dict[int, list[str]]:
    """``root`` and every process below it, each with its /proc stat fields."""
    children: dict[int, list[int]] = defaultdict(list)
    stats: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := proc_stat(entry.name)) is not None:
            children[int(fields[1])].append(int(entry.name))
            stats[int(entry.name)] = fields
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid]
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, reaped children included) of ``root``'s process tree."""
    ticks = sum(sum(int(f[i]) for i in (11, 12, 13, 14)) for f in descendants(root).values())
    return ticks / os.sysconf("SC_CLK_TCK")


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


@dataclass
class Child:
    """A running subprocess: stdout and stderr go to files, its process tree is sampled."""

    proc: subprocess.Popen[bytes]
    memory: TreeMemory
    out: Path
    err: Path
    load_before: tuple[float, float, float]


def start_child(cmd: list[str], *, env: dict[str, str], log: Path) -> Child:
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, start_new_session=True)
    memory = TreeMemory(proc.pid)
    memory.start()
    return Child(proc, memory, out, err, os.getloadavg())


def run_children(
    cmds: dict[str, list[str]], *, env: dict[str, str], logs: Path, baton: Path | None = None
) -> dict[str, dict[str, Any]]:
    """Run the commands together (turns are taken through ``baton``); each one's last JSON
    line on stdout plus its peak memory and load, or why it failed. One failure aborts the
    others' turns; past the timeout every child still running is killed."""
    if baton is not None:
        baton.write_text(VARIANTS[0])
    children = {name: start_child(cmd, env=env, log=logs / name) for name, cmd in cmds.items()}
    timeout_s = CHILD_TIMEOUT_S if baton else PEER_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    failures: dict[str, str] = {}
    while any(c.proc.poll() is None for c in children.values()):
        for name, child in children.items():
            if child.proc.poll() not in (None, 0):
                failures.setdefault(name, f"exited {child.proc.returncode}")
        if failures and baton is not None:
            baton.write_text("abort")
        if time.monotonic() > deadline:
            for name, child in children.items():
                if child.proc.poll() is None:
                    failures[name] = f"timed out after {timeout_s} s"
            break
        time.sleep(0.2)
    return {name: finish_child(child, failures.get(name)) for name, child in children.items()}


def finish_child(child: Child, failure: str | None) -> dict[str, Any]:
    child.memory.stop()
    end_processes(child.memory.seen)
    child.proc.wait(timeout=30)
    if failure is None and child.proc.returncode != 0:
        failure = f"exited {child.proc.returncode}"
    lines = child.out.read_text(errors="replace").splitlines()
    result = next((json.loads(x) for x in reversed(lines) if x.startswith('{"ok"')), None)
    if result is None:
        tail = child.err.read_text(errors="replace")[-1500:]
        reason = f"{failure or 'no JSON line on stdout'}; stderr ends: {tail}"
        result = {"ok": False, "reason": reason}
    return {
        **result,
        "peak_rss_mb": child.memory.peak_mb(),
        "load_avg": [child.load_before, os.getloadavg()],
    }


def end_processes(seen: dict[int, str]) -> None:
    """Kill what the child started and left running: the pids its tree had, if each is still
    the same process (same start time)."""
    for pid, start in seen.items():
        fields = proc_stat(pid)
        if fields is not None and fields[19] == start:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def child_env(work: Path, threads: int, *, ppoflow: bool = True) -> dict[str, str]:
    """Quiet, offline, a private PREFECT_HOME, and the thread count in the OpenMP/MKL variables
    too (Ray sets OMP_NUM_THREADS in its workers: every process gets the same)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(QUIET_ENV)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PREFECT_HOME"] = str(work / "prefect-home")
    if ppoflow:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":")
    return env


def run_ppoflow(mode: str, args: argparse.Namespace, work: Path, tag: str) -> dict[str, Any]:
    """The three variants side by side, taking turns step by step."""
    logs = work / f"ppoflow-{mode}-{tag}"
    logs.mkdir()
    script = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--work", str(work)]
    script += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    script += ["--threads", str(args.threads), "--baton", str(logs / "turn")]
    cmds = {v: [*script, "--child", v] for v in VARIANTS}
    return run_children(cmds, env=child_env(work, args.threads), logs=logs, baton=logs / "turn")


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
    peer: Peer, python: Path, args: argparse.Namespace, work: Path, tag: str, threads: int
) -> dict[str, Any]:
    cmd = [str(python), str(PEERS_DIR / peer.script), "--work", str(work)]
    cmd += ["--out", str(work / f"trl-{peer.mode}-out"), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--threads", str(threads), "--lr", str(WORK.lr)]
    cmd += ["--completions", str(WORK.completions), "--group-size", str(WORK.group_size)]
    cmd += ["--response-tokens", str(WORK.response_tokens), "--kl-coef", str(WORK.kl_coef)]
    cmd += ["--lam", str(WORK.lam)]
    logs = work / f"trl-{peer.mode}-{tag}-t{threads}"
    logs.mkdir()
    return run_children({"trl": cmd}, env=child_env(work, threads, ppoflow=False), logs=logs)["trl"]


def run_solo(
    name: str, mode: str, args: argparse.Namespace, work: Path, tag: str, threads: int
) -> dict[str, Any]:
    """One ppoflow flow alone on the machine (no turn-taking): ``flow-async`` or ``flow@all``."""
    logs = work / f"ppoflow-{mode}-{tag}-{name.replace('@', '-')}"
    logs.mkdir()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--work", str(work)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(threads)]
    cmd += ["--child", name]
    return run_children({name: cmd}, env=child_env(work, threads), logs=logs)[name]


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
        "cpu_ms_per_step": round(1e3 * statistics.median(r["cpu_s_per_step"] for r in ok), 1),
        "own_turn_cpu_ms_per_step": round(
            1e3
            * statistics.median(r.get("own_turn_cpu_s_per_step", r["cpu_s_per_step"]) for r in ok),
            1,
        ),
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


def overhead(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Flow vs direct on paired steps (step k of each variant ran back to back): the median of
    per-step ratios, and where the difference goes (medians of per-step differences, ms)."""
    rounds = [
        (f, s, d)
        for f, s, d in zip(raw["flow"], raw["ray+store"], raw["direct"])
        if f["ok"] and s["ok"] and d["ok"]
    ]
    if not rounds:
        return {"available": False}

    def median_over_pairs(fn: Any, scale: float = 1e3) -> float:
        values = [fn(f, s, d, k) for f, s, d in rounds for k in range(len(d["step_s"]))]
        return round(scale * statistics.median(values), 1)

    step_pct = median_over_pairs(lambda f, s, d, k: f["step_s"][k] / d["step_s"][k] - 1, 100)

    def median_over_rounds(key: str) -> float:
        return round(100 * statistics.median(f[key] / d[key] - 1 for f, _, d in rounds), 1)

    cpu_pct, own_cpu_pct = (
        median_over_rounds("cpu_s_per_step"),
        median_over_rounds("own_turn_cpu_s_per_step"),
    )
    staged_pct = median_over_pairs(lambda f, s, d, k: s["step_s"][k] / d["step_s"][k] - 1, 100)
    return {
        "available": True,
        "step_pct": step_pct,
        "own_turn_cpu_pct": own_cpu_pct,
        "cpu_pct_upper_bound": cpu_pct,
        "wall_pairing_trusted": staged_pct > -100 * OVERHEAD_TARGET,
        "iteration_pct": median_over_pairs(
            lambda f, s, d, k: f["iteration_s"][k] / d["iteration_s"][k] - 1, 100
        ),
        "ray_store_vs_direct_pct": staged_pct,
        "by_stage_ms": {
            st: median_over_pairs(
                lambda f, s, d, k, st=st: f["stages_s"][st][k] - d["stages_s"][st][k]
            )
            for st in STAGES
        },
        "parts_ms": {
            "store": median_over_pairs(lambda f, s, d, k: s["store_s"][k]),
            "ray_and_loop_bookkeeping": median_over_pairs(
                lambda f, s, d, k: s["iteration_s"][k] - d["iteration_s"][k] - s["store_s"][k]
            ),
            "prefect_tasks": median_over_pairs(
                lambda f, s, d, k: f["iteration_s"][k] - s["iteration_s"][k]
            ),
            "per_step_reporting": median_over_pairs(
                lambda f, s, d, k: f["step_s"][k] - f["iteration_s"][k]
            ),
        },
        "target_pct": 100 * OVERHEAD_TARGET,
        "met": max(step_pct, own_cpu_pct) <= 100 * OVERHEAD_TARGET,
    }


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    if not (ours.get("ok") and theirs.get("ok")):
        return {"speedup": None, "met": None, "reason": theirs.get("reason") or ours.get("reason")}
    speedup = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return {
        "cpu_speedup_own_turns": round(
            theirs["cpu_ms_per_step"] / ours["own_turn_cpu_ms_per_step"], 2
        ),
        "cpu_speedup_with_background": round(
            theirs["cpu_ms_per_step"] / ours["cpu_ms_per_step"], 2
        ),
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
        f"{'mode':<5}{'system':<11}{head}{'iter':>7}{'step':>7}{'cpuOwn':>7}{'cpuAll':>7}{'tok/s':>7}"
        f"{'RSS MB':>8}{'tree MB':>8}"
    )
    for mode, block in report["results"].items():
        machine = block.get("machine", {})
        rows = [*block["ppoflow"].items(), (block["trl_name"], block["trl"])]
        rows += [*machine.get("ppoflow", {}).items()]
        rows += [("trl@all", machine["trl@all"])] if machine else []
        for name, row in rows:
            if not row.get("ok"):
                print(f"{mode:<5}{name:<11}failed: {row.get('reason')}")
                continue
            stages = "".join(fmt(row.get("stages_ms", {}).get(n), width=10) for n in STAGES)
            mem = row["peak_rss_mb"]
            print(
                f"{mode:<5}{name:<11}{stages}{fmt(row.get('iteration_ms'), width=7)}"
                f"{fmt(row['step_ms'], width=7)}{fmt(row['own_turn_cpu_ms_per_step'], width=7)}"
                f"{fmt(row['cpu_ms_per_step'], width=7)}"
                f"{fmt(row['tokens_per_s'], width=7)}"
                f"{fmt(mem.get('system'), width=8)}{fmt(mem.get('tree'), width=8)}"
            )
    for mode, block in report["results"].items():
        o, c = block["overhead"], block["vs_trl"]
        if o["available"]:
            print(
                f"{mode}: flow vs direct per step: wall {o['step_pct']:+.1f}%, CPU in own turns "
                f"{o['own_turn_cpu_pct']:+.1f}%, CPU with background {o['cpu_pct_upper_bound']:+.1f}%; "
                f"target <= {o['target_pct']:.0f}%: {o['met']}; ms: {o['parts_ms']}"
                + (
                    ""
                    if o["wall_pairing_trusted"]
                    else "; direct slower than ray+store: wall disturbed"
                )
            )
        print(
            f"{mode}: ppoflow flow tokens/s / TRL = {c['speedup']} (CPU/step: {c.get('cpu_speedup_own_turns')} own turns, "
            f"{c.get('cpu_speedup_with_background')} with background) "
            f"(target >= {SPEEDUP_TARGET}: {c['met']}{'; ' + str(c.get('reason')) if c.get('reason') else ''})"
        )
        if "machine" in block:
            m = block["machine"]
            print(
                f"{mode}: whole machine ({m['threads']} threads): best ppoflow ({m['best_ppoflow']}) "
                f"tokens/s / best TRL ({m['best_trl']}) = {m['vs_trl']['speedup']} "
                f"(target >= {SPEEDUP_TARGET}: {m['vs_trl']['met']})"
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
    parser.add_argument(
        "--machine-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads of the whole-machine runs (TRL, ppoflow's sync flow); 0 skips them",
    )
    parser.add_argument("--child", choices=(*VARIANTS, *SOLO), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["grpo", "ppo"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--baton", help=argparse.SUPPRESS)
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
    """ppoflow's three variants (side by side) and the TRL peer, ``--rounds`` times, the peer
    first in every second round."""
    peer = PEERS[mode]
    python, detail = (None, "skipped (--skip-peers)") if args.skip_peers else ensure_venv(peer)
    whole = args.machine_threads
    raw: dict[str, list[dict[str, Any]]] = {
        name: [] for name in (*VARIANTS, *SOLO, "trl", "trl@all")
    }
    systems = ("ppoflow", "trl") + (("flow-async", "flow@all", "trl@all") if whole else ())
    for index in range(args.rounds):
        for system in systems[:: 1 if index % 2 == 0 else -1]:
            print(f"  {mode} round {index + 1}/{args.rounds}: {system} ...", flush=True)
            tag = f"r{index}"
            if system == "ppoflow":
                for name, result in run_ppoflow(mode, args, work, tag).items():
                    raw[name].append(result)
            elif system in SOLO:
                threads = whole if system == "flow@all" else 1
                raw[system].append(run_solo(system, mode, args, work, tag, threads))
            elif python is None:
                raw[system].append({"ok": False, "reason": detail})
            else:
                threads = whole if system == "trl@all" else args.threads
                raw[system].append(run_peer(peer, python, args, work, tag, threads))
    ours = {name: summarise(raw[name]) for name in VARIANTS}
    theirs = {**summarise(raw["trl"]), "detail": detail}
    block: dict[str, Any] = {
        "ppoflow": ours,
        "trl_name": f"trl {peer.requirement.split('==')[1]}",
        "trl": theirs,
        "overhead": overhead(raw),
        "vs_trl": compare(ours["flow"], theirs),
    }
    if whole:
        solo = {name: summarise(raw[name]) for name in SOLO}
        trl_all = summarise(raw["trl@all"])
        best_ours = best({"flow": ours["flow"], **solo})
        best_trl = best({"trl": theirs, "trl@all": trl_all})
        block["machine"] = {
            "threads": whole,
            "ppoflow": solo,
            "trl@all": trl_all,
            "best_ppoflow": best_ours[0],
            "best_trl": best_trl[0],
            "vs_trl": compare(best_ours[1], best_trl[1]),
        }
    return block


def best(rows: dict[str, dict[str, Any]]) -> tuple[str | None, dict[str, Any]]:
    """The row with the most tokens/s (name, row); (None, a failed row) when none ran."""
    done = {name: row for name, row in rows.items() if row.get("ok")}
    if not done:
        return None, {"ok": False, "reason": "no run of this side finished"}
    name = max(done, key=lambda n: done[n]["tokens_per_s"])
    return name, done[name]


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
        "work": {**asdict(WORK), **params, "modes": MODES},
        "targets": {
            f"{mode}: {key}": block[part]["met"]
            for mode, block in results.items()
            for part, key in (
                ("overhead", f"flow overhead <= {100 * OVERHEAD_TARGET:.0f}%"),
                (
                    "vs_trl",
                    f"flow tokens/s >= {SPEEDUP_TARGET}x TRL (torch threads {args.threads})",
                ),
            )
            if part in block and "met" in block[part]
        }
        | {
            f"{mode}: best ppoflow tokens/s >= {SPEEDUP_TARGET}x best TRL (whole machine)": block[
                "machine"
            ]["vs_trl"]["met"]
            for mode, block in results.items()
            if "machine" in block
        },
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "torch_threads": args.threads,
            "machine_threads": args.machine_threads,
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


MODES = {
    "grpo": "4 prompts x 4 samples (groups of 4); ppoflow algorithm.estimator=grpo; TRL "
    "GRPOTrainer with the reward model, beta 0 (no reference)",
    "ppo": "16 prompts x 1 sample; ppoflow algorithm.estimator=gae with kl.in_reward (k1, 0.05, "
    "reference model); TRL PPOTrainer (policy, reference, value model of the policy's size, "
    "reward model)",
}
METHOD = (
    "ppoflow's three variants start together and take turns step by step (direct, ray+store, "
    "flow, direct, ...); a step is timed from taking the turn to its end (flow: its metrics row "
    "logged); overhead = median over paired steps of flow / direct - 1. TRL runs alone (before "
    "ppoflow in every second round); its step is the time between consecutive on_step_end. "
    "Medians pool --rounds rounds. iteration = ppoflow's timing_s/step (no per-step reporting). "
    "tokens/s = generated tokens per step / median step. cpu = CPU seconds per timed step of "
    "the whole process tree (user + system, reaped children included, from /proc): robust to "
    "load, and it charges a system for the work it leaves running between its steps (Prefect's "
    "server, Ray's daemons), which wall time on paired turns hands to the next variant. Peak "
    "RSS sampled every 0.5 s from /proc: system = driver + Ray PPOWorker actors (TRL: its "
    "process), tree = every descendant process (Ray daemons, idle Ray workers, Prefect's "
    "temporary server)."
)


if __name__ == "__main__":
    main()
