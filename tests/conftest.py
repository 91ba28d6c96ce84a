"""How `make test` spreads the suite over 2 pytest-xdist workers (`-n 2`).

Each test file is one group, so a file's module fixtures (compiles, servers) are built once, on one worker. The
files whose tests start several processes each (local multi-host trainer runs, Ray clusters, servers killed
mid-request) share one group, and the as-deployed harness's scenarios (tests/deployed/) another; both go first, one
per worker, each running its files one after another. Together they bound the run (about 20 and 15 minutes on 2
cores): in one group they took one worker for over half of it while the other finished the in-process files and
waited. The harness mostly waits on its emulated controllers (back-offs, probes), which is where the other group's
processes get the cores. Without xdist (a plain `pytest`) only the order changes.
"""

from __future__ import annotations

from typing import Any

import pytest

PROCESSES = "processes"
HARNESS = "harness"
HARNESS_FILES = frozenset({
    "tests/deployed/test_gcp.py",
    "tests/deployed/test_ray.py",
    "tests/deployed/test_service.py",
    "tests/deployed/test_trainer.py",
})
MULTI_PROCESS_FILES = frozenset({
    "tests/service/test_crash.py",
    "tests/service_engine/test_crash.py",
    "tests/service_engine/test_multihost.py",
    "tests/service_engine/test_preemption.py",
    "tests/service_engine/test_real_clients.py",
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
    return HARNESS if path in HARNESS_FILES else PROCESSES if path in MULTI_PROCESS_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with our groups as the scopes. (Its `xdist_group` marks do not group under pytest
    9.2: xdist 3.8 writes the group into `item._nodeid`, which pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The two long groups first: they bound the run, so they should not start last.
    items.sort(key=lambda item: _group(item.nodeid) not in (PROCESSES, HARNESS))
