"""How `make test` spreads the suite over 3 pytest-xdist workers (`-n 3`, on 2 cores: the Makefile says why).

Each test file is one group, so a file's module fixtures (compiles, servers) are built once, on one worker. The
files whose tests start several processes each (local multi-host trainer runs, Ray clusters, servers killed
mid-request) share one group and go first: they run one after another on one worker, never two of them against
each other for the machine's 2 cores, while the other workers take the in-process files. Without xdist (a plain
`pytest`) only the order changes.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

# LLVM at its lowest optimisation level for the CPU programs the tests compile, in this process and every process it
# starts: the tests' programs run for milliseconds and compile for seconds (-O0 cut tests/trainer/test_model.py from
# 123 to 96 s). Results differ from -O2's in the last bits only (XLA's CPU fast math is off), and every bit-for-bit
# comparison in the suite is between two runs under the same flags. Set before jax is imported.
CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if CPU_COMPILE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAG}".strip()

# The processes the tests start read, on every process of a multi-process run, what process 0 compiled (as a TPU
# slice's hosts do; tests/hosts_share_compiles/sitecustomize.py says why and how).
SHARE_COMPILES = str(Path(__file__).parent / "hosts_share_compiles")


def sharing_compiles(pythonpath: str | None) -> str:
    """`pythonpath` with SHARE_COMPILES first (once): for this process's children and the harness's slice pods."""
    rest = [p for p in (pythonpath or "").split(os.pathsep) if p and p != SHARE_COMPILES]
    return os.pathsep.join([SHARE_COMPILES, *rest])


os.environ["PYTHONPATH"] = sharing_compiles(os.environ.get("PYTHONPATH"))

PROCESSES = "processes"
MULTI_PROCESS_FILES = frozenset({
    "tests/deployed/test_gcp.py",
    "tests/deployed/test_ray.py",
    "tests/deployed/test_service.py",
    "tests/deployed/test_trainer.py",
    "tests/service/test_crash.py",
    "tests/service_engine/test_cookbook_recipes.py",
    "tests/service_engine/test_crash.py",
    "tests/service_engine/test_multihost.py",
    "tests/service_engine/test_preemption.py",
    "tests/service_engine/test_real_clients.py",
    "tests/trainer/test_agree.py",
    "tests/trainer/test_checkpoint_damage.py",
    "tests/trainer/test_distributed.py",
    "tests/trainer/test_quiet.py",
    "tests/trainer/test_ray_elastic.py",
    "tests/trainer/test_resume_fewer_slices.py",
    "tests/trainer/test_sigkill.py",
    "tests/trainer/test_signals.py",
    "tests/trainer/test_startup.py",
    "tests/workloads/test_ray_upstream.py",
})


def _group(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return PROCESSES if path in MULTI_PROCESS_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with our groups as the scopes. (Its `xdist_group` marks do not group under pytest
    9.2: xdist 3.8 writes the group into `item._nodeid`, which pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


@pytest.fixture(scope="session", autouse=True)
def subprocess_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One persistent compilation cache per worker for the processes the tests start (trainer runs, engines, the
    docs' commands): what one test's process compiled, the next one's reads back. Their product default (a cache
    beside each run's checkpoints, trainer/run/compile_cache.py) gives way to $JAX_COMPILATION_CACHE_DIR. jax is
    imported first: it reads the variable at import, so the tests' own in-process compiles, which `fit` counts and
    prices, stay uncached. The as-deployed harness starts its pods with their rendered env only: they keep the product's
    cache on their bucket."""
    import jax  # noqa: F401

    cache = tmp_path_factory.getbasetemp() / "jax-compile-cache"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return cache


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The longest group first: it bounds the run, so it should not start last.
    items.sort(key=lambda item: _group(item.nodeid) != PROCESSES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """With GTR_TEST_CPU=<file>, appends each test's wall and CPU seconds (this process and the children it reaped)
    to <file> as JSON lines: under -n 3 the wall figures mostly measure contention, the CPU ones what a test costs."""
    path = os.environ.get("GTR_TEST_CPU")
    if not path:
        yield
        return
    start, cpu0 = time.monotonic(), _cpu_seconds()
    yield
    row = {"nodeid": item.nodeid, "group": _group(item.nodeid), "wall": round(time.monotonic() - start, 2),
           "cpu": round(_cpu_seconds() - cpu0, 2)}
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
