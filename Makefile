# One-command setup on a fresh machine: `make test`, `make demo`, `make bench`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: setup test demo bench lint clean

setup: $(STAMP)

# Rebuild when the native sources or the project metadata change.
$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h) hyperparallel/fusion/vf_table.txt hyperparallel/fusion/vf_spec.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q --no-build-isolation -e ".[test,gpu]"
	touch $(STAMP)

# What only the benchmarks compare against (torchao, accelerate for the HF Trainer): not in the
# default environment, where torchao would print its load failures into a user's own scripts.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q --no-build-isolation -e ".[test,gpu,bench]"
	touch $(BENCH_STAMP)

test: setup
	$(VENV)/bin/ruff check hyperparallel tests benchmarks
	$(PY) -m pytest -p no:cacheprovider --durations=15 tests

demo: setup
	$(PY) -m hyperparallel train
	@echo "hyperparallel is in $(VENV)/bin; for the commands of README.md and docs/ as written: source $(VENV)/bin/activate"

# Every benchmark of `hyperparallel bench` (tests/docs holds the list to hyperparallel/cli.py's).
bench: $(BENCH_STAMP)
	$(PY) -m hyperparallel bench mx
	$(PY) -m hyperparallel bench lowp
	$(PY) -m hyperparallel bench train
	$(PY) -m hyperparallel bench fsdp
	$(PY) -m hyperparallel bench checkpoint
	$(PY) -m hyperparallel bench fusion
	$(PY) -m hyperparallel bench moe
	$(PY) -m hyperparallel bench parallel
	$(PY) -m hyperparallel bench pipeline
	$(PY) -m hyperparallel bench kernels
	$(PY) -m hyperparallel bench data

lint: setup
	$(VENV)/bin/ruff check hyperparallel tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info hyperparallel/_mx_native*.so hyperparallel/_dvm_native*.so
