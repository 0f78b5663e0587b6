# The Distributed Training Lab. Two commands do everything on a fresh machine:
#   make lab    set up (first time only) and open the course in JupyterLab
#   make test   set up (first time only) and run every test that needs no GPU
# Set-up: a virtual environment in .venv, torch pinned and installed first (so nothing pulls
# an unpinned torch with gigabytes of CUDA packages), then labkit editable with its dev extras.
# It re-runs only when pyproject.toml or this Makefile changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.labkit-installed
TORCH_PIN := torch==2.13.0
# Parallel test workers: one per core on the 2-core CI machine. --dist loadfile keeps each
# file (and each notebook) on one worker.
WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: lab test setup bench doctor exercises test-fast test-gpu clean help

help:
	@echo "make lab        set up and open the course in JupyterLab"
	@echo "make test       set up and run every test tier that needs no GPU"
	@echo "make bench      benchmarks that print figures (launcher, collectives)"
	@echo "make doctor     is this machine ready for the course?"
	@echo "make exercises  regenerate exercises/ from solutions/"
	@echo "make test-gpu   GPU-only tests (on a CUDA machine)"

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	@echo ">> installing $(TORCH_PIN), then labkit[dev] into $(VENV)"
	$(PY) -m pip install --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(PY) -m labkit course

doctor: setup
	$(PY) -m labkit doctor

test: setup
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --nbval-lax --nbval-current-env \
		tests notebooks solutions $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -n $(WORKERS) --dist loadfile -m "not multirank and not notebook and not server" tests

test-gpu: setup
	$(PY) -m pytest -m gpu tests

bench: setup
	$(PY) -m labkit bench all

exercises: setup
	$(PY) -m labkit.course.exercises

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
