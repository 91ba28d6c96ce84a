"""The Ray path's RayJob: its TPU worker group is the trainer's slice group (checked against Ray's own TPU facts),
its pods are the JobSet's pods as far as the hardware goes, Kueue can admit it elastically, and its entrypoint is
the trainer's own CLI."""

from __future__ import annotations

import copy
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

from envspec import tpu
from envspec.config import ConfigError, EnvironmentSpec, parse_spec
from envspec.machines import cpu_millicores, memory_mib
from tests import k8s_schemas
from tests.infra.test_config import _raw
from trainer.base.config import bundled_configs
from workloads import jobset, kueue, rayjob, trainer_pod

ROOT = Path(__file__).resolve().parents[2]


def _ray_spec(env: str, **trainer: Any) -> EnvironmentSpec:
    raw = copy.deepcopy(_raw(env))
    raw["trainer"] = {**raw["trainer"], "launcher": "ray", **trainer}
    return parse_spec(raw, env, bundled_configs())


def _refs(spec: EnvironmentSpec) -> trainer_pod.TrainerRefs:
    nics = spec.dranet_networks_for(spec.trainer_group) if spec.trainer_group else 0
    return trainer_pod.TrainerRefs(image="registry/trainer@sha256:" + "0" * 64, bucket=spec.bucket_name,
                                   service_account=spec.trainer.service_account, hf_secret="hf",
                                   claim_template="netdev" if nics else None)


def _rayjob(spec: EnvironmentSpec) -> dict[str, Any]:
    return rayjob.trainer_rayjob(spec, _refs(spec), spec.ray_head_service_account)


# dev as shipped; staging's two 4-host v6e slices with DRANET, and prod's v5p group without it, moved onto Ray.
CASES = {
    "dev": lambda: parse_spec(_raw("dev"), "dev", bundled_configs()),
    "staging": lambda: _ray_spec("staging", minSlices=1),
    "prod": lambda: _ray_spec("prod", minSlices=2),
}


@pytest.mark.parametrize("env", sorted(CASES))
def test_rayjob_validates_strictly_against_kuberay_and_kubernetes(env: str) -> None:
    k8s_schemas.need_schemas()
    obj = _rayjob(CASES[env]())
    k8s_schemas.assert_valid(obj)
    # Both pod templates are checked against each release's own PodTemplateSpec, not only the CRD's copy.
    assert len(k8s_schemas.embedded_pod_templates(obj)) == 2


@pytest.mark.parametrize("env", sorted(CASES))
def test_worker_group_is_the_slice_group(env: str) -> None:
    spec = CASES[env]()
    group, t = spec.trainer_group, spec.trainer
    assert group is not None
    [workers] = _rayjob(spec)["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["groupName"] == group.name
    assert workers["numOfHosts"] == group.shape.hosts
    assert (workers["minReplicas"], workers["replicas"], workers["maxReplicas"]) == (
        spec.ray_min_slices, t.slices, t.slices)
    pod = workers["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": group.shape.accelerator,
                                   "cloud.google.com/gke-tpu-topology": group.topology}
    [container] = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == group.shape.chips_per_host


@pytest.mark.parametrize("env", sorted(CASES))
def test_tpu_pods_match_the_jobsets_except_the_process(env: str) -> None:
    """Same node choice, tolerations, claims, bucket mount, account and security; only the container's process
    set-up differs (Ray starts the process, Ray Train sets jax.distributed), and Ray stays off the host network."""
    spec = CASES[env]()
    refs = _refs(spec)
    ray_pod = _rayjob(spec)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    job_pod = jobset.trainer_jobset(spec, refs)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    same = ("serviceAccountName", "automountServiceAccountToken", "securityContext", "nodeSelector", "tolerations",
            "resourceClaims", "restartPolicy", "terminationGracePeriodSeconds")
    assert {k: ray_pod.get(k) for k in same} == {k: job_pod.get(k) for k in same}
    # The same bucket mount, but for the host-network opt-in of the gcsfuse identity (JobSet pods on the host network).
    job_volumes = copy.deepcopy(job_pod["volumes"])
    job_volumes[0]["csi"]["volumeAttributes"].pop("hostNetworkPodKSA", None)
    assert ray_pod["volumes"] == job_volumes
    ray_c, job_c = ray_pod["containers"][0], job_pod["containers"][0]
    for key in ("image", "resources", "securityContext", "volumeMounts"):
        assert ray_c[key] == job_c[key]
    assert "hostNetwork" not in ray_pod
    env_names = {e["name"] for e in ray_c["env"]}
    assert not env_names & {"COORDINATOR_ADDRESS", "NUM_SLICES", "SLICE_INDEX", "MEGASCALE_COORDINATOR_ADDRESS"}
    assert {"CHECKPOINT_DIR", "HF_TOKEN"} <= env_names


def test_dranet_claims_only_where_the_machine_supports_them() -> None:
    staging = _ray_spec("staging", minSlices=1)  # ct6e: 2 NICs each
    pod = _rayjob(staging)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "netdev", "resourceClaimTemplateName": "netdev"}]
    assert pod["containers"][0]["resources"]["claims"] == [{"name": "netdev"}]
    libtpu = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}["LIBTPU_INIT_ARGS"]
    assert libtpu == "--megascale_grpc_interface_prefixes=eth1,eth2,lo"
    for spec in (CASES["prod"](), CASES["dev"]()):  # v5p (no managed DRANET) and a single-host v6e slice
        pod = _rayjob(spec)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
        assert "resourceClaims" not in pod and "claims" not in pod["containers"][0]["resources"]
        assert "LIBTPU_INIT_ARGS" not in {e["name"] for e in pod["containers"][0]["env"]}


def test_elastic_kueue_rayjob() -> None:
    """What Kueue 0.19's RayJob webhook demands of a queued elastic job (pkg/controller/jobs/rayjob/
    rayjob_webhook.go, raycluster/common.go ValidateCreate) and what it queues it by."""
    spec = CASES["dev"]()
    obj = _rayjob(spec)
    meta, body = obj["metadata"], obj["spec"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == spec.queues.local_queue
    assert meta["labels"]["kueue.x-k8s.io/priority-class"] == spec.trainer.priority
    assert meta["annotations"] == {"kueue.x-k8s.io/elastic-job": "true"}
    assert body["shutdownAfterJobFinishes"] is True and "clusterSelector" not in body
    # Kueue frees the quota when the job finishes; lingering TPU pods would only hold up the next workload.
    assert body["ttlSecondsAfterFinished"] == 0
    assert body["rayClusterSpec"]["enableInTreeAutoscaling"] is True
    assert len(body["rayClusterSpec"]["workerGroupSpecs"]) + 1 <= 18  # Kueue's PodSet limit
    assert all(g["groupName"] != "head" for g in body["rayClusterSpec"]["workerGroupSpecs"])
    # KubeRay: autoscaler v2 takes restartPolicy Never (or unset) on every pod (utils/validation.go).
    cluster = body["rayClusterSpec"]
    for template in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
        assert template["spec"]["restartPolicy"] == "Never"


def test_head_runs_on_the_system_pool_with_its_own_account() -> None:
    spec = CASES["dev"]()
    head = _rayjob(spec)["spec"]["rayClusterSpec"]["headGroupSpec"]
    pod = head["template"]["spec"]
    assert pod["nodeSelector"] == {"gke-tpu-rl/pool": "system"}
    assert "tolerations" not in pod and "google.com/tpu" not in pod["containers"][0]["resources"]["limits"]
    # KubeRay binds its autoscaler's RBAC to the head's account, so it is not the TPU pods' account, and only the
    # head mounts a token; it reads the bucket (the driver's checkpoint checks) but never writes.
    assert pod["serviceAccountName"] == "trainer-ray-head" != spec.trainer.service_account
    assert pod["automountServiceAccountToken"] is True
    [checkpoints] = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
    assert checkpoints["csi"]["readOnly"] is True
    assert head["rayStartParams"]["num-cpus"] == "0"  # no training worker lands on the head


def test_kueue_quota_covers_the_head_pod_set_exactly() -> None:
    """Kueue admits only what a ClusterQueue covers: the head's CPU and memory plus the containers KubeRay adds
    beside it, which Kueue counts (autoscaler, SidecarMode submitter)."""
    spec = CASES["dev"]()
    obj = _rayjob(spec)
    head = obj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    autoscaler = obj["spec"]["rayClusterSpec"]["autoscalerOptions"]["resources"]["requests"]
    assert obj["spec"]["submissionMode"] == "SidecarMode"
    cpu_m = int(cpu_millicores(head["resources"]["requests"]["cpu"]) + cpu_millicores(autoscaler["cpu"]) + 500)
    mem_mi = int(memory_mib(head["resources"]["requests"]["memory"]) + memory_mib(autoscaler["memory"]) + 200)
    cq = kueue.cluster_queue(spec)
    [system] = [g for g in cq["spec"]["resourceGroups"] if g["coveredResources"] == ["cpu", "memory"]]
    [flavor] = system["flavors"]
    quota = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
    assert quota == {"cpu": f"{cpu_m // 1000}", "memory": f"{mem_mi}Mi"} == {"cpu": "3", "memory": "8904Mi"}
    [system_flavor] = [f for f in kueue.resource_flavors(spec) if f["metadata"]["name"] == flavor["name"]]
    head_pod = obj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert system_flavor["spec"]["nodeLabels"] == head_pod["nodeSelector"]
    # The TPU pods ask for no CPU or memory, so Kueue never gives them the system flavor's node selector.
    worker = obj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert set(worker["resources"]["limits"]) == {"google.com/tpu"}
    # A JobSet environment has no CPU group at all.
    staging = parse_spec(_raw("staging"), "staging", bundled_configs())
    assert all("cpu" not in g["coveredResources"] for g in kueue.cluster_queue(staging)["spec"]["resourceGroups"])
    assert all(f["metadata"]["name"] != kueue.SYSTEM_FLAVOR for f in kueue.resource_flavors(staging))


def test_every_catalog_shape_agrees_with_rays_own_tpu_facts() -> None:
    """Ray Train computes workers per slice and TPU chips per worker from (accelerator type, topology); the RayJob's
    numOfHosts and TPU request come from our catalog. They must agree for every shape we offer."""
    from ray.util.tpu import get_tpu_worker_resources

    for gen in tpu.GENERATIONS.values():
        for topology in gen.topologies:
            shape = tpu.SliceShape(gen, topology)
            workers, resources = get_tpu_worker_resources(topology=topology, accelerator_type=gen.ray_accelerator,
                                                         resources_per_worker=None, num_slices=1)
            assert (workers, resources["TPU"]) == (shape.hosts, shape.chips_per_host), shape.key


def test_ray_version_is_the_images() -> None:
    import ray

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    assert extra == [f"ray[default,train]=={rayjob.RAY_VERSION}"]
    assert ray.__version__ == rayjob.RAY_VERSION


def test_entrypoint_is_the_trainers_own_cli() -> None:
    """The RayJob runs `python -m trainer --ray ...`: the trainer's parser takes it, with the elastic range, Ray's
    TPU type and the config and run folder the JobSet's pods get."""
    from trainer.run.cli import build_parser

    spec = CASES["staging"]()
    argv = shlex.split(_rayjob(spec)["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "trainer"]
    args = build_parser().parse_args(argv[3:])
    assert args.ray and args.ray_slices == "1:2" and args.ray_tpu == "TPU-V6E:4x4"
    assert args.ray_max_failures == spec.trainer.max_failures
    assert args.config == spec.trainer.config
    assert args.run_dir == f"{trainer_pod.CHECKPOINT_MOUNT}/{spec.trainer.name}/run"
    job_args = build_parser().parse_args(jobset.trainer_args(spec, split=False))
    assert (args.config, args.run_dir) == (job_args.config, job_args.run_dir)
    assert args.overrides == [o for o in job_args.overrides if not o.startswith("mesh.slices=")]


@pytest.mark.parametrize(("trainer", "message"), [
    ({"minSlices": 3}, "trainer.minSlices: 3 is more than trainer.slices (2); allowed: 1..2"),
    ({"name": "g" * 48}, "longer than KubeRay's 47 characters"),
    ({"serviceAccount": "s" * 60}, "the Ray head's account"),
])
def test_bad_ray_settings_are_named(trainer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _ray_spec("staging", **trainer)


def test_ray_needs_its_operator_and_only_ray_resizes() -> None:
    raw = copy.deepcopy(_raw("dev"))
    raw["cluster"] = {**raw["cluster"], "rayOperator": False}
    with pytest.raises(ConfigError, match="cluster.rayOperator: false"):
        parse_spec(raw, "dev", bundled_configs())
    raw = copy.deepcopy(_raw("staging"))
    raw["trainer"] = {**raw["trainer"], "minSlices": 1}
    with pytest.raises(ConfigError, match="trainer.minSlices: only the 'ray' launcher resizes"):
        parse_spec(raw, "staging", bundled_configs())
    raw = copy.deepcopy(_raw("dev"))
    raw["slices"] = [{**raw["slices"][0], "name": "head"}]
    with pytest.raises(ConfigError, match="'head' names the Ray worker group"):
        parse_spec(raw, "dev", bundled_configs())
    assert parse_spec(_raw("dev"), "dev", bundled_configs()).ray_operator_enabled
    assert not parse_spec(_raw("staging"), "staging", bundled_configs()).ray_operator_enabled


def test_network_policy_lets_the_operator_reach_only_the_token_guarded_dashboard() -> None:
    """GKE's hosted KubeRay operator polls the job's status on the dashboard (rayjob_controller.go; it fails the
    RayJob after DEFAULT_RAYJOB_STATUS_CHECK_TIMEOUT_SECONDS of errors) from no pod a policy can select: the dashboard
    port is open to the cluster and guarded by Ray's token; every other Ray port admits only the job's own pods."""
    spec = CASES["dev"]()
    policy = rayjob.network_policy(spec)["spec"]
    own = {"podSelector": {"matchLabels": {rayjob.JOB_LABEL: spec.trainer.name}}}
    assert policy["podSelector"] == own["podSelector"] and policy["policyTypes"] == ["Ingress"]
    open_rules = [r for r in policy["ingress"] if "from" not in r]
    assert open_rules == [{"ports": [{"protocol": "TCP", "port": rayjob.DASHBOARD_PORT}]}]
    assert [r for r in policy["ingress"] if "from" in r] == [{"from": [own]}]
    assert _rayjob(spec)["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
