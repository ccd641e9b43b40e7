"""What every part of the pipeline benchmark shares: paths, the names of the ppoflow stages and
runs, the targets, the timeouts and the quiet, offline environment of every subprocess."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "pipeline.py"  # re-run with --child
PEERS_DIR = ROOT / "benchmarks" / "peers"
VENVS = ROOT / "benchmarks" / ".venvs"
RESULTS = ROOT / "benchmarks" / "results" / "pipeline.json"
STAGES = ("generate", "score", "logprobs", "advantage", "update")
# separate_async: the training loop's wait for the producer's scored rows (generate and score
# then run on the producer's thread, overlapping the training of the step before).
STEP_PARTS = ("wait_rollout",)
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
# grpo-varlen only, where vLLM is installed (`make venv-vllm`): the same two runs with the vLLM
# rollout engine (its CPU build here), the KV cache 1 GiB of host memory.
VLLM_OVERRIDES = ("rollout.engine=vllm", "rollout.cpu_kv_cache_gib=1.0")
VLLM_SOLO = ("flow-vllm@all", "flow-async-vllm")
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
