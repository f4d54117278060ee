# Two entry points: `make run` (train the default GPT) and `make test` (the whole suite).
# Both create .venv on first use. When the venv has no torch, torch==2.13.0 is installed first: the
# development and CI machines carry a CPU wheel of exactly that version for pip, while an unpinned
# install would fetch the newest multi-GB CUDA build. pyproject.toml keeps the supported range torch>=2.6.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
NPROC ?= auto

.PHONY: run test lint typecheck unit bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/trainmesh run gpt --config configs/gpt-tiny.toml --nproc-per-node $(NPROC)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

test: lint typecheck
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=15

bench: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
