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
   plain ``.fn``, store calls timed) and ``direct`` (the same ``ModelWorker`` methods called
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
   ``ModelWorker`` actors (``tree``: every process below the driver, Ray's daemons and Prefect's
   temporary server included); for TRL its process.

Prints a table and writes ``benchmarks/results/pipeline.json`` with the load average of every
run (the machine is shared: numbers are noisy). A test never runs this.

This script parses the flags and runs the steps; the parts live in ``pipeline_parts/``:
``workload`` (the work and ppoflow's config), ``ppoflow_runs`` (ppoflow three ways and the
Baton), ``peers`` (TRL in its venv), ``children`` (the subprocesses), ``measure`` (CPU and RSS
from /proc), ``report`` (medians, overhead, comparisons, the table), ``settings`` (shared names).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline_parts.peers import PEERS, ensure_venv, run_peer
from pipeline_parts.ppoflow_runs import child_main, run_ppoflow, run_solo
from pipeline_parts.report import METHOD, best, compare, overhead, print_report, summarise
from pipeline_parts.settings import (
    OVERHEAD_TARGET,
    RESULTS,
    ROOT,
    SOLO,
    SPEEDUP_TARGET,
    VARIANTS,
)
from pipeline_parts.workload import MODES, WORK, build_work

sys.path.insert(0, str(ROOT))


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


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """1. Build the work, 2. per mode: ppoflow three ways and the TRL peer, in rounds."""
    import torch

    from infra.assets import build_tiny_assets

    # 1. The work, saved where every system loads it.
    print(f"building the work in {work} ...", flush=True)
    params = build_work(work)
    build_tiny_assets(work / "tiny-assets", seed=WORK.seed)  # ppoflow's prompt data
    # 2. Per mode: ppoflow three ways, the TRL peer and the whole-machine runs, in rounds.
    load_start = os.getloadavg()
    results = {mode: run_mode(mode, args, work) for mode in args.modes}
    # 3. The report: work, targets, settings, method, load, machine, results.
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


if __name__ == "__main__":
    main()
