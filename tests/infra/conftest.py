"""Shared fixtures: each environment's stack config, and the program run under mocks once per environment."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.offline.mockrun import PlanMocks, PlanResult, RecordingMonitor, _unwrap_secrets, run_stack

ROOT = Path(__file__).resolve().parents[2]
# The kit's own example environments, whose properties the tests check. environments/ may hold more (a user copies
# Pulumi.dev.yaml to Pulumi.qa.yaml): no test may assume these are all of them.
ENVIRONMENTS = ("dev", "staging", "prod", "tinker")


def new_env_name() -> str:
    """A stack name no environments/ holds, for a test of an environment that is new (a user's own may be `qa`)."""
    return f"newenv-{secrets.token_hex(3)}"


def scratch_root(path: Path, extra: dict[str, str] | None = None) -> Path:
    """A project root at `path` holding Pulumi.yaml and the shipped environments only, plus `extra` (a new stack name
    -> the shipped environment its file is copied from): what a command that reads every environment sees."""
    (path / "environments").mkdir(parents=True)
    (path / "Pulumi.yaml").write_text((ROOT / "Pulumi.yaml").read_text())
    for env, source in {**{e: e for e in ENVIRONMENTS}, **(extra or {})}.items():
        (path / "environments" / f"Pulumi.{env}.yaml").write_text(
            (ROOT / "environments" / f"Pulumi.{source}.yaml").read_text())
    return path


def stack_config(env: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "environments" / f"Pulumi.{env}.yaml").read_text())["config"]


@pytest.fixture(scope="session")
def plans() -> dict[str, PlanResult]:
    return {env: run_stack(env, stack_config(env)) for env in ENVIRONMENTS}


def raw_inputs(env: str, config: dict[str, Any], type_: str) -> list[dict[str, Any]]:
    """The inputs of every registered resource of `type_` with secrets unmasked (the plan masks them): for tests
    that must see what the provider would get, e.g. the kubeconfig or the registry credentials."""
    monitor = RecordingMonitor(PlanMocks())
    run_stack(env, config, monitor=monitor)
    return [_unwrap_secrets(r.inputs) for r in monitor.registrations if r.type == type_]
