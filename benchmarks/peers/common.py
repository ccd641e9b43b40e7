"""What the TRL peer scripts share: arguments, offline settings, prompts, a step clock, a token
counter, phase timers and the JSON report. Runs inside a peer venv (``benchmarks/.venvs/trl-*``), imported by
``trl_grpo.py`` and ``trl_ppo.py`` beside it; it never imports ppoflow.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from typing import Any

# Offline before transformers/trl are imported (FIELD-NOTES: TRL needs these to stay off the hub).
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}
os.environ.update(OFFLINE)

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


def parse_args(description: str) -> argparse.Namespace:
    """``--work DIR`` (policy/ and reward_model/ folders), steps, warm-up, threads, lr, output dir."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--work", required=True, help="folder with policy/ and reward_model/")
    parser.add_argument("--out", required=True, help="scratch output_dir for the trainer")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument(
        "--variable-length",
        action="store_true",
        help="responses end at EOS (no min_new_tokens); the models come from WORK/varlen",
    )
    parser.add_argument("--prompts", help="a JSON Lines prompt file (verl's layout), in file order")
    parser.add_argument(
        "--use-vllm",
        action="store_true",
        help="GRPO: generate with vLLM in the trainer's process (use_vllm, vllm_mode=colocate)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(0)
    torch.manual_seed(0)
    return args


def prompt_file_messages(path: str, count: int) -> list[list[dict[str, str]]]:
    """The ``prompt`` messages of the first ``count`` rows of a JSON Lines file, in file order,
    wrapping around when the file is shorter."""
    with open(path) as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    return [rows[i % len(rows)] for i in range(count)]


def addition_messages(count: int, *, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat prompts ``"ab+cd="`` (a, b in 10..99), the same form as ppoflow's prompt data."""
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": f"{rng.randint(10, 99)}+{rng.randint(10, 99)}="}]
        for _ in range(count)
    ]


class Phases:
    """Seconds spent inside named callables, added up: ``wrap(owner, name, phase)`` replaces
    ``owner.name`` on the instance by a timed forwarder. ``StepClock`` snapshots the totals at
    every step end, so each step's share is the difference of two snapshots."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)
        self.total.setdefault(phase, 0.0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


class StepClock(TrainerCallback):
    """Wall and process CPU time at every ``on_step_end``: step k took ``ends[k] - ends[k - 1]``;
    with ``phases``, their running totals too."""

    def __init__(self, phases: Phases | None = None) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.phases = phases
        self.phase_totals: list[dict[str, float]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if self.phases is not None:
            self.phase_totals.append(dict(self.phases.total))
        return control


class TokenCounter:
    """Wraps ``model.generate`` on the instance: counts each call's generated tokens per row (up
    to and including the first EOS), its prompt width, its decoded width and its seconds;
    ``min_new_tokens`` is injected when given (fixed-length completions, the benchmark's
    equal-work rule)."""

    def __init__(self, model: Any, *, eos_id: int, min_new_tokens: int | None = None) -> None:
        self.calls: list[dict[str, int]] = []
        self._generate = model.generate
        self._eos_id = eos_id
        self._min_new_tokens = min_new_tokens
        model.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._min_new_tokens is not None:
            kwargs.setdefault("min_new_tokens", self._min_new_tokens)
        start = time.perf_counter()
        out = self._generate(*args, **kwargs)
        seconds = time.perf_counter() - start
        ids = kwargs.get("input_ids", args[0] if args else None)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        width = int(ids.shape[1])
        new = sequences[:, width:]  # (B, T)
        is_eos = new == self._eos_id
        first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, new.shape[1])  # (B,)
        self.calls.append(
            {
                "rows": int(new.shape[0]),
                "prompt_width": width,
                "tokens": int(first.sum()),
                "lengths": first.tolist(),
                "decoded_width": int(new.shape[1]),
                "seconds": seconds,
            }
        )
        return out


def report(
    *,
    system: str,
    clock: StepClock,
    counter: TokenCounter,
    warmup: int,
    steps: int,
    settings: dict[str, Any],
    started: float,
) -> None:
    """Print one JSON line: per-step seconds and tokens of the timed steps, peak RSS, settings."""
    timed = range(warmup, warmup + steps)
    if len(clock.ends) < warmup + steps or len(counter.calls) < warmup + steps:
        raise RuntimeError(
            f"{system}: {len(clock.ends)} steps and {len(counter.calls)} generate calls recorded, "
            f"need {warmup + steps}"
        )
    step_s = [clock.ends[k] - clock.ends[k - 1] for k in timed]
    phases: dict[str, list[float]] = {}
    if clock.phase_totals:
        totals = clock.phase_totals
        phases = {
            name: [totals[k][name] - totals[k - 1][name] for k in timed] for name in totals[0]
        }
    result = {
        "ok": True,
        "system": system,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "cpu_s_per_step": (clock.cpu[warmup + steps - 1] - clock.cpu[warmup - 1]) / steps,
        "tokens": [counter.calls[k]["tokens"] for k in timed],
        "rows": [counter.calls[k]["rows"] for k in timed],
        "lengths": [counter.calls[k]["lengths"] for k in timed],
        "decoded_width": [counter.calls[k]["decoded_width"] for k in timed],
        "generate_call_s": [counter.calls[k]["seconds"] for k in timed],
        "phases_s": phases,
        "prompt_width": sorted({c["prompt_width"] for c in counter.calls}),
        "peak_rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "torch_threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - started,
        "versions": _versions(),
        "settings": settings,
    }
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


def _versions() -> dict[str, str]:
    import accelerate
    import transformers
    import trl

    return {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
