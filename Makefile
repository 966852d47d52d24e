# One-command setup on a fresh machine: `make test`, `make demo`, `make bench`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
# the newest transformers tested (pyproject.toml admits any newer: a fresh machine's suite stays the
# one that passed; docs/install.md)
TRANSFORMERS_SPEC ?= transformers==5.25.0
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: setup test demo bench lint clean test-wheel test-newest test-oldest test-slurm

setup: $(STAMP)

# Rebuild when the native sources or the project metadata change.
$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h) hyperparallel/fusion/vf_table.txt hyperparallel/fusion/vf_spec.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	HYPERPARALLEL_NATIVE_REQUIRED=1 $(PIP) install -q --no-build-isolation -e ".[test,gpu]" "$(TRANSFORMERS_SPEC)"
	touch $(STAMP)

# What only the benchmarks compare against (torchao, accelerate for the HF Trainer): not in the
# default environment, where torchao would print its load failures into a user's own scripts.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q --no-build-isolation -e ".[test,gpu,bench]"
	touch $(BENCH_STAMP)

test: setup
	$(VENV)/bin/ruff check hyperparallel tests benchmarks
	$(PY) -m pytest -p no:cacheprovider --durations=15 --ignore=tests/slurm tests

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

# The wheel a cluster user installs, checked outside the checkout (scripts/check_wheel.sh).
test-wheel: setup
	PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" scripts/check_wheel.sh

# The newest releases that install here and the oldest pyproject.toml accepts, each in a venv of
# its own, running the part of the suite that leans on torch's and transformers' internals
# (docs/install.md says which and why). This machine's pip is capped at the torch it keeps on
# disk (/etc/xdg/pip): PIP_CONSTRAINT=/dev/null lifts the cap for the newest.
NEWEST ?= torch==2.15.0 transformers==5.25.0
OLDEST ?= torch==2.13.0 transformers==5.24.0
# (tests/models/test_coverage.py: the sweep's matrix is the default transformers', docs/models.md)
CROSS_TESTS ?= tests/models tests/kernels tests/mx tests/lowp tests/fusion tests/moe tests/checkpoint \
	tests/train/test_loop.py tests/train/test_deepseek_v4.py tests/train/test_examples.py tests/train/test_wandb.py \
	--ignore=tests/models/test_coverage.py

.venv-newest/.installed: $(STAMP) Makefile
	test -x .venv-newest/bin/python || $(PYTHON) -m venv .venv-newest
	PIP_CONSTRAINT=/dev/null .venv-newest/bin/pip install -q --upgrade pip setuptools wheel
	HYPERPARALLEL_NATIVE_REQUIRED=1 PIP_CONSTRAINT=/dev/null .venv-newest/bin/pip install -q --no-build-isolation -e ".[test,gpu]" $(NEWEST)
	touch $@

.venv-oldest/.installed: $(STAMP) Makefile
	test -x .venv-oldest/bin/python || $(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/pip install -q --upgrade pip setuptools wheel
	HYPERPARALLEL_NATIVE_REQUIRED=1 .venv-oldest/bin/pip install -q --no-build-isolation -e ".[test,gpu]" $(OLDEST)
	touch $@

test-newest: .venv-newest/.installed
	.venv-newest/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	.venv-newest/bin/python -m pytest -p no:cacheprovider $(CROSS_TESTS)

test-oldest: .venv-oldest/.installed
	.venv-oldest/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	.venv-oldest/bin/python -m pytest -p no:cacheprovider $(CROSS_TESTS)

# scripts/slurm/train.sbatch against a real slurmctld and two slurmd that tests/slurm starts on this
# machine (Debian's packages, installed here when missing: that needs root).
test-slurm: setup
	command -v slurmctld >/dev/null || test -x /usr/sbin/slurmctld || \
		{ apt-get update -q && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client; }
	$(PY) -m pytest -p no:cacheprovider tests/slurm

lint: setup
	$(VENV)/bin/ruff check hyperparallel tests benchmarks

clean:
	rm -rf $(VENV) .venv-newest .venv-oldest build *.egg-info hyperparallel/_*_native*.so
