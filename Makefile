# Two entry points: `make run` (main job) and `make test`; both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: setup run test test-all
setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m runner $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)
