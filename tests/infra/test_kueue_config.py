"""Kueue's manager config is the deployed chart version's own default (plus the DRANET mapping), never an older one.

The chart takes the manager Configuration as one YAML string, so the stack's override replaces the chart's default
wholesale; workloads/kueue.py restates that default per chart version. These tests keep the restated config equal to
the chart's (a vendored copy of its values.yaml entry) and make sure no other chart version gets past config
validation, where it would silently run with an older chart's defaults.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from envspec.config import KUEUE_CHART_VERSIONS, ConfigError, parse_spec
from infra.offline.mockrun import PlanMocks, RecordingMonitor, run_stack
from tests.infra.conftest import stack_config
from trainer.base.config import bundled_configs
from workloads.kueue import CHART_MANAGER_CONFIGS, DRANET_RESOURCE, manager_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kueue"


def _chart_default(version: str) -> dict[str, Any]:
    """charts/kueue/values.yaml managerConfig.controllerManagerConfigYaml at tag v<version>, parsed."""
    return yaml.safe_load((FIXTURES / f"controller-manager-config-v{version}.yaml").read_text())


def _raw(env: str) -> dict[str, Any]:
    return {k.split(":", 1)[1]: v for k, v in stack_config(env).items()}


def _with_kueue(env: str, version: str) -> dict[str, Any]:
    raw = copy.deepcopy(_raw(env))
    raw["controllers"] = {**raw.get("controllers", {}), "kueueVersion": version}
    return raw


def test_config_and_workloads_know_the_same_chart_versions() -> None:
    # envspec/config.py cannot import workloads/ (data flows config -> workloads), so the allow-list lives there and
    # this keeps it equal to the versions whose config is restated.
    assert set(KUEUE_CHART_VERSIONS) == set(CHART_MANAGER_CONFIGS)


@pytest.mark.parametrize("version", sorted(CHART_MANAGER_CONFIGS))
def test_restated_config_is_the_charts_default(version: str) -> None:
    assert CHART_MANAGER_CONFIGS[version] == _chart_default(version)


def test_the_default_version_is_restated_and_the_fixture_names_its_source() -> None:
    spec = parse_spec(_raw("dev"), "dev", bundled_configs())
    assert spec.controllers.kueue_version in CHART_MANAGER_CONFIGS
    for version in CHART_MANAGER_CONFIGS:
        header = (FIXTURES / f"controller-manager-config-v{version}.yaml").read_text().split("\napiVersion:")[0]
        assert "kubernetes-sigs/kueue" in header and f"v{version}" in header
        assert "charts/kueue/values.yaml" in header and "Apache License, Version 2.0" in header


@pytest.mark.parametrize("env", ["dev", "staging"])
def test_manager_config_is_the_chart_default_plus_only_the_dranet_mapping(env: str) -> None:
    spec = parse_spec(_raw(env), env, bundled_configs())
    config = manager_config(spec)
    chart = _chart_default(spec.controllers.kueue_version)
    extra = {k: v for k, v in config.items() if k not in chart}
    assert {k: v for k, v in config.items() if k in chart} == chart
    if spec.dranet_network_count:
        assert extra == {"resources": {"deviceClassMappings": [
            {"name": DRANET_RESOURCE, "deviceClassNames": ["netdev.google.com"]}]}}
    else:
        assert extra == {}
    # The table itself is never mutated by adding the mapping.
    assert "resources" not in CHART_MANAGER_CONFIGS[spec.controllers.kueue_version]


@pytest.mark.parametrize("version", ["0.20.0", "0.19.1", "0.19.3"])
def test_another_kueue_chart_is_refused_with_what_to_do(version: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_spec(_with_kueue("staging", version), "staging", bundled_configs())
    message = str(err.value)
    assert (f"gke-tpu-rl:controllers.kueueVersion: '{version}' is not a Kueue chart version whose default "
            "manager config the stack restates; allowed: 0.19.2. ") in message
    assert f"charts/kueue/values.yaml at tag v{version}" in message and "CHART_MANAGER_CONFIGS" in message
    assert "KUEUE_CHART_VERSIONS" in message


def test_another_kueue_chart_registers_nothing() -> None:
    # Refused during spec validation, before the program registers its first resource.
    monitor = RecordingMonitor(PlanMocks())
    config = {f"gke-tpu-rl:{k}": v for k, v in _with_kueue("dev", "0.20.0").items()}
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:controllers\.kueueVersion: '0\.20\.0'"):
        run_stack("dev", config, monitor=monitor)
    assert monitor.registrations == []


def test_a_bad_version_is_still_named_as_bad_semver() -> None:
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:controllers\.kueueVersion: '0\.20' is not a chart version"):
        parse_spec(_with_kueue("dev", "0.20"), "dev", bundled_configs())
