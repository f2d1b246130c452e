# torchtitan_ext — one-command set-up on a fresh machine (CPU-only is fine).
#   make demo   : venv + install + embedded data, then train the llama3 debug model ~20 steps on CPU
#   make demo-vl: venv + install, build the sample Qwen3-VL cache, train the tiny Qwen3-VL 20 steps on CPU
#   make test   : venv + install, then the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= train_configs/llama3_debug_cpu.toml
ARGS ?=
PYTEST_ARGS ?=

VL_CONFIG ?= train_configs/qwen3_vl_tiny_cpu.toml

.PHONY: setup demo demo-resume demo-vl test test-fast lint bench clean-demo

setup: $(STAMP)

# torch is installed first and pinned: on a machine without a GPU the local CPU wheel of
# torch 2.13.0 is used, so nothing pulls a multi-GB CUDA build; pyproject pins the same version.
$(STAMP): pyproject.toml $(wildcard setup.py)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -c "from torchtitan_ext.data.embedded import ensure_embedded_data as e; print('embedded data:', e())"
	touch $(STAMP)

demo: setup
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

clean-demo:
	rm -rf outputs/llama3_debug_cpu outputs/qwen3_vl_tiny_cpu

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check torchtitan_ext scripts benchmarks tests

bench: setup
	$(PY) -m benchmarks --list
