"""A multi-host multislice group without DRANET networks, where a shipped example gives that kind of group its DRANET
networks: `plan` and `plan --diff` warn (issue 42), naming the group, the example and the key to set."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from envspec.config import EnvironmentSpec, parse_spec
from infra.offline import render, shipped
from infra.offline.diff import compare, headline, markdown, snapshot
from infra.offline.mockrun import PlanResult, run_stack
from tests.infra.conftest import ENVIRONMENTS, ROOT, new_env_name, scratch_root, stack_config
from trainer.base.config import bundled_configs


def _spec(config: dict[str, Any], env: str) -> EnvironmentSpec:
    ours = {k.removeprefix("gke-tpu-rl:"): v for k, v in config.items()}
    return parse_spec(ours, env, bundled_configs())


def _without_dranet(env: str) -> dict[str, Any]:
    config = copy.deepcopy(stack_config(env))
    config["gke-tpu-rl:network"] = {k: v for k, v in config["gke-tpu-rl:network"].items() if k != "dranet"}
    return config


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_the_shipped_environments_draw_no_warning(env: str, plans: dict[str, PlanResult]) -> None:
    assert shipped.warnings(plans[env].spec, ROOT) == []
    assert "Warning" not in render.markdown(plans[env])


def test_the_examples_that_set_the_standard() -> None:
    groups = {(e.file, e.group, e.tpu_type, e.topology, e.count, e.networks) for e in shipped.example_groups(ROOT)}
    # prod's v5p group is multislice too, but v5p has no managed DRANET (the TPU catalog): not an example of it.
    assert {("environments/Pulumi.staging.yaml", "v6e-stg", "v6e", "4x4", 2, 2),
            ("environments/Pulumi.prod.yaml", "v6e-burst", "v6e", "4x8", 2, 2)} <= groups
    assert not [g for g in groups if g[2] == "v5p"]


def test_a_multislice_v6e_group_without_dranet_is_warned_of(tmp_path: Path) -> None:
    env = new_env_name()
    root = scratch_root(tmp_path)  # the shipped environments only: a user's own ones are not the standard here
    [warning] = shipped.warnings(_spec(_without_dranet("staging"), env), root)
    assert warning == (
        "slices: group 'v6e-stg' (2 x v6e 4x4, 4 hosts per slice) is multi-host multislice without DRANET networks, "
        "so the DCN traffic between its slices shares each host's one node NIC; environments/Pulumi.staging.yaml "
        "gives its 2 x v6e 4x4 group 'v6e-stg' 2 extra high-MTU networks per host. Set network.dranet.enabled: true.")
    # staging's own file is not its own standard: the next example of a v6e multislice group is prod's.
    [own] = shipped.warnings(_spec(_without_dranet("staging"), "staging"), root)
    assert "environments/Pulumi.prod.yaml gives its 2 x v6e 4x8 group 'v6e-burst'" in own


@pytest.mark.parametrize(("change", "why"), [
    ({"count": 1}, "one slice: no DCN traffic between slices"),
    ({"topology": "2x2"}, "single-host: no DRANET machine"),
    ({"tpuType": "v5p", "topology": "2x2x2"}, "v5p: no managed DRANET"),
])
def test_no_warning_where_dranet_would_not_apply(change: dict[str, Any], why: str, tmp_path: Path) -> None:
    config = _without_dranet("staging")
    config["gke-tpu-rl:slices"] = [{**config["gke-tpu-rl:slices"][0], **change}]
    config["gke-tpu-rl:trainer"] = {**config["gke-tpu-rl:trainer"], "slices": 1}
    assert shipped.warnings(_spec(config, new_env_name()), scratch_root(tmp_path)) == [], why


def test_plan_and_diff_show_the_warning(plans: dict[str, PlanResult], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples are this checkout's environments
    result = run_stack("staging", _without_dranet("staging"))
    [warning] = shipped.warnings(result.spec)
    assert f"- **Warning**: {warning}" in render.markdown(result)
    assert f"warning: {warning}" in render.text(result)
    d = compare("staging", "main", snapshot(plans["staging"]), snapshot(result))
    assert headline(d)[-1] == f"Warning: {warning}"
    assert f"- **Warning**: {warning}" in markdown(d)
