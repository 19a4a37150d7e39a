# Two commands on a fresh clone: `make demo` trains the default model, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test plan bench

$(BIN)/pipejax: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

demo: $(BIN)/pipejax
	$(BIN)/pipejax train

plan: $(BIN)/pipejax
	$(BIN)/pipejax plan

test: $(BIN)/pipejax
	$(BIN)/python -m pytest -q -n 2

bench: $(BIN)/pipejax
	cd benchmarks && ../$(BIN)/python overhead.py && ../$(BIN)/python schedules.py && ../$(BIN)/python cpu_deadlock.py
