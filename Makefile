# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create .venv and install the project into it first (torch pinned to
# 2.13.0, the CPU build these machines carry on local disk).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.flare-installed

.PHONY: install serve test

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: install
	$(BIN)/flare run $(FLARE_RUN_ARGS)

# The suite, in one worker per core (at most 4; PYTEST_WORKERS=0 runs it in this
# process), each test file whole on one worker; then its numerics tests (floats of
# two execution paths) again under the portable scalar kernels instead of this
# CPU's vector ones: a tolerance that holds only for the kernels of the machine a
# test was written on fails here, not on the next machine (NUMERICS_KERNELS=none
# skips that pass). --durations lists the slowest tests in every run.
PYTEST_WORKERS ?= auto
NUMERICS_KERNELS ?= default

test: install
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile --durations=15 $(PYTEST_ARGS)
	@if [ "$(NUMERICS_KERNELS)" != none ]; then \
	  echo "numerics tests again with ATEN_CPU_CAPABILITY=$(NUMERICS_KERNELS):"; \
	  ATEN_CPU_CAPABILITY=$(NUMERICS_KERNELS) $(BIN)/python -m pytest -q -m numerics -p no:cacheprovider; \
	fi
