# Two entry points: `make run` (train the default GPT) and `make test` (the whole suite).
# Both create .venv on first use. When the venv has no torch, torch==2.13.0 is installed first: the
# development and CI machines carry a CPU wheel of exactly that version for pip, while an unpinned
# install would fetch the newest multi-GB CUDA build. pyproject.toml keeps the supported range torch>=2.6.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
NPROC ?= auto

# gpu-check runs tests/gpu, the GPT-2 124M benchmark (as configured, reading the loss every step, and at micro-batch
# 32 with the head fused into the loss) and the planner's calibration against measured single-GPU layouts
# (benchmarks/plan_gpu.py), then Runtime in a user's loop against a raw loop, Fabric and Accelerate
# (benchmarks/library_loop.py; GPU_WHEELS: a folder of wheels for the last two, for a machine without network). GPU_PY is the Python whose PyTorch has CUDA: by
# default the venv's; on a machine with CUDA PyTorch already installed and no network, `make gpu-check
# GPU_PY=python3` installs this checkout (editable, no dependencies) into that Python instead, unless it
# already imports trainmesh from here. Without CUDA the tests are
# skipped and the benchmark runs a tiny CPU version, so the target works everywhere.
GPU_PY ?= $(PY)
GPU_OUT ?= runs/gpu-check
GPU_WHEELS ?=

# test-ray runs the optional Ray Train tier (tests/ray_train: trainmesh inside TorchTrainer on a local 2-CPU Ray) in
# a venv of its own, RAY_VENV, with the [ray] extra: Ray is large and trainmesh does not need it, so `make test`'s
# venv stays without it and skips that tier.
RAY_VENV ?= .venv-ray
RAY_PY := $(RAY_VENV)/bin/python

.PHONY: run test lint typecheck bench gpu-check test-ray clean

# `make run` installs what the default job needs (trainmesh and its core dependencies); `make test` adds the dev
# extras (the tokenizer, data, tracker and fp8 packages the suite exercises, ruff and mypy) on top.
$(VENV)/.installed-run: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.installed-run
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(RAY_VENV)/.installed: pyproject.toml
	test -x $(RAY_PY) || python3 -m venv $(RAY_VENV)
	$(RAY_PY) -c "import torch" 2>/dev/null || $(RAY_PY) -m pip install -q $(TORCH_PIN)
	$(RAY_PY) -m pip install -q -e ".[dev,ray]"
	touch $@

run: $(VENV)/.installed-run
	$(VENV)/bin/trainmesh run gpt --config configs/gpt-tiny.toml --nproc-per-node $(NPROC)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

# The suite runs in TEST_WORKERS processes (pytest-xdist): its multi-process tests wait on launches, rendezvous and
# timers for much of their time, which the other workers' tests fill; a worker that runs out takes another's. On the
# 2-core development machine, clean clones: 2 workers, pytest 22 min; 3 workers, 15 min (the per-test timeout in
# pyproject.toml leaves room for the slowest tests beside two others).
TEST_WORKERS ?= 3

test: lint typecheck
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=40 -n $(TEST_WORKERS) --dist worksteal

test-ray: $(RAY_VENV)/.installed
	OMP_NUM_THREADS=1 $(RAY_PY) -m pytest -q -rs --durations=5 tests/ray_train

bench: $(VENV)/.installed-run
	OMP_NUM_THREADS=1 $(PY) benchmarks/overhead.py

gpu-check: $(if $(filter $(PY),$(GPU_PY)),$(VENV)/.installed)
	$(GPU_PY) -c "import sys, trainmesh; sys.exit(not trainmesh.__file__.startswith('$(CURDIR)/src/'))" 2>/dev/null \
		|| $(GPU_PY) -m pip install -q --no-deps --no-build-isolation -e .
	mkdir -p $(GPU_OUT)
	$(GPU_PY) -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'devices', torch.cuda.device_count())"
	OMP_NUM_THREADS=4 $(GPU_PY) -m pytest -q -rs --durations=15 -p no:cacheprovider --timeout=300 tests/gpu $(GPU_TEST_ARGS)
	OMP_NUM_THREADS=4 $(GPU_PY) benchmarks/gpu_gpt2.py --json $(GPU_OUT)/gpu_gpt2.json $(GPU_BENCH_ARGS)
	OMP_NUM_THREADS=4 $(GPU_PY) benchmarks/gpu_gpt2.py --log-every 1 --rounds 2 --no-profile \
		--json $(GPU_OUT)/gpu_gpt2_every1.json $(GPU_BENCH_ARGS)
	OMP_NUM_THREADS=4 $(GPU_PY) benchmarks/gpu_gpt2.py --micro-batch 32 --rounds 2 --no-profile \
		--model.loss_chunk_tokens=8192 --json $(GPU_OUT)/gpu_gpt2_chunked32.json $(GPU_BENCH_ARGS)
	OMP_NUM_THREADS=4 $(GPU_PY) benchmarks/plan_gpu.py --json $(GPU_OUT)/plan_gpu.json
	$(if $(GPU_WHEELS),$(GPU_PY) -m pip install -q --no-index --find-links $(GPU_WHEELS) lightning accelerate || true)
	OMP_NUM_THREADS=4 $(GPU_PY) benchmarks/library_loop.py --json $(GPU_OUT)/library_loop.json

clean:
	rm -rf $(VENV) $(RAY_VENV) runs .pytest_cache .mypy_cache .ruff_cache
