# hpctrain: `make submit` runs the example job, `make test` runs the tests. Both set themselves up.
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
BIN := $(VENV)/bin
CONFIG ?= slurm/examples/tiny-cpu.toml
ARGS ?=
# the tests to run: every tier by default; one tier with TESTS=tests/pure (or tests/multiproc, tests/cluster)
TESTS ?= tests
# three tests at once (pytest-xdist): a serial run left this host idle half its time; tests/conftest.py keeps the
# Slurm tests on one worker and lets a test marked `alone` run with nothing beside it. JOBS=0: one test at a time.
JOBS ?= 3
# torch is pinned to the local CPU wheel only when the virtualenv has no torch at all; on a cluster, make the venv with
# VENV_FLAGS=--system-site-packages to use the site's CUDA torch instead: hpctrain/install_guard.py keeps a site torch
# at or above setup.cfg's floor, refuses an older one (or none) with the fix, and never lets pip replace it.
TORCH_SPEC ?= torch==2.13.0
# torchao (float8 layers) for the torch above only: the tests train train.precision = "fp8" on the CPU with it
TORCHAO_SPEC ?= torchao==0.18.0
# The mpich wheel gives mpi4py an MPI where the machine has none; with a site MPI (mpicc on PATH) it is skipped.
MPI_WHEEL ?= $(if $(shell command -v mpicc 2>/dev/null),,mpich)
STAMP := $(VENV)/.hpctrain-installed
# hpctrain's sources (and the tests') byte-compiled before a run; only what changed since is compiled again. Where
# PYTHONDONTWRITEBYTECODE is set (CI here) nothing writes .pyc files, and every rank and test process would compile
# them again: about 0.2 s of CPU per process
PYC := $(BIN)/python -m compileall -q hpctrain tests benchmarks > /dev/null

.PHONY: install test submit bench lint slurm-up slurm-down clean

install: $(STAMP)

$(STAMP): setup.py setup.cfg hpctrain/install_guard.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m hpctrain.install_guard --torch-spec "$(TORCH_SPEC)" $(if $(filter file,$(origin TORCH_SPEC)),,--asked) --torchao-spec "$(TORCHAO_SPEC)" $(MPI_WHEEL)
	touch $(STAMP)

test: install data/corpus.bin
	$(PYC)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(JOBS) --durations=30 $(TESTS) $(ARGS)

submit: install data/corpus.bin
	$(PYC)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/hpctrain submit $(CONFIG) --wait $(ARGS)

# the bundled training corpus: this project's own source and docs, byte-level tokens
data/corpus.bin: | install
	$(BIN)/hpctrain data build $@

bench: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python benchmarks/run_all.py $(ARGS)

lint: install
	$(BIN)/python -m pip install -q ruff
	$(BIN)/python -m ruff check hpctrain tests benchmarks

slurm-up:
	bash slurm/cluster.sh up

slurm-down:
	bash slurm/cluster.sh down

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache runs
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
