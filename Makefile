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

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
