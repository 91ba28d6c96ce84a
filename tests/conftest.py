"""How `make test` spreads the suite over 2 pytest-xdist workers (`-n 2`).

Each test file is one group, so a file's module fixtures (compiles, servers) are built once, on one worker. The
files whose tests start several processes each (local multi-host trainer runs, Ray clusters, servers killed
mid-request) share one group and go first: they run one after another on one worker, never two of them against
each other for the machine's 2 cores, while the other worker takes the in-process files. Without xdist (a plain
`pytest`) only the order changes.
"""

from __future__ import annotations

from typing import Any

import pytest

PROCESSES = "processes"
MULTI_PROCESS_FILES = frozenset({
    "tests/deployed/test_gcp.py",
    "tests/deployed/test_ray.py",
    "tests/deployed/test_service.py",
    "tests/deployed/test_trainer.py",
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
    return PROCESSES if path in MULTI_PROCESS_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with our groups as the scopes. (Its `xdist_group` marks do not group under pytest
    9.2: xdist 3.8 writes the group into `item._nodeid`, which pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The longest group first: it bounds the run, so it should not start last.
    items.sort(key=lambda item: _group(item.nodeid) != PROCESSES)
