# torchtitan_ext — one-command set-up on a fresh machine (CPU-only is fine).
#   make demo   : venv + install + embedded data, then train the llama3 debug model ~20 steps on CPU
#   make demo-vl: venv + install, build the sample Qwen3-VL cache, train the tiny Qwen3-VL 20 steps on CPU
#   make test   : venv + install, then the test suite (random order, HOME must stay empty)
#   make test-alone : every test in its own pytest process (slow: ~45 min on 2 cores with PYTEST_ARGS="-j 2")
#   make bench-results : every benchmark, then benchmarks/RESULTS.md
#   make gpu-check : the GPU acceptance run (CUDA tests, staging, Qwen3-VL eager/compiled, text resume, a 2B
#                    flavor's step time, MFU, data wait, memory); says so and exits 0 without CUDA
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= train_configs/llama3_debug_cpu.toml
ARGS ?=
PYTEST_ARGS ?=

VL_CONFIG ?= train_configs/qwen3_vl_tiny_cpu.toml

.PHONY: setup demo demo-resume demo-vl test test-fast test-alone lint bench bench-results clean-demo gpu-check

setup: $(STAMP)

# torch is installed first and pinned: on a machine without a GPU the local CPU wheel of
# torch 2.13.0 is used, so nothing pulls a multi-GB CUDA build; pyproject pins the same version.
# Each step says what it does first (pip -q is silent for up to a few minutes).
$(STAMP): pyproject.toml $(wildcard setup.py)
	@echo "==> set-up 1/4: virtual environment $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo "==> set-up 2/4: torch 2.13.0 (the CPU build without a GPU; the largest download)"
	@$(PY) -m pip install -q "torch==2.13.0"
	@echo "==> set-up 3/4: torchtitan_ext + pinned dependencies (editable; compiles the BPE merge loop)"
	@# setuptools boxes an informational note about editable installs; only that note is hidden
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[test]"
	@echo "==> set-up 4/4: embedded corpus + its tokenizer (built once, a few seconds)"
	@$(PY) -c "from torchtitan_ext.data.embedded import ensure_embedded_data as e; print('    ', e())"
	@touch $(STAMP)
	@echo "==> set-up done"

demo: setup
	@echo "==> training the llama3 debug model on CPU: $(CONFIG) (checkpoints in outputs/llama3_debug_cpu)"
	$(PY) -m torchtitan_ext.train --config-file $(CONFIG) $(ARGS)

# Continue the demo job 10 steps past its last checkpoint.
demo-resume: setup
	$(PY) -m torchtitan_ext.train --config-file $(CONFIG) --training.steps 30 $(ARGS)

# The tiny Qwen3-VL on the shipped sample set: the cache first (the same key as the config's
# [dataloader] table, so the training job finds it), then 20 steps; re-running resumes.
demo-vl: setup
	$(VENV)/bin/preprocess-cached --dataset sample --seq-len 1024 --buffer-size 16 \
		--buckets 512,768 --cache-dir ./outputs/vl_cache --quiet
	$(PY) -m torchtitan_ext.train --config-file $(VL_CONFIG) $(ARGS)

# Start the demo over (its checkpoints are what `make demo` resumes from).
clean-demo:
	rm -rf outputs/llama3_debug_cpu outputs/qwen3_vl_tiny_cpu

# The suite runs in a random order (pytest-randomly; the header prints the seed, rerun one with
# PYTEST_ARGS="-n 0 --randomly-seed=N", file order with PYTEST_ARGS="-n 0 -p no:randomly"), in
# TEST_WORKERS processes (pytest-xdist; 0: this one process), with HOME set to an empty
# directory that must still be empty afterwards (the suite keeps its caches in its own temporary
# directory: tests/conftest.py).
TEST_WORKERS ?= 2
test: setup
	$(PY) scripts/check_home_untouched.py -- $(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Each test alone, in a fresh process (catches tests that pass only after another one).
test-alone: setup
	$(PY) scripts/run_tests_alone.py $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not integration" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check torchtitan_ext scripts benchmarks tests

bench: setup
	$(PY) -m benchmarks --list

# Run every benchmark case and regenerate benchmarks/RESULTS.md (long: ~1 h on 2 cores).
#   make bench-results BENCH_ARGS="--quick"    a smoke run of the generator
#   make bench-results BENCH_ARGS="--note 'quiet machine'"
BENCH_ARGS ?=
bench-results: setup
	$(PY) -m benchmarks --results $(BENCH_ARGS)

# The GPU acceptance run: one table of pass/fail checks and figures (rows also in
# outputs/gpu_check/results.json). GPU_CHECK_ARGS="--quick" for a smoke run.
GPU_CHECK_ARGS ?=
gpu-check: setup
	$(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)
