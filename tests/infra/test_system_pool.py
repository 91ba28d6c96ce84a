"""The system pool holds what the stack pins to it: GKE's allocatable formula, the packing, and the plan's refusal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from envspec import machines
from envspec.config import ConfigError, EnvironmentSpec, parse_spec
from infra import cli
from infra.checks import system_pool as sp
from infra.offline import mockrun
from tests.infra.conftest import ROOT, stack_config
from trainer.base.config import bundled_configs
from workloads.rayjob import AUTOSCALER_RESOURCES, HEAD_RESOURCES
from workloads.trainer_pod import GCSFUSE_SIDECAR

NS = "gke-tpu-rl:"
ENV_FILES = sorted((ROOT / "environments").glob("Pulumi.*.yaml"))


def _spec(env: str, config: dict[str, Any]) -> EnvironmentSpec:
    return parse_spec({k.removeprefix(NS): v for k, v in config.items()}, env, bundled_configs())


def _with_pool(config: dict[str, Any], machine_type: str, nodes: int) -> dict[str, Any]:
    cluster = dict(config.get(NS + "cluster", {}))
    cluster["systemPool"] = {"machineType": machine_type, "nodes": nodes}
    return {**config, NS + "cluster": cluster}


def _without_staging(config: dict[str, Any]) -> dict[str, Any]:
    """The environment without its staging Job (tests of the Ray head's own fit)."""
    trainer = {k: v for k, v in config[NS + "trainer"].items() if k != "stage"}
    return {**config, NS + "trainer": trainer}


class _Recording(mockrun.RecordingMonitor):
    made: list[mockrun.RecordingMonitor] = []

    def __init__(self, mocks: Any) -> None:
        super().__init__(mocks)
        _Recording.made.append(self)


def _plan(tmp_path: Path, env: str, config: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
          capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    """`gke-tpu-rl plan ENV --config-file` on this config: exit status, stderr, what was registered."""
    monkeypatch.setattr(mockrun, "RecordingMonitor", _Recording)
    _Recording.made.clear()
    path = tmp_path / f"Pulumi.{env}.yaml"
    path.write_text(yaml.safe_dump({"config": config}))
    rc = cli.main(["plan", env, "--config-file", str(path)])
    registered = [r.type for m in _Recording.made for r in m.registrations]
    return rc, capsys.readouterr().err, registered


# ---------------------------------------------------------------- GKE's formula


def test_cpu_reservation_matches_gke_docs() -> None:
    # plan-node-sizes: a 4-vCPU node shows allocatable cpu 3920m (6% + 1% + 2 x 0.5% of a core reserved).
    assert machines.allocatable(machines.machine("e2-standard-4")).cpu_m == pytest.approx(3920)
    assert machines.allocatable(machines.machine("n2-standard-4")).cpu_m == pytest.approx(3920)
    # The tiers one by one: 60m, +10m, +5m +5m, then 2.5m a core.
    assert [machines.reserved_cpu_m(n) for n in (1, 2, 3, 4, 8, 16)] == pytest.approx([60, 70, 75, 80, 90, 110])


def test_memory_allocatable_matches_gke_docs_example() -> None:
    # The same page's example node (4 vCPU, so a 16 GiB machine): allocatable memory 13498416Ki.
    allocatable_ki = machines.allocatable(machines.machine("e2-standard-4")).memory_mib * 1024
    assert allocatable_ki == pytest.approx(13498416, rel=1e-3)


def test_memory_reservation_tiers() -> None:
    gib = 1024
    assert machines.reserved_memory_mib(0.5 * gib) == 255  # under 1 GiB: a flat 255 MiB
    assert machines.reserved_memory_mib(4 * gib) == pytest.approx(0.25 * 4 * gib)
    assert machines.reserved_memory_mib(8 * gib) == pytest.approx((1 + 0.8) * gib)
    assert machines.reserved_memory_mib(16 * gib) == pytest.approx((1 + 0.8 + 0.8) * gib)
    assert machines.reserved_memory_mib(128 * gib) == pytest.approx((2.6 + 0.06 * 112) * gib)
    # 150 GiB: 9.8577 GiB with the eviction threshold (hatemosphere/gke-node-allocatable-memory-calculator's README).
    reserved = machines.reserved_memory_mib(150 * gib) + machines.EVICTION_THRESHOLD_MIB
    assert reserved / gib == pytest.approx(9.8577, abs=1e-4)


def test_machine_types_from_the_table() -> None:
    m = machines.machine("e2-standard-8")
    assert (m.vcpus, m.memory_gib) == (8, 32)
    assert machines.machine("n1-standard-4").memory_gib == 15
    assert machines.machine("c3-highcpu-22").memory_gib == 44


@pytest.mark.parametrize(("machine_type", "expect"), [
    ("m3-megamem-64", "allowed: <family>-<standard|highmem|highcpu>-<vCPUs> for families c3, e2, n1, n2, n2d, n4"),
    ("e2-medium", "shared-core"),
    ("e2-standard-6", "e2-standard comes with 2, 4, 8, 16, 32 vCPUs; allowed: e2-standard-2, e2-standard-4"),
    ("n2-ultracpu-8", "allowed: <family>-<standard|highmem|highcpu>-<vCPUs>"),
])
def test_unknown_machine_type_is_refused_naming_the_key(machine_type: str, expect: str) -> None:
    config = _with_pool(stack_config("staging"), machine_type, 2)
    with pytest.raises(ConfigError) as e:
        _spec("staging", config)
    assert f"gke-tpu-rl:cluster.systemPool.machineType: {machine_type!r}" in str(e.value)
    assert expect in str(e.value)


# ---------------------------------------------------------------- the pods and the packing


def test_ray_head_counts_every_container_the_builders_give_it() -> None:
    head = sp.ray_head()
    assert head.requests == machines.Requests(2000 + 500 + 500 + 500, 8192 + 512 + 200 + 1024)
    assert head.detail == "ray-head 2 + autoscaler 0.5 + submitter 0.5 + gcsfuse sidecar 0.5 vCPU"


def test_the_emitted_objects_request_what_the_check_counts() -> None:
    """The RayJob's head and the controller charts run with the requests the check reads: the builders' constants,
    and the charts' defaults (the releases override neither replicas nor resources)."""
    plan = mockrun.run_stack("dev", stack_config("dev"))
    rayjob = plan.of_type("kubernetes:ray.io/v1:RayJob")[0].inputs["spec"]["rayClusterSpec"]
    head = rayjob["headGroupSpec"]["template"]
    assert head["spec"]["nodeSelector"] == {"gke-tpu-rl/pool": "system"}
    assert head["spec"]["containers"][0]["resources"]["requests"] == HEAD_RESOURCES
    assert rayjob["autoscalerOptions"]["resources"]["requests"] == AUTOSCALER_RESOURCES
    annotations = head["metadata"]["annotations"]
    assert {k: annotations[k] for k in GCSFUSE_SIDECAR} == GCSFUSE_SIDECAR
    for release in plan.of_type("kubernetes:helm.sh/v3:Release"):
        values = release.inputs["values"]
        text = yaml.safe_dump({k: v for k, v in values.items() if k != "managerConfig"})
        assert "replicas" not in text and "resources" not in text, release.name
    assert {r.inputs["version"] for r in plan.of_type("kubernetes:helm.sh/v3:Release")} == {
        plan.spec.controllers.kueue_version, plan.spec.controllers.jobset_version}


def test_pods_are_packed_per_node_not_summed() -> None:
    # Two nodes with 1 vCPU free each hold 2 vCPU, but not one pod of 1.5.
    free = machines.Requests(1000, 4096)
    pods = [sp.Pod("big", machines.Requests(1500, 100)), sp.Pod("small", machines.Requests(400, 100))]
    placed, unplaced = sp.pack(pods, 2, free)
    assert [p.name for p in unplaced] == ["big"] and [[p.name for p in n] for n in placed] == [["small"], []]
    # dev's Ray head (9.7 GiB) on three e2-highcpu-8 (8 GiB each): enough memory in all, on no single node.
    spec = _spec("dev", _with_pool(_without_staging(stack_config("dev")), "e2-highcpu-8", 3))
    result = sp.fit(spec)
    assert result.requested.memory_mib < 3 * result.free.memory_mib
    assert [p.name for p in result.unplaced] == ["Ray head"]
    with pytest.raises(ConfigError, match="packed onto 3 nodes, Ray head find no room"):
        sp.check(spec)


def test_controller_versions_without_known_requests_are_refused() -> None:
    spec = _spec("staging", stack_config("staging"))
    bumped = spec.model_copy(update={"controllers": spec.controllers.model_copy(update={"jobset_version": "0.13.0"})})
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:controllers\.jobsetVersion 0\.13\.0: the system-pool check "
                       r"knows the requests of JobSet 0\.12\.0 only; .* kubernetes-sigs/jobset"):
        sp.check(bumped)
    # Config validation refuses an unknown Kueue chart first; the check guards a spec built another way.
    bumped = spec.model_copy(update={"controllers": spec.controllers.model_copy(update={"kueue_version": "0.20.0"})})
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:controllers\.kueueVersion 0\.20\.0: the system-pool check "
                       r"knows the requests of Kueue 0\.19\.2 only"):
        sp.check(bumped)


# ---------------------------------------------------------------- the environments


@pytest.mark.parametrize("path", ENV_FILES, ids=lambda p: p.name)
def test_every_shipped_environment_fits(path: Path) -> None:
    env = path.name.removeprefix("Pulumi.").removesuffix(".yaml")
    spec = _spec(env, yaml.safe_load(path.read_text())["config"])
    result = sp.check(spec)
    assert result.fits
    assert ("Ray head" in [p.name for p in result.pods]) == spec.runs_on_ray


def test_the_old_dev_pool_is_refused_by_plan_with_the_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """dev as it shipped (one e2-standard-4, trainer on Ray): the Ray head alone takes 3.5 of its 3.92 vCPU."""
    config = _with_pool(_without_staging(stack_config("dev")), "e2-standard-4", 1)
    rc, err, registered = _plan(tmp_path, "dev", config, monkeypatch, capsys)
    assert rc == 2, err
    assert registered == []
    assert "Traceback" not in err
    assert ("gke-tpu-rl:cluster.systemPool: the system pool (1 x e2-standard-4: 3.92 vCPU / 12.87 GiB allocatable "
            "per node, 3.52 vCPU / 12.25 GiB after GKE's node daemons) cannot hold the pods pinned to it") in err
    assert ("Ray head 3.5 vCPU / 9.70 GiB + GKE add-ons 0.7 vCPU / 0.75 GiB + Kueue controller-manager 0.5 vCPU / "
            "0.50 GiB + JobSet controller 0.5 vCPU / 0.12 GiB = 5.2 vCPU / 11.07 GiB requested") in err
    assert "ray-head 2 + autoscaler 0.5 + submitter 0.5 + gcsfuse sidecar 0.5 vCPU" in err
    assert "set cluster.systemPool.machineType to e2-standard-8 or cluster.systemPool.nodes to 2" in err


def test_an_unknown_machine_type_exits_2_from_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = _with_pool(stack_config("staging"), "t2a-standard-8", 2)
    rc, err, registered = _plan(tmp_path, "staging", config, monkeypatch, capsys)
    assert (rc, registered) == (2, [])
    assert "gke-tpu-rl:cluster.systemPool.machineType: 't2a-standard-8'" in err and "allowed:" in err


def test_the_api_rollouts_surge_pod_is_packed_too() -> None:
    """Review 2026-11-28 #12: one e2-standard-4 (3.52 vCPU after GKE's daemons), apiReplicas 1, stageModel false:
    Kueue 0.5 + JobSet 0.5 + add-ons 0.7 + API 1.25 (its container 1, the gcsfuse sidecar of its checkpoint mount
    0.25) = 2.95 vCPU fits, but every rollout runs a second API pod (maxSurge 1, maxUnavailable 0): 4.2 vCPU, so the
    new pod would stay Pending and `pulumi up` time out."""
    from infra.base.engine_config import engine_facts
    from workloads import service

    config = _with_pool(stack_config("tinker"), "e2-standard-4", 1)
    config[NS + "service"] = {**config[NS + "service"], "apiReplicas": 1, "stageModel": False}
    spec = _spec("tinker", config)
    api = service.api_deployment(spec, service.ServiceRefs(image="i", bucket="b", instance="p:r:i", database="d",
                                                           users={"api": "u"}, accounts={"api": "a", "engine": "e"},
                                                           engine=engine_facts(spec)))
    surge = api["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert surge == service.API_MAX_SURGE == 1
    names = [p.name for p in sp.pinned_pods(spec)]
    assert names.count("service API 0") == 1 and sum(n.startswith("service API rollout surge") for n in names) == surge
    with pytest.raises(ConfigError, match=r"service API rollout surge 0 1\.25 vCPU / 1\.50 GiB \+ .* = 4\.2 vCPU / "
                       r"4\.38 GiB requested, .* find no room \(service API 0: api 1 \+ gcsfuse sidecar 0\.25 vCPU; "
                       r".*\); set cluster\.systemPool\.machineType to e2-standard-8 or cluster\.systemPool\.nodes "
                       r"to 2"):
        sp.check(spec)
    # Two nodes hold them.
    assert sp.check(_spec("tinker", _with_pool(config, "e2-standard-4", 2))).fits
