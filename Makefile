# Set-up on a fresh machine is two commands: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# checkov (tests/infra/test_checkov.py) pins packaging<24, older than the project's: its own venv, inside ours so
# `make clean` removes it and .gitignore already covers it.
CHECKOV_VENV := $(VENV)/checkov

.PHONY: install demo plan train-demo test lint golden bench clean

$(STAMP): pyproject.toml tools/package-lock.json tools/checkov-requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	npm --prefix tools ci --no-audit --no-fund --loglevel=error
	test -x $(CHECKOV_VENV)/bin/python || $(PY) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install -q -r tools/checkov-requirements.txt
	touch $(STAMP)

install: $(STAMP)

# The plans of every environment, then the trainer on its embedded local default (2 processes x 4 CPU devices).
demo: install plan train-demo

plan: install
	$(BIN)/gke-tpu-rl plan --all

train-demo: install
	$(BIN)/gke-tpu-rl train --local-processes 2 --devices-per-process 4

lint: install
	$(BIN)/ruff check .

test: install lint
	$(BIN)/pytest -q

# Rewrites tests/golden/ from the current program; review the diff like any other change.
golden: install
	UPDATE_GOLDEN=1 $(BIN)/pytest -q tests/infra/test_plan.py

bench: install
	$(PY) -m bench.train_step
	$(PY) -m bench.sampler

clean:
	rm -rf $(VENV) runs plan-out .pytest_cache .ruff_cache tools/node_modules
