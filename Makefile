# Set-up on a fresh machine is two commands: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# checkov (tests/infra/test_checkov.py) pins packaging<24, older than the project's: its own venv, inside ours so
# `make clean` removes it and .gitignore already covers it.
CHECKOV_VENV := $(VENV)/checkov

.PHONY: install demo plan train-demo test lint golden bench bench-ray clean

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

# Ray Train's elastic prototype (bench/ray_proto/README.md): a local Ray cluster loses a "slice" node mid-run and gets it
# back. Ray is 1.3 GB with its dependencies, so it gets a venv of its own, not the test install.
RAY_VENV := $(VENV)/ray
bench-ray: install
	test -x $(RAY_VENV)/bin/python || $(PY) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install -q -e '.[trainer]' -r tools/ray-requirements.txt
	RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=25 $(RAY_VENV)/bin/python bench/ray_proto/proto.py --scenario node --steps 60

clean:
	rm -rf $(VENV) runs plan-out .pytest_cache .ruff_cache tools/node_modules
