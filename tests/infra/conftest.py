"""Shared fixtures: each environment's stack config, and the program run under mocks once per environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.mockrun import PlanResult, run_stack

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENTS = ("dev", "staging", "prod")


def stack_config(env: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "environments" / f"Pulumi.{env}.yaml").read_text())["config"]


@pytest.fixture(scope="session")
def plans() -> dict[str, PlanResult]:
    return {env: run_stack(env, stack_config(env)) for env in ENVIRONMENTS}
