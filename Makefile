# Two commands on a fresh machine with only Python 3.10+:
#   make train   – builds .venv, then runs the main job on the embedded default
#   make test    – builds .venv, then runs the fast CPU test tier
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv train test test-all lint typecheck bench-store bench-algos bench-pipeline bench-memory clean

venv: $(STAMP)

# torch==2.13.0 first keeps the CPU build; the rest resolves against it, pinned to the tested
# set of .ci/constraints.txt (pyproject.toml keeps ranges; .ci/lower-bounds tests their floors).
$(STAMP): pyproject.toml .ci/constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 numpy -c .ci/constraints.txt
	$(PY) -m pip install -q -e '.[test]' -c .ci/constraints.txt
	touch $(STAMP)

train: venv
	$(VENV)/bin/ppoflow train $(ARGS)

test: venv
	$(PY) -m pytest -q $(ARGS)

test-all: venv
	$(PY) -m pytest -q -m '' $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy --strict storage tasks flows infra

bench-store: venv
	$(PY) benchmarks/store.py

bench-algos: venv
	$(PY) benchmarks/algos.py

# bench-pipeline: ppoflow vs TRL, fixed-length GRPO and PPO (the default --modes grpo ppo);
# the variable-length GRPO workload (responses end at EOS, up to 256 tokens, groups of 8):
#   make bench-pipeline ARGS="--modes grpo-varlen --steps 5 --warmup 2 --rounds 1 \
#       --wait-load 1.0 --output benchmarks/results/pipeline-varlen.json"
bench-pipeline: venv
	$(PY) benchmarks/pipeline.py $(ARGS)

bench-memory: venv
	$(PY) benchmarks/memory.py

clean:
	rm -rf $(VENV) runs .ppoflow
