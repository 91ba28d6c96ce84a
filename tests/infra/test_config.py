"""Bad stack configs stop with an error that names the key, the value and what is allowed, before any resource."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pulumi.errors import RunError

from envspec.config import ConfigError, EnvironmentSpec, parse_spec
from infra.base.stack_config import StackConfigError
from infra.offline.mockrun import PlanMocks, RecordingMonitor, run_stack
from tests.infra.conftest import stack_config
from trainer.base.config import bundled_configs


def _raw(env: str) -> dict[str, Any]:
    return {k.split(":", 1)[1]: v for k, v in stack_config(env).items()}


def _with(env: str, path: str, value: Any) -> dict[str, Any]:
    """The env's config with one dotted path (list index as a number) set; `...` deletes the key."""
    raw = copy.deepcopy(_raw(env))
    *parents, last = path.split(".")
    node: Any = raw
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is ...:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return raw


BAD = [
    ("unknown TPU type", "dev", "slices.0.tpuType", "v9",
     r"gke-tpu-rl:slices\[0\]\.tpuType: unknown TPU type 'v9'; allowed: tpu7x, v4, v5e, v5p, v6e"),
    ("invalid topology", "dev", "slices.0.topology", "4x3",
     r"gke-tpu-rl:slices\[0\]\.topology: topology '4x3' is not valid for v6e; allowed: 1x1, 2x2, 2x4, 4x4, 4x8"),
    ("zero slices", "staging", "slices.0.count", 0,
     r"gke-tpu-rl:slices\[0\]\.count: Input should be greater than or equal to 1 \(got 0\)"),
    ("no slice groups", "dev", "slices", [], r"gke-tpu-rl:slices: List should have at least 1 item"),
    ("trainer wants more slices", "staging", "trainer.slices", 3,
     r"gke-tpu-rl:trainer\.slices: 3 is more slices than group 'v6e-stg' declares \(2\); allowed: 1\.\.2"),
    ("trainer on unknown group", "prod", "trainer.sliceGroup", "v4-none",
     r"gke-tpu-rl:trainer\.sliceGroup: 'v4-none' is not a slice group; allowed: \['v5p-prod', 'v6e-burst'\]"),
    ("DRANET on an old GKE", "staging", "cluster.versionPrefix", "1.33",
     r"gke-tpu-rl:cluster\.versionPrefix: '1\.33\.' has no version new enough for managed DRANET .*"
     r"1\.34\.1-gke\.1829001 or later\); use '1\.34\.' or later"),
    ("a pinned GKE patch", "staging", "cluster.minVersion", "1.34.1-gke.1829001",
     r"gke-tpu-rl:cluster: cluster\.minVersion pinned a patch GKE stops offering; use cluster\.versionPrefix"),
    ("a version, not a prefix", "dev", "cluster.versionPrefix", "1.34.1-gke.1829001",
     r"gke-tpu-rl:cluster\.versionPrefix: '1\.34\.1-gke\.1829001' is not a GKE version prefix like '1\.34\.'"),
    ("bad region", "dev", "region", "useast5", r"gke-tpu-rl:region: 'useast5' is not a region like us-east5"),
    ("bad zone form", "dev", "zone", "us-east5", r"gke-tpu-rl:zone: 'us-east5' is not a zone like us-east5-b"),
    ("zone outside region", "dev", "zone", "europe-west4-a",
     r"gke-tpu-rl:zone: zone 'europe-west4-a' is not in region 'us-east5'"),
    ("missing project", "dev", "project", ..., r"gke-tpu-rl:project: required but not set"),
    ("bad project id", "dev", "project", "My_Project", r"gke-tpu-rl:project: 'My_Project' is not a GCP project id"),
    ("unknown capacity", "dev", "slices.0.capacity", "cheap",
     r"gke-tpu-rl:slices\[0\]\.capacity: Input should be 'on-demand', 'spot', 'reservation' or 'flex-start'"),
    ("reservation without a name", "prod", "slices.0.reservation", ...,
     r"gke-tpu-rl:slices\[0\]: reservation \(a reservation name\) is required with capacity 'reservation'"),
    ("typo in a key", "dev", "trainer.maxRestart", 2, r"gke-tpu-rl:trainer\.maxRestart: unknown key"),
    ("force destroy on a protected bucket", "prod", "storage.forceDestroy", True,
     r"gke-tpu-rl:storage: forceDestroy would delete checkpoints on destroy; it needs protect: false"),
    ("bad CIDR", "staging", "network.nodeCidr", "10.0.0.1/20",
     r"gke-tpu-rl:network\.nodeCidr: '10\.0\.0\.1/20' is not a CIDR block"),
    ("DRANET networks not the NIC count", "staging", "network.dranet.networks", 4,
     r"gke-tpu-rl:network\.dranet\.networks: 4, but the DRANET machines here \(ct6e-standard-4t\) have 2 NICs"),
    ("trainer config not bundled", "dev", "trainer.config", "mine.yaml",
     r"gke-tpu-rl:trainer\.config: 'mine\.yaml' is not a trainer config under trainer/configs/; allowed: demo\.yaml, "),
    ("a service config is no training run", "dev", "trainer.config", "qwen3-8b-service-v6e-4x4.yaml",
     r"gke-tpu-rl:trainer\.config: 'qwen3-8b-service-v6e-4x4\.yaml' is not a trainer config under trainer/configs/; "
     r"allowed: demo\.yaml, (?:(?!service)[^ ]+, )*qwen3-8b-grpo-v6e-4x4\.yaml$"),
    ("trainer config as a path", "dev", "trainer.config", "trainer/configs/demo.yaml",
     r"gke-tpu-rl:trainer\.config: 'trainer/configs/demo\.yaml' is not a trainer config under trainer/configs/"),
]


@pytest.mark.parametrize(("case", "env", "path", "value", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_the_key(case: str, env: str, path: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(_with(env, path, value), env, bundled_configs())


@pytest.mark.parametrize(("case", "env", "path", "value", "message"), BAD[:7], ids=[b[0] for b in BAD[:7]])
def test_bad_config_registers_nothing(case: str, env: str, path: str, value: Any, message: str) -> None:
    monitor = RecordingMonitor(PlanMocks())
    config = {f"gke-tpu-rl:{k}": v for k, v in _with(env, path, value).items()}
    with pytest.raises(ConfigError, match=message):
        run_stack(env, config, monitor=monitor)
    assert monitor.registrations == []


@pytest.mark.parametrize(("env", "path", "value", "message"), [
    ("dev", "slices.0.tpuType", "v9", r"gke-tpu-rl:slices\[0\]\.tpuType: unknown TPU type 'v9'"),  # the spec
    # A check the program runs on the parsed spec (infra/checks/grace.py), after load_spec.
    ("prod", "trainer.terminationGraceSeconds", 600, r"trainer\.terminationGraceSeconds: 600 s is too short"),
], ids=["spec", "grace check"])
def test_pulumi_up_gets_config_errors_as_run_errors(env: str, path: str, value: Any, message: str) -> None:
    """envspec's ConfigError is a plain ValueError (the floor has no Pulumi); the program raises it on as a RunError,
    which pulumi-language-python prints without the program's traceback, with the same message."""
    raw = _with(env, path, value)
    with pytest.raises(RunError, match=message) as err:
        run_stack(env, {f"gke-tpu-rl:{k}": v for k, v in raw.items()})
    assert isinstance(err.value, StackConfigError) and isinstance(err.value, ConfigError)
    assert err.value.__cause__ is None and err.value.__suppress_context__  # the message is all `pulumi up` shows
    if path.startswith("slices"):
        with pytest.raises(ConfigError) as floor:
            parse_spec(raw, env, bundled_configs())
        assert not isinstance(floor.value, RunError) and str(floor.value) == str(err.value)


def test_the_spec_needs_the_bundled_configs_to_check_a_config_name() -> None:
    # Validating without them is a programming error, not a config problem: it must not pass unchecked.
    with pytest.raises(TypeError, match=r"validate it with parse_spec\(raw, env, bundled_configs\)"):
        EnvironmentSpec.model_validate({**_raw("dev"), "env": "dev"})
    # An environment naming no config needs none (the trainer's embedded demo config).
    raw = _raw("dev")
    raw["trainer"] = {k: v for k, v in raw["trainer"].items() if k != "config"}
    assert EnvironmentSpec.model_validate({**raw, "env": "dev"}).trainer.config is None


def test_every_error_is_reported_at_once() -> None:
    raw = _with("dev", "zone", "nowhere")
    raw["slices"][0]["topology"] = "9x9"
    with pytest.raises(ConfigError) as err:
        parse_spec(raw, "dev", bundled_configs())
    assert "gke-tpu-rl:zone" in str(err.value)
    assert "gke-tpu-rl:slices[0].topology" in str(err.value)


def test_version_prefix_gets_a_trailing_dot_and_dranet_sets_the_floor() -> None:
    spec = parse_spec(_with("staging", "cluster.versionPrefix", "1.35"), "staging", bundled_configs())
    assert spec.cluster.version_prefix == "1.35."  # so '1.3' could never match 1.30+
    assert spec.gke_version_floor == "1.34.1-gke.1829001"
    assert parse_spec(_raw("dev"), "dev", bundled_configs()).gke_version_floor is None


def test_aliases_become_catalog_names() -> None:
    spec = parse_spec(_with("dev", "slices.0.tpuType", "trillium"), "dev", bundled_configs())
    assert spec.slices[0].tpu_type == "v6e"


def test_dranet_needs_a_managed_dranet_machine() -> None:
    # dev's one slice group is a single-host v6e: managed DRANET is for multi-host ct6e, so enabling it is refused.
    raw = copy.deepcopy(_raw("dev"))
    raw["network"] = {"dranet": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:network\.dranet\.enabled: none of the slice groups' "
                                          r"machines \(ct6e-standard-4t\) supports GKE managed DRANET"):
        parse_spec(raw, "dev", bundled_configs())
