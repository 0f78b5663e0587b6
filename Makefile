# The Distributed Training Lab. Two commands do everything on a fresh machine:
#   make lab    set up (first time only) and open the course in JupyterLab
#   make test   set up (first time only) and run every test that needs no GPU
# Set-up: a virtual environment in .venv, torch pinned and installed first (so nothing pulls
# an unpinned torch with gigabytes of CUDA packages), then labkit editable with its dev extras.
# tools/torch_install.py picks the build: the CPU wheel on Linux without an NVIDIA GPU, the CUDA
# build with one (TORCH_INDEX_URL=URL, or =default for pip's own index, overrides it).
# It re-runs only when pyproject.toml or this Makefile changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.labkit-installed
TORCH_PIN := torch==2.13.0
# Parallel test workers: one per core on the 2-core CI machine. --dist loadfile keeps each
# file (and each notebook) on one worker. The lessons run once, in tests/lessons (the learner's-eye
# tier: Run All under load, outputs checked); nbval runs the solutions.
WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: lab test setup grade bench doctor exercises test-fast test-gpu clean help workshop-check calculators

help:
	@echo "make lab        set up and open the course in JupyterLab"
	@echo "make test       set up and run every test tier that needs no GPU"
	@echo "make grade NB=exercises/01_memory_math.ipynb   grade an exercise notebook"
	@echo "make bench      benchmarks that print figures (launcher, collectives, ddp, zero, fsdp, tp, pp, 3d)"
	@echo "make doctor     is this machine ready for the course?"
	@echo "make exercises  regenerate exercises/ from solutions/"
	@echo "make test-gpu   GPU-only tests (on a CUDA machine)"
	@echo "make calculators  the course's calculators as one web app (Voila; 127.0.0.1, token)"
	@echo "make workshop-check  preflight this machine for a workshop (ARGS=--json ...)"

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	@echo ">> installing $(TORCH_PIN), then labkit[dev] into $(VENV)"
	$(PY) tools/torch_install.py "$(TORCH_PIN)"
	$(PY) -m pip install --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(PY) -m labkit course

# `labkit` is on the PATH in JupyterLab's terminals (and after `source .venv/bin/activate`);
# this target works from any shell in the checkout. A partial grade (labkit grade's exit 1)
# ends on its score, not on make's "Error 1"; a notebook it cannot grade (2) or an interrupt
# still fails. Scripts and CI that need the pass/fail status call `labkit grade` itself.
grade:
	@test -n "$(NB)" || { echo "make grade: NB is missing; e.g. make grade NB=exercises/01_memory_math.ipynb" >&2; exit 2; }
	@$(MAKE) --no-print-directory setup
	$(PY) -m labkit grade "$(NB)" || test $$? -eq 1

doctor: setup
	$(PY) -m labkit doctor

test: setup
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --nbval-lax --nbval-current-env \
		tests $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -n $(WORKERS) --dist loadfile -m "not multirank and not notebook and not server" tests

test-gpu: setup
	$(PY) -m pytest -m gpu tests

calculators: setup
	$(PY) -m labkit calculators

workshop-check: setup
	$(PY) -m labkit workshop check $(ARGS)

bench: setup
	$(PY) -m labkit bench all

exercises: setup
	$(PY) -m labkit.course.exercises

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
