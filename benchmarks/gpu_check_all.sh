#!/usr/bin/env bash
# The GPU check in one command, from the repository root of a fresh checkout on a CUDA machine:
#
#     bash benchmarks/gpu_check_all.sh
#
# 1. Makes the virtual environment .venv-gpu (once; $VENV names another), unless $PYTHON names
#    an interpreter that already has vLLM and the project's dependencies (then nothing is
#    installed).
# 2. Installs vLLM first, so pip takes vLLM's CUDA build of torch, then the project with its
#    gpu and test extras, resolved against that torch. pip's own variables apply: a machine
#    without a registry installs from a folder of wheels with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR.
# 3. Runs python benchmarks/gpu_check_scale.py --out benchmarks/results (arguments given to this
#    script are passed on, e.g. --only rollout_engine); it writes benchmarks/results/gpu-scale.json
#    and prints a table. See that script's docstring for what it checks.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  VENV="${VENV:-.venv-gpu}"
  if [[ ! -f "$VENV/.gpu-check-installed" ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q vllm
    "$VENV/bin/python" -m pip install -q -e '.[gpu,test]'
    "$VENV/bin/python" -c 'import torch, vllm; assert torch.cuda.is_available(), "no CUDA"'
    touch "$VENV/.gpu-check-installed"
  fi
  PYTHON="$VENV/bin/python"
fi

export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_check_scale.py --out benchmarks/results "$@"
