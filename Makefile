# Set-up on a fresh machine is two commands: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# checkov (tests/infra/test_checkov.py) pins packaging<24, older than the project's: its own venv, inside ours so
# `make clean` removes it and .gitignore already covers it.
CHECKOV_VENV := $(VENV)/checkov
# cdktf (`gke-tpu-rl synth`, infra/terraform/cdktf_app.py) is deprecated upstream: its own pinned venv too, nothing
# imports it.
CDKTF_VENV := $(VENV)/cdktf
# uv installs what pip would (the same resolution: every index and wheel folder at once, the best version wins),
# downloading and unpacking in parallel. It reads no pip config (pip.conf, PIP_INDEX_URL, constraints): it is handed
# only $PIP_FIND_LINKS, each of its space-separated entries (on this machine the wheel folder holding the CPU build of
# torch; without it torch==2.13.0 is PyPI's CUDA build, as it would be for pip). An index or wheel folder set only in
# pip.conf must be given to uv too (UV_INDEX, UV_FIND_LINKS: uv's own settings). --compile-bytecode as pip does: the as-deployed harness's pods run with PYTHONDONTWRITEBYTECODE=1 (the
# image's env), so without .pyc files every process compiled every module it imported (+26% test CPU).
UV_VERSION := uv==0.13.9
UV_INSTALL = $(BIN)/uv pip install -q --compile-bytecode --index-strategy unsafe-best-match $(foreach link,$(PIP_FIND_LINKS),--find-links $(link))
# tinker-cookbook (the official Tinker recipes, run against our service) goes in with --no-deps: it declares
# tml-renderers>=0.4.1, which is not on PyPI; what its RL recipe imports is in pyproject's dev extra.

.PHONY: install demo plan train-demo test suite test-long deployed lint typecheck golden bench bench-ray bench-tinker bench-tunix clean

$(STAMP): pyproject.toml tools/package-lock.json tools/checkov-requirements.txt tools/cdktf-requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(UV_VERSION)
	$(UV_INSTALL) --python $(PY) -e '.[dev]'
	$(UV_INSTALL) --python $(PY) --no-deps tinker-cookbook==0.6.1
	npm --prefix tools ci --no-audit --no-fund --loglevel=error
	test -x $(CHECKOV_VENV)/bin/python || $(PY) -m venv --without-pip $(CHECKOV_VENV)
	$(UV_INSTALL) --python $(CHECKOV_VENV)/bin/python -r tools/checkov-requirements.txt
	test -x $(CDKTF_VENV)/bin/python || $(PY) -m venv --without-pip $(CDKTF_VENV)
	$(UV_INSTALL) --python $(CDKTF_VENV)/bin/python -r tools/cdktf-requirements.txt
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

# mypy on every package (pyproject's [tool.mypy]); its cache (.mypy_cache) makes later runs take seconds.
typecheck: install
	$(BIN)/mypy

# Three workers (pytest-xdist) on 2 cores: files whose tests start several processes run one at a time on one worker
# (tests/conftest.py), and those tests spend much of their time waiting on their processes (Ray, servers, restarts);
# a third worker fills those waits (a clean clone's suite: 1,352 s on 2 workers, 1,130 s on 3, the machine busy
# throughout). Longer variants of cases it covers (marked `long`) run in `make test-long`.
PYTEST_WORKERS ?= 3
# ruff, mypy and the suite at once: mypy is one process on one core, so beside the suite it costs a fraction of the
# minute it took before it. Any of them failing fails `make test`. (The recursive make gets -o for the stamp that
# `install` has just made current, or that the caller's own -o said to take as it is.)
test: install
	$(MAKE) --no-print-directory -j3 -o $(STAMP) lint typecheck suite

# The repo's modules compiled once first: where PYTHONDONTWRITEBYTECODE is set (this machine kind's environment, and
# the harness's pods, as in the image), each of the suite's few hundred Python processes otherwise compiled every module
# of the repo it imported (the installed packages are compiled at install: UV_INSTALL's --compile-bytecode). Not the
# fixtures: scripts that made them, which no test imports (and test_hf_reference lists their folders).
suite: install
	$(PY) -m compileall -q -x tests/fixtures/ envspec infra workloads trainer tests bench
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) -m "not long"

test-long: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) -m long

# The as-deployed harness alone (docs/as-deployed.md): every environment's rendered workloads run on this machine.
# Needs root (network namespaces); part of `make test`.
deployed: install
	$(BIN)/pytest -q tests/deployed

# Rewrites tests/golden/ from the current program; review the diff like any other change.
golden: install
	UPDATE_GOLDEN=1 $(BIN)/pytest -q tests/infra/test_plan.py tests/infra/test_terraform.py

bench: install
	$(PY) -m bench.train_step
	$(PY) -m bench.sampler

# The Ray path's elastic run on a local CPU Ray cluster (bench/README.md): SIGKILL one worker (same-size restart,
# bitwise), then lose a "slice" node mid-run and get it back. Ray is in the dev install (pyproject's `ray` extra).
bench-ray: install
	$(PY) bench/ray_elastic.py --steps 20 --kill-step 6 --work runs/bench-ray-kill --out runs/bench-ray-kill.json
	$(PY) bench/ray_elastic.py --steps 90 --loss-step 8 --readd --work runs/bench-ray-node --out runs/bench-ray-node.json

# Our Tinker-compatible service against the reference server skyrl 0.4.0 on the same tiny model, alternating rounds
# (bench/README.md). skyrl needs Python >= 3.12 and pins tinker<0.26: its own venv, git-ignored (~7 GB: torch with
# CUDA libraries comes with it). The clients are our venv's tinker.
SKYRL_VENV ?= .venv-skyrl
# The first Python >= 3.12 that runs (a pyenv shim of python3.12 may exist and refuse to run).
SKYRL_PYTHON ?= $(shell for p in python3.12 python3.13 /root/.pyenv/versions/3.12.1/bin/python; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)

$(SKYRL_VENV)/.installed-stamp:
	test -x $(SKYRL_VENV)/bin/python || $(SKYRL_PYTHON) -m venv $(SKYRL_VENV)
	$(SKYRL_VENV)/bin/python -m pip install -q "skyrl[tinker,jax]==0.4.0" aiohttp uv
	touch $@

bench-tinker: install $(SKYRL_VENV)/.installed-stamp
	$(PY) -m bench.tinker_service --skyrl-venv $(SKYRL_VENV) --json runs/bench-tinker.json

# Our GRPO update step against google-tunix 0.1.7's train step on the same tiny Qwen3 and batch, 1 device and 2 x 2
# CPU devices, with and without KL, alternating processes (bench/README.md). Tunix (PyPI google-tunix; the name
# "tunix" is an unrelated placeholder) in its own venv, git-ignored, pinned by bench/tunix-requirements.txt.
TUNIX_VENV ?= .venv-tunix

$(TUNIX_VENV)/.installed-stamp: bench/tunix-requirements.txt
	test -x $(TUNIX_VENV)/bin/python || python3 -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/python -m pip install -q --upgrade pip
	$(TUNIX_VENV)/bin/python -m pip install -q -r bench/tunix-requirements.txt
	touch $@

bench-tunix: install $(TUNIX_VENV)/.installed-stamp
	$(PY) -m bench.tunix_side_by_side --tunix-venv $(TUNIX_VENV) --json runs/bench-tunix.json

clean:
	rm -rf $(VENV) $(SKYRL_VENV) $(TUNIX_VENV) runs plan-out .pytest_cache .ruff_cache .mypy_cache tools/node_modules
