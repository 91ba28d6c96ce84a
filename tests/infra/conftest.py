"""Shared fixtures: each environment's stack config, and the program run under mocks once per environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.mockrun import PlanMocks, PlanResult, RecordingMonitor, _unwrap_secrets, run_stack

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENTS = ("dev", "staging", "prod")


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
