# Two commands on a fresh clone: `make demo` trains the default model, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow test-all plan bench gpu reproduce reproduce-more lm docs readme

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

test-slow: $(BIN)/pipejax  # the slow cases alone, which `make test` skips (CI runs both)
	$(BIN)/python -m pytest -q -n 2 --all -m slow

test-all: $(BIN)/pipejax  # the slow cases too (12 minutes on 2 cores)
	$(BIN)/python -m pytest -q -n 2 --all

bench: $(BIN)/pipejax
	cd benchmarks && ../$(BIN)/python run_all.py && ../$(BIN)/python overhead.py && ../$(BIN)/python schedules.py && ../$(BIN)/python cpu_deadlock.py \
		&& ../$(BIN)/python forecast_cost.py && ../$(BIN)/python quadratic.py && ../$(BIN)/python spectrain_error.py \
		&& ../$(BIN)/python nnx_twins.py && ../$(BIN)/python train_models.py

# The GPU section (6 to 7 minutes): on a machine whose python3 has a JAX that sees a GPU, it runs
# with that interpreter's own packages (no .venv: GPU machines may be offline) and writes
# benchmarks/results/bench_gpu.json; elsewhere it says so and runs the smoke path on the CPU.
gpu:
	@if $(PYTHON) -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then \
		PYTHONPATH=. $(PYTHON) -m pipejax bench --only gpu; \
	else \
		echo "make gpu: $(PYTHON)'s JAX sees no GPU; running the gpu section's smoke path here"; \
		$(MAKE) --no-print-directory $(BIN)/pipejax && $(BIN)/python -m pipejax bench --only gpu --smoke; \
	fi

# The convergence tables of the staleness mitigations in the papers' regime (40 minutes on 2 cores).
reproduce: $(BIN)/pipejax
	cd benchmarks && ../$(BIN)/python convergence.py

# SpecTrain's Table 1 (20 minutes) and the data-parallel rules at three batch sizes (12 minutes).
reproduce-more: $(BIN)/pipejax
	cd benchmarks && ../$(BIN)/python spectrain_table.py && ../$(BIN)/python data_parallel.py

# The language model: the synchronous schedules' table (25 minutes), every table's step against
# 1F1B's (30 minutes), zero bubble's split compiled alone (3 minutes) and the default GPT's
# validation loss and sample (15 minutes); the first and the last fetch the Shakespeare corpus once.
lm: $(BIN)/pipejax
	cd benchmarks && ../$(BIN)/python lm_table.py --remat stage && ../$(BIN)/python lm_table.py --remat none \
		&& ../$(BIN)/python table_speed.py && ../$(BIN)/python split_alone.py \
		&& ../$(BIN)/python lm_sample.py

# The documentation site into site/, strict: a broken link, a missing reference or a warning fails it.
docs: $(BIN)/pipejax
	$(BIN)/pip install --quiet -e ".[test,docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The README's figures (between its <!-- from: --> marks) written from benchmarks/results.
readme: $(BIN)/pipejax
	$(BIN)/python docs/hooks.py
