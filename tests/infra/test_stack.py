"""The real program under Pulumi mocks, one environment at a time: the resource graph and the arguments that matter."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import yaml

from envspec.config import ConfigError, parse_spec
from infra.offline.mockrun import PlanResult, Resource, run_stack
from tests.infra.conftest import ROOT, raw_inputs, stack_config
from tests.infra.test_config import _raw as _raw_config
from trainer.base.config import bundled_configs

POOL = "gcp:container/nodePool:NodePool"
NETWORK = "gcp:compute/network:Network"
JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
RAYJOB = "kubernetes:ray.io/v1:RayJob"
CLUSTER_QUEUE = "kubernetes:kueue.x-k8s.io/v1beta2:ClusterQueue"


def _tpu_pools(plan: PlanResult) -> dict[str, Resource]:
    return {r.name: r for r in plan.of_type(POOL) if "machineType" in r.inputs["nodeConfig"]
            and r.inputs["nodeConfig"]["machineType"].startswith(("ct", "tpu"))}


def _only(plan: PlanResult, type_: str) -> Resource:
    found = plan.of_type(type_)
    assert len(found) == 1, [r.name for r in found]
    return found[0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _parent_type(plan: PlanResult, r: Resource) -> str:
    return next(p.type for p in plan.resources if p.urn == r.parent)


def test_components_own_their_resources(plans: dict[str, PlanResult]) -> None:
    plan = plans["staging"]
    components = {r.type for r in plan.resources if r.is_component}
    assert {"gke-tpu-rl:infra:Network", "gke-tpu-rl:infra:Cluster", "gke-tpu-rl:infra:TpuSlices",
            "gke-tpu-rl:infra:Storage", "gke-tpu-rl:infra:Controllers", "gke-tpu-rl:infra:Queues",
            "gke-tpu-rl:infra:TrainerJob", "gke-tpu-rl:infra:Registry"} <= components
    assert all(_parent_type(plan, p) == "gke-tpu-rl:infra:TpuSlices" for p in _tpu_pools(plan).values())
    assert _parent_type(plan, _only(plan, JOBSET)) == "gke-tpu-rl:infra:TrainerJob"


def test_dev_single_host_spot_slices_on_ray(plans: dict[str, PlanResult]) -> None:
    plan = plans["dev"]
    pools = _tpu_pools(plan)
    assert list(pools) == ["v6e-dev-0", "v6e-dev-1"]
    for pool in pools.values():
        p = pool.inputs
        assert p["nodeCount"] == 1
        assert p["nodeConfig"]["machineType"] == "ct6e-standard-4t"
        assert p["nodeConfig"]["spot"] is True
        assert "placementPolicy" not in p  # single host: nothing to place
        assert "networkConfig" not in p
    assert len(plan.of_type(NETWORK)) == 1  # no DRANET networks
    bucket = _only(plan, "gcp:storage/bucket:Bucket").inputs
    assert bucket["forceDestroy"] is True
    # The trainer is an elastic RayJob over both slices (down to one) on the Ray operator add-on, not a JobSet.
    assert not plan.of_type(JOBSET)
    [workers] = _only(plan, RAYJOB).inputs["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (workers["minReplicas"], workers["replicas"], workers["maxReplicas"], workers["numOfHosts"]) == (
        1, 2, 2, 1)
    cluster = _only(plan, "gcp:container/cluster:Cluster").inputs
    assert cluster["addonsConfig"]["rayOperatorConfigs"] == [{"enabled": True}]
    staging = _only(plans["staging"], "gcp:container/cluster:Cluster").inputs
    assert not staging["addonsConfig"].get("rayOperatorConfigs")  # JobSet only: no operator it does not use


def test_staging_multihost_slices_with_dranet(plans: dict[str, PlanResult]) -> None:
    plan = plans["staging"]
    pools = _tpu_pools(plan)
    assert sorted(pools) == ["v6e-stg-0", "v6e-stg-1"]
    extra_vpcs = [n for n in plan.of_type(NETWORK) if "dranet" in n.name]
    assert len(extra_vpcs) == 2 and all(n.inputs["mtu"] == 8896 for n in extra_vpcs)
    for pool in pools.values():
        p = pool.inputs
        assert p["nodeCount"] == 4
        assert p["placementPolicy"] == {"type": "COMPACT", "tpuTopology": "4x4"}
        assert p["nodeConfig"]["labels"]["cloud.google.com/gke-networking-dra-driver"] == "true"
        assert p["nodeConfig"]["gvnic"] == {"enabled": True}
        assert len(p["networkConfig"]["additionalNodeNetworkConfigs"]) == 2
        assert "spot" not in p["nodeConfig"] and "reservationAffinity" not in p["nodeConfig"]
    cluster = _only(plan, "gcp:container/cluster:Cluster").inputs
    assert cluster["datapathProvider"] == "ADVANCED_DATAPATH"
    assert cluster["enableMultiNetworking"] is True
    assert cluster["minMasterVersion"] == "1.34.99-gke.99999"  # the channel's newest 1.34 (mocked)
    assert cluster["privateClusterConfig"]["enablePrivateNodes"] is True
    assert cluster["workloadIdentityConfig"] == {"workloadPool": "acme-rl-staging.svc.id.goog"}
    assert cluster["addonsConfig"]["gcsFuseCsiDriverConfig"] == {"enabled": True}


def test_checkpoint_bucket_is_private_and_bound_to_the_trainer_only(plans: dict[str, PlanResult]) -> None:
    plan = plans["staging"]
    bucket = _only(plan, "gcp:storage/bucket:Bucket").inputs
    assert bucket["uniformBucketLevelAccess"] is True
    assert bucket["publicAccessPrevention"] == "enforced"
    assert bucket["forceDestroy"] is False
    iam = _only(plan, "gcp:storage/bucketIAMMember:BucketIAMMember").inputs
    assert iam["role"] == "roles/storage.objectUser"
    assert iam["bucket"] == bucket["name"]
    assert iam["member"] == ("principal://iam.googleapis.com/projects/123456789012/locations/global/"
                             "workloadIdentityPools/acme-rl-staging.svc.id.goog/subject/ns/rl/sa/trainer")
    # No project-wide storage grant anywhere.
    assert not [r for r in plan.of_type("gcp:projects/iAMMember:IAMMember") if "storage" in r.inputs["role"]]
    assert not plan.of_type("gcp:serviceaccount/key:Key")


@pytest.mark.parametrize("protect", [True, False], ids=["protected", "unprotected-force-destroy"])
def test_the_state_bucket_has_a_hierarchical_namespace_from_creation_only(plans: dict[str, PlanResult],
                                                                         protect: bool) -> None:
    """Review 2026-11-28 #11: the engine publishes each state snapshot by a folder rename, atomic on a hierarchical
    namespace (gcsfuse RenameFolder) and a full copy on a flat bucket, so the state bucket is created with one
    (uniform access on, versioning off, as GCS requires). The setting forces a new bucket (the provider's ForceNew),
    and an existing stack's bucket holds every user's state: the program ignores the setting after creation
    (Pulumi keeps the old value of an ignoreChanges path before it diffs), so the next `pulumi up` of a stack made
    before changes nothing there, protected or not, even with storage.forceDestroy."""
    config = stack_config("tinker")
    if not protect:
        config = {**config, "gke-tpu-rl:storage": {"protect": False, "forceDestroy": True}}
    plan = plans["tinker"] if protect else run_stack("tinker", config)
    buckets = {r.name: r for r in plan.of_type("gcp:storage/bucket:Bucket")}
    state, checkpoints = buckets["tinker-storage-service-state"], buckets["tinker-storage-checkpoints"]
    assert state.inputs["hierarchicalNamespace"] == {"enabled": True}
    assert state.inputs["uniformBucketLevelAccess"] is True and state.inputs["versioning"] == {"enabled": False}
    assert "hierarchicalNamespace" not in checkpoints.inputs  # the trainer's bucket is as it was
    # The one input a bucket deployed before this lacks is ignored after creation: no diff, no replacement.
    assert state.options["ignoreChanges"] == ["hierarchicalNamespace"]
    assert bool(state.options.get("retainOnDelete")) is protect
    # The Terraform gcp stack the same (its golden is the synth's output, tests/infra/test_terraform.py).
    golden = json.loads((ROOT / "tests/golden/terraform/tinker/gcp.cdk.tf.json").read_text())
    tf = golden["resource"]["google_storage_bucket"]["tinker-storage-service-state"]
    assert tf["hierarchical_namespace"] == {"enabled": True}
    assert tf["lifecycle"] == {"ignore_changes": ["hierarchical_namespace"], "prevent_destroy": True}


def test_prod_reservation_and_flex_start(plans: dict[str, PlanResult]) -> None:
    plan = plans["prod"]
    pools = _tpu_pools(plan)
    v5p = [p.inputs for n, p in pools.items() if n.startswith("v5p-prod")]
    burst = [p.inputs for n, p in pools.items() if n.startswith("v6e-burst")]
    assert len(v5p) == 4 and len(burst) == 2
    for p in v5p:
        assert p["nodeCount"] == 16
        assert p["nodeConfig"]["machineType"] == "ct5p-hightpu-4t"
        assert p["placementPolicy"] == {"type": "COMPACT", "tpuTopology": "4x4x4"}
        assert p["nodeConfig"]["reservationAffinity"] == {
            "consumeReservationType": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name", "values": ["rl-v5p-prod"]}
        # ct5p is not a managed-DRANET machine: no extra networks, no DRA driver label.
        assert "networkConfig" not in p
        assert "cloud.google.com/gke-networking-dra-driver" not in p["nodeConfig"]["labels"]
    for p in burst:
        # A ct6e host has 2 physical NICs: 2 extra networks and the DRA driver label.
        assert len(p["networkConfig"]["additionalNodeNetworkConfigs"]) == 2
        assert p["nodeConfig"]["labels"]["cloud.google.com/gke-networking-dra-driver"] == "true"
        assert "nodeCount" not in p and p["initialNodeCount"] == 0
        assert p["queuedProvisioning"] == {"enabled": True}
        assert p["autoscaling"]["totalMaxNodeCount"] == 8
        assert p["nodeConfig"]["flexStart"] is True
    cq = _only(plan, CLUSTER_QUEUE).inputs["spec"]
    quota = {f["name"]: f["resources"][0]["nominalQuota"] for f in cq["resourceGroups"][0]["flavors"]}
    assert quota == {"v5p-4x4x4": 4 * 64, "v6e-4x8": 2 * 32}
    assert cq["admissionChecksStrategy"]["admissionChecks"] == [{"name": "flex-start", "onFlavors": ["v6e-4x8"]}]
    cluster = _only(plan, "gcp:container/cluster:Cluster").inputs
    assert cluster["addonsConfig"]["rayOperatorConfigs"] == [{"enabled": True}]
    assert cluster["deletionProtection"] is True
    assert plan.outputs["chipsPerSliceGroup"] == {"v5p-prod": 256, "v6e-burst": 64}
    # The trainer runs on v5p: its pods claim no DRANET devices and no claim template is emitted.
    pod = _only(plan, JOBSET).inputs["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "resourceClaims" not in pod
    assert not plan.of_type("kubernetes:resource.k8s.io/v1:ResourceClaimTemplate")


def test_queues_match_declared_slices(plans: dict[str, PlanResult]) -> None:
    # staging's 8 hosts each claim 2 DRANET devices: Kueue needs quota for them or never admits the JobSet.
    for env, resources in {"dev": [("google.com/tpu", 8)],
                           "staging": [("google.com/tpu", 32), ("gke-tpu-rl/netdev", 16)]}.items():
        cq = _only(plans[env], CLUSTER_QUEUE).inputs["spec"]
        [flavor] = cq["resourceGroups"][0]["flavors"]  # dev's second group is the Ray head's CPU (test_rayjob)
        assert flavor["resources"] == [{"name": n, "nominalQuota": q} for n, q in resources]
        assert cq["resourceGroups"][0]["coveredResources"] == [n for n, _ in resources]
        assert "admissionChecksStrategy" not in cq
    lq = _only(plans["staging"], "kubernetes:kueue.x-k8s.io/v1beta2:LocalQueue").inputs
    assert lq["metadata"]["namespace"] == "rl" and lq["spec"]["clusterQueue"] == "tpu-cluster-queue"
    flavor = _only(plans["staging"], "kubernetes:kueue.x-k8s.io/v1beta2:ResourceFlavor").inputs["spec"]
    assert flavor["nodeLabels"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                    "cloud.google.com/gke-tpu-topology": "4x4"}


def test_controllers_from_upstream_charts(plans: dict[str, PlanResult]) -> None:
    releases = {r.inputs["name"]: r.inputs for r in plans["dev"].of_type("kubernetes:helm.sh/v3:Release")}
    assert releases["jobset"]["chart"] == "oci://registry.k8s.io/jobset/charts/jobset"
    assert releases["jobset"]["version"] == "0.12.0"
    assert releases["kueue"]["chart"] == "oci://registry.k8s.io/kueue/charts/kueue"
    assert releases["kueue"]["version"] == "0.19.2"


def test_staging_jobset_shape(plans: dict[str, PlanResult]) -> None:
    js = _only(plans["staging"], JOBSET).inputs
    meta, spec = js["metadata"], js["spec"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "tpu"
    assert meta["labels"]["kueue.x-k8s.io/priority-class"] == "default"
    assert meta["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    assert spec["failurePolicy"]["maxRestarts"] == 3
    [rj] = spec["replicatedJobs"]
    job = rj["template"]["spec"]
    assert (rj["replicas"], job["parallelism"], job["completions"]) == (2, 4, 4)
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4"}
    [c] = pod["containers"]
    assert c["resources"]["limits"]["google.com/tpu"] == 4
    assert c["resources"]["claims"] == [{"name": "netdev"}]
    assert pod["resourceClaims"] == [{"name": "netdev", "resourceClaimTemplateName": "grpo-stg-netdev"}]
    assert "privileged" not in c.get("securityContext", {})
    env = _env(c)
    assert env["COORDINATOR_ADDRESS"] == "grpo-stg-slice-0-0.grpo-stg:8476"
    assert env["NUM_SLICES"] == "2" and env["HOSTS_PER_SLICE"] == "4"
    assert env["SLICE_INDEX"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    assert env["MEGASCALE_NUM_SLICES"] == "2"
    assert pod["serviceAccountName"] == "trainer"
    assert pod["terminationGracePeriodSeconds"] == 600
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["csi"]["volumeAttributes"]["bucketName"] == "acme-rl-staging-staging-checkpoints"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    rct = _only(plans["staging"], "kubernetes:resource.k8s.io/v1:ResourceClaimTemplate").inputs
    assert rct["spec"]["spec"]["devices"]["requests"][0]["exactly"] == {
        "deviceClassName": "netdev.google.com", "allocationMode": "ExactCount", "count": 2}


def test_hf_token_is_a_secret_everywhere(plans: dict[str, PlanResult]) -> None:
    token = "hf_not_a_real_token_123"
    # As after `pulumi config set --secret gke-tpu-rl:hfToken ...`.
    plan = run_stack("staging", {**stack_config("staging"), "gke-tpu-rl:hfToken": token},
                     secret_keys=["gke-tpu-rl:hfToken"])
    secret = _only(plan, "kubernetes:core/v1:Secret").inputs
    assert secret["stringData"]["token"] == "[secret]"
    assert token not in json.dumps([r.inputs for r in plan.resources]) + json.dumps(plan.outputs)
    assert "kubeconfig" in plan.secret_outputs
    assert not plans["staging"].of_type("kubernetes:core/v1:Secret")  # no token configured: no Secret


def test_outputs(plans: dict[str, PlanResult]) -> None:
    out = plans["staging"].outputs
    assert out["clusterName"] == "rl-staging"
    assert out["checkpointBucket"] == "gs://acme-rl-staging-staging-checkpoints"
    assert out["localQueue"] == "tpu" and out["clusterQueue"] == "tpu-cluster-queue"
    assert out["chipsPerSliceGroup"] == {"v6e-stg": 32}
    assert out["kubeconfig"] == "[secret]"


def test_control_plane_reaches_the_webhooks_and_the_visibility_api_on_private_nodes(
        plans: dict[str, PlanResult]) -> None:
    for env, plan in plans.items():
        rules = [r.inputs for r in plan.of_type("gcp:compute/firewall:Firewall") if r.name.endswith("-webhooks")]
        assert len(rules) == 1, env
        rule = rules[0]
        master = stack_config(env).get("gke-tpu-rl:network", {}).get("masterCidr", "172.16.0.0/28")
        assert rule["sourceRanges"] == [master]
        assert rule["direction"] == "INGRESS"
        # 9443: the JobSet and Kueue admission webhooks; 8082: the backend of Kueue's aggregated APIServices
        # v1beta1/v1beta2.visibility.kueue.x-k8s.io (chart v0.19.2 templates/visibility/service.yaml targetPort).
        assert rule["allows"] == [{"protocol": "tcp", "ports": ["9443", "8082"]}]
        # Nothing else is opened to the control plane: every other firewall rule is a DRANET network's own.
        others = [r for r in plan.of_type("gcp:compute/firewall:Firewall") if not r.name.endswith("-webhooks")]
        assert all("-dranet-" in r.name and r.inputs["sourceRanges"] != [master] for r in others), env
    # The ports opened are the ones Kueue's manager listens on: its config keeps the webhook on 9443 and leaves the
    # visibility server at its default bind port, 8082 (apis/config/v1beta2/defaults.go at v0.19.2).
    for plan in plans.values():
        [kueue] = [r for r in plan.of_type("kubernetes:helm.sh/v3:Release") if r.inputs["name"] == "kueue"]
        config = yaml.safe_load(kueue.inputs["values"]["managerConfig"]["controllerManagerConfigYaml"])
        assert config["webhook"]["port"] == 9443
        assert "visibilityServer" not in config
        # Turning the visibility server off would leave the chart's APIServices pointing at nothing.
        assert not [g for g in kueue.inputs["values"].get("controllerManager", {}).get("featureGates", [])
                    if g["name"] == "VisibilityOnDemand" and not g["enabled"]]


def test_kueue_maps_the_dranet_device_class_and_keeps_its_default_integrations(plans: dict[str, PlanResult]) -> None:
    for env, mapped in {"dev": False, "staging": True, "prod": True}.items():
        [kueue] = [r for r in plans[env].of_type("kubernetes:helm.sh/v3:Release") if r.inputs["name"] == "kueue"]
        config = yaml.safe_load(kueue.inputs["values"]["managerConfig"]["controllerManagerConfigYaml"])
        assert config["kind"] == "Configuration" and config["webhook"]["port"] == 9443
        assert {"jobset.x-k8s.io/jobset", "batch/job", "pod", "ray.io/raycluster"} <= set(
            config["integrations"]["frameworks"])
        mappings = config.get("resources", {}).get("deviceClassMappings", [])
        assert mappings == ([{"name": "gke-tpu-rl/netdev", "deviceClassNames": ["netdev.google.com"]}]
                            if mapped else [])
    # prod: only the v6e burst flavor has DRANET (2 slices x 8 hosts x 2 NICs); v5p covers it with zero quota.
    cq = _only(plans["prod"], CLUSTER_QUEUE).inputs["spec"]["resourceGroups"][0]
    quota = {(f["name"], r["name"]): r["nominalQuota"] for f in cq["flavors"] for r in f["resources"]}
    assert quota[("v6e-4x8", "gke-tpu-rl/netdev")] == 32 and quota[("v5p-4x4x4", "gke-tpu-rl/netdev")] == 0
    # Every claim the trainer's pods make is a device Kueue now has quota for.
    rct = _only(plans["staging"], "kubernetes:resource.k8s.io/v1:ResourceClaimTemplate").inputs
    [request] = rct["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "netdev.google.com"


def _provider_inputs(env: str, overrides: dict[str, Any]) -> dict[str, Any]:
    # The provider's kubeconfig is a secret in the plan; read it from the raw registration instead.
    cluster = {**stack_config(env).get("gke-tpu-rl:cluster", {}), **overrides}
    [provider] = raw_inputs(env, {**stack_config(env), "gke-tpu-rl:cluster": cluster}, "pulumi:providers:kubernetes")
    return provider


def _provider_kubeconfig(env: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(_provider_inputs(env, overrides)["kubeconfig"])


def _provider_replaced(olds: dict[str, Any], news: dict[str, Any]) -> bool:
    """pulumi-kubernetes' DiffConfig (provider/pkg/provider/provider.go, pulumi-kubernetes HEAD 94977969d, lines
    486-500 and 542-551): a changed clusterIdentifier replaces the provider; an unchanged one that is set replaces
    nothing; else (no identifier, or one just added) a change of the kubeconfig's active cluster replaces it."""
    key = "clusterIdentifier"
    if olds.get(key) is not None and news.get(key) is not None:
        return olds[key] != news[key]
    def active(inputs: dict[str, Any]) -> Any:  # noqa: E306
        config = yaml.safe_load(inputs["kubeconfig"])
        context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
        return next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    return active(olds) != active(news)


def test_switching_the_api_endpoint_keeps_every_kubernetes_resource() -> None:
    """The kubeconfig's server changes between the IP and DNS endpoints; the provider's cluster identifier (the
    cluster's id) does not, so the provider, and with it every Helm release, queue and job, is updated in place."""
    ip, dns = _provider_inputs("prod", {"controlPlaneEndpoint": "ip"}), _provider_inputs("prod", {})
    assert yaml.safe_load(ip["kubeconfig"])["clusters"] != yaml.safe_load(dns["kubeconfig"])["clusters"]
    assert ip["clusterIdentifier"] == dns["clusterIdentifier"] == "rl-prod-id"  # the mocks' id of the cluster
    assert not _provider_replaced(ip, dns) and not _provider_replaced(dns, ip)
    # Without the identifier (a stack deployed before it existed) the same switch replaces the provider, and the
    # provider does not apply the identifier in the update that adds it: hence the README's two-step migration
    # (first `pulumi up` with the endpoint unchanged, then switch).
    legacy = {k: v for k, v in ip.items() if k != "clusterIdentifier"}
    assert _provider_replaced(legacy, dns)
    assert not _provider_replaced(legacy, _provider_inputs("prod", {"controlPlaneEndpoint": "ip"}))
    # A different cluster is a different provider.
    assert _provider_replaced(dns, {**dns, "clusterIdentifier": "rl-other-id"})


def test_ci_reaches_the_api_server_through_the_dns_endpoint(plans: dict[str, PlanResult]) -> None:
    for env, plan in plans.items():
        cluster = _only(plan, "gcp:container/cluster:Cluster").inputs
        assert cluster["controlPlaneEndpointsConfig"]["dnsEndpointConfig"]["allowExternalTraffic"] is True, env
        assert plan.outputs["clusterEndpoint"].startswith("gke-mock-"), env  # the DNS name, not the IP
    # prod keeps its IP allow-list for the IP endpoint, but the provider does not depend on it.
    assert _only(plans["prod"], "gcp:container/cluster:Cluster").inputs[
        "masterAuthorizedNetworksConfig"]["cidrBlocks"] == [{"cidrBlock": "10.128.0.0/9"}]
    dns = _provider_kubeconfig("prod", {})["clusters"][0]["cluster"]
    assert dns == {"server": "https://gke-mock-rl-prod.mock.gke.goog.invalid"}  # public CA: no CA data
    ip = _provider_kubeconfig("prod", {"controlPlaneEndpoint": "ip"})["clusters"][0]["cluster"]
    assert ip["server"] == "https://203.0.113.10" and ip["certificate-authority-data"]
    [user] = _provider_kubeconfig("dev", {})["users"]
    assert user["user"]["exec"]["command"] == "gke-gcloud-auth-plugin"  # IAM, no static credentials


def test_ip_endpoint_is_a_choice_with_no_dns_config() -> None:
    cluster = {**stack_config("dev").get("gke-tpu-rl:cluster", {}), "controlPlaneEndpoint": "ip"}
    plan = run_stack("dev", {**stack_config("dev"), "gke-tpu-rl:cluster": cluster})
    assert "controlPlaneEndpointsConfig" not in _only(plan, "gcp:container/cluster:Cluster").inputs
    assert plan.outputs["clusterEndpoint"] == "203.0.113.10"


def test_gke_version_is_a_channel_default_or_a_prefix_never_a_pinned_patch(plans: dict[str, PlanResult]) -> None:
    from infra.components.cluster import choose_version

    # staging/prod: versionPrefix 1.34. -> the channel's newest 1.34 at deploy time (the mock's patch 99).
    for env in ("staging", "prod"):
        cluster = _only(plans[env], "gcp:container/cluster:Cluster")
        assert cluster.inputs["minMasterVersion"] == "1.34.99-gke.99999", env
    # dev: no prefix -> GKE's channel default, no version field at all.
    assert "minMasterVersion" not in _only(plans["dev"], "gcp:container/cluster:Cluster").inputs
    # No node pool pins a version: nodes follow the control plane and auto-upgrade with the channel.
    for plan in plans.values():
        assert all("version" not in p.inputs for p in plan.of_type(POOL))

    floor = "1.34.1-gke.1829001"
    defaults = {"REGULAR": "1.33.5-gke.100", "RAPID": "1.35.0-gke.1"}
    assert choose_version(defaults, {"REGULAR": "1.34.7-gke.3"}, "REGULAR", "1.34.", floor) == "1.34.7-gke.3"
    assert choose_version(defaults, {}, "RAPID", None, floor) is None
    with pytest.raises(ValueError, match=r"REGULAR channel's default version 1\.33\.5-gke\.100 is older than "
                                         r"1\.34\.1-gke\.1829001.*set cluster\.versionPrefix"):
        choose_version(defaults, {}, "REGULAR", None, floor)
    with pytest.raises(ValueError, match=r"cluster\.versionPrefix: the STABLE channel offers no version starting "
                                         r"with '1\.36\.'"):
        choose_version(defaults, {"RAPID": "1.36.0-gke.1"}, "STABLE", "1.36.", None)


def test_tpu_pools_as_the_walkthroughs_create_them(plans: dict[str, PlanResult]) -> None:
    for env, plan in plans.items():
        for name, pool in _tpu_pools(plan).items():
            node = pool.inputs["nodeConfig"]
            assert node["gvnic"] == {"enabled": True}, (env, name)
            assert node["workloadMetadataConfig"] == {"mode": "GKE_METADATA"}
            assert node["oauthScopes"] == ["https://www.googleapis.com/auth/cloud-platform"]
            assert pool.inputs["nodeLocations"] == [plan.spec.zone]
            assert pool.inputs["upgradeSettings"] == {"maxSurge": 0, "maxUnavailable": 1}
            assert "diskType" not in node  # GKE's default boot disk, as the v5p/v6e walkthroughs leave it


def test_ironwood_slices_are_placed_like_cluster_toolkit() -> None:
    raw = stack_config("dev")
    config = {**raw, "gke-tpu-rl:slices": [
        {"name": "ironwood", "tpuType": "tpu7x", "topology": "2x2x2", "count": 2, "capacity": "on-demand"}]}
    config["gke-tpu-rl:trainer"] = {**raw["gke-tpu-rl:trainer"], "slices": 2}
    # A zone Google lists for Ironwood (envspec/tpu_zones.yaml).
    config["gke-tpu-rl:region"], config["gke-tpu-rl:zone"] = "us-central1", "us-central1-c"
    plan = run_stack("dev", config)
    [policy] = plan.of_type("gcp:compute/resourcePolicy:ResourcePolicy")
    assert policy.inputs["workloadPolicy"] == {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "2x2x2"}
    assert policy.inputs["region"] == "us-central1" and policy.inputs["name"] == "rl-dev-ironwood-placement"
    pools = _tpu_pools(plan)
    assert sorted(pools) == ["ironwood-0", "ironwood-1"]
    for pool in pools.values():
        # Cluster Toolkit's gke-node-pool passes the policy and the topology together.
        assert pool.inputs["placementPolicy"] == {"type": "COMPACT", "policyName": policy.inputs["name"],
                                                  "tpuTopology": "2x2x2"}
        assert pool.inputs["nodeConfig"]["machineType"] == "tpu7x-standard-4t"
        assert pool.inputs["nodeConfig"]["diskType"] == "hyperdisk-balanced"
        assert pool.inputs["nodeCount"] == 2


@pytest.mark.parametrize(("env", "kind"), [("staging", "JobSet"), ("dev", "RayJob")])
def test_the_training_job_is_replaced_on_change_and_waited_for(plans: dict[str, PlanResult], env: str,
                                                               kind: str) -> None:
    """`pulumi up` replaces the job on any change to what the stack renders (the JobSet webhook refuses spec
    updates; KubeRay never reruns a finished RayJob), deletes it first so the new one keeps the name and checkpoint
    directory, and waits for the old pods' SIGTERM checkpoint: pulumi-kubernetes deletes in the foreground and
    waits (provider/pkg/await/await.go Deletion, 10 minutes unless a custom timeout says otherwise)."""
    [job] = [r for r in plans[env].resources if r.type.endswith(f":{kind}")]
    spec = plans[env].spec
    assert job.options["replaceOnChanges"] == ["spec", "metadata"]
    assert job.options["deleteBeforeReplace"] is True
    assert job.options["customTimeouts"] == {"delete": f"{spec.trainer.termination_grace_seconds + 300}s"}
    assert job.inputs["metadata"]["name"] == spec.trainer.name  # the same name, so the same checkpoint folder
    # Nothing else is replaced on change but the staging Job (workloads/stage.py REPLACE_ON_CHANGES): the queues,
    # flavors and Helm releases update in place.
    replaced = {r.name for r in plans[env].resources if r.options.get("replaceOnChanges")}
    assert replaced == {job.name, *(r.name for r in plans[env].of_type("kubernetes:batch/v1:Job"))}


def test_the_grace_period_covers_a_sigterm_checkpoint() -> None:
    """infra/checks/grace.py: parameters and Adam's two moments, per writing host, at the assumed write rate, twice,
    plus the step in flight; a shorter trainer.terminationGraceSeconds is refused with the figures before anything
    runs."""
    from infra.checks import grace

    spec = parse_spec(_raw_config("prod"), "prod", bundled_configs())
    found = grace.estimate(spec)
    assert found is not None and found.model == "Llama-3.1-70B"
    # Llama-3.1-70B in float32 (prod's config): 3 copies x 4 bytes; replicas per slice, so one slice's 16 hosts write.
    assert found.state_bytes == 3 * 4 * 70_553_706_496 and found.writers == 16
    per_host_s = found.state_bytes / 16 / (grace.WRITE_MIB_S_PER_HOST * 2**20)
    assert found.seconds == math.ceil(2 * per_host_s + grace.STEP_ALLOWANCE_S) == 625
    # staging shards the bf16 state across both slices (every one of the 8 hosts writes its own eighth) and uses
    # Adafactor: no first moment, factored second moments, so about the parameters alone.
    staging = grace.estimate(parse_spec(_raw_config("staging"), "staging", bundled_configs()))
    assert staging is not None and staging.writers == 8 and staging.state_bytes == 2 * 70_553_706_496
    assert staging.seconds == 289
    short = _raw_config("prod")
    short["trainer"] = {**short["trainer"], "terminationGraceSeconds": 600}
    with pytest.raises(ConfigError, match=r"trainer\.terminationGraceSeconds: 600 s is too short .* about 625 s"):
        grace.check(parse_spec(short, "prod", bundled_configs()))
    # The Ray path has no SIGTERM checkpoint (Ray kills its workers): nothing to size.
    assert grace.estimate(parse_spec(_raw_config("dev"), "dev", bundled_configs())) is None
    # Every environment in environments/ passes (users add their own).
    for path in sorted((ROOT / "environments").glob("Pulumi.*.yaml")):
        env = path.name.split(".")[1]
        grace.check(parse_spec(_raw_config(env), env, bundled_configs()))


def test_the_engines_new_failure_policy_replaces_it_on_an_existing_stack(plans: dict[str, PlanResult]) -> None:
    """Review 2026-11-28 #8 on a stack deployed before it: the engine's failurePolicy gains a rule, and failurePolicy
    is immutable by CEL (JobSet v0.12.0 CRD: spec.failurePolicy `self == oldSelf`), so an in-place PATCH would be
    refused. The engine is registered with replaceOnChanges ["spec", "metadata"] (pulumi-kubernetes' Diff reports
    the changed path, which the option matches) and deleteBeforeReplace: `pulumi up` deletes the old engine
    (foreground, waiting out its pods' grace) and creates the new one under the same name."""
    import copy

    from infra.offline.diff import compare, snapshot
    from workloads.jobset import FAIL_ON_BUG

    new = snapshot(plans["tinker"])
    old = copy.deepcopy(new)
    [urn] = [u for u, r in new.resources.items() if r["type"] == JOBSET]
    old.resources[urn]["inputs"]["spec"]["failurePolicy"]["rules"] = [FAIL_ON_BUG]  # as it was deployed
    [change] = compare("tinker", "before", old, new).changed
    assert change.urn == urn and change.replaced
    paths = [path for path, _, _ in change.inputs]
    assert all(p.startswith("spec.failurePolicy.rules[") for p in paths)
    assert "spec.failurePolicy.rules[2].action" in paths
    assert new.resources[urn]["options"]["deleteBeforeReplace"] is True
