"""Least privilege over every environment's rendered stack: what each identity may do, and what each pod may do."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from infra.iam import NODE_ROLES
from infra.mockrun import SECRET_MASK, PlanResult
from infra.plan import kubernetes_objects
from tests.infra.conftest import ENVIRONMENTS

WORKLOAD_PRINCIPAL = re.compile(r"^principal(Set)?://iam\.googleapis\.com/.*/workloadIdentityPools/")
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE_?KEY", re.I)


def _pod_specs(plan: PlanResult) -> list[dict[str, Any]]:
    pods = []
    for obj in kubernetes_objects(plan):
        if obj["kind"] == "JobSet":
            pods += [rj["template"]["spec"]["template"]["spec"] for rj in obj["spec"]["replicatedJobs"]]
        elif obj["kind"] == "RayJob":
            cluster = obj["spec"]["rayClusterSpec"]
            pods += [cluster["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"]
                                                                     for g in cluster["workerGroupSpecs"])]
        elif obj["kind"] == "Pod":
            pods.append(obj["spec"])
    return pods


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_identities_hold_only_what_they_need(plans: dict[str, PlanResult], env: str) -> None:
    plan = plans[env]
    project_grants = plan.of_type("gcp:projects/iAMMember:IAMMember")
    # Project-level roles go to the nodes' own account only, and only the logging/monitoring ones.
    assert project_grants and all(r.inputs["member"].startswith("serviceAccount:") for r in project_grants)
    assert {r.inputs["role"] for r in project_grants} <= set(NODE_ROLES)
    assert not any(WORKLOAD_PRINCIPAL.match(r.inputs["member"]) for r in project_grants)
    assert not plan.of_type("gcp:projects/iAMBinding:IAMBinding") and not plan.of_type(
        "gcp:projects/iAMPolicy:IAMPolicy")  # nothing that rewrites project policy wholesale
    # The workload's only grants are on the bucket it writes: the trainer as a per-object user, a Ray head (which
    # only reads the checkpoint's headers) as a viewer.
    [bucket] = plan.of_type("gcp:storage/bucket:Bucket")
    roles = {}
    for grant in plan.of_type("gcp:storage/bucketIAMMember:BucketIAMMember"):
        assert grant.inputs["bucket"] == bucket.inputs["name"]
        roles[grant.inputs["member"].rsplit("/sa/", 1)[1]] = grant.inputs["role"]
    t = plan.spec.trainer
    expected = {t.service_account: "roles/storage.objectUser"}
    if t.launcher == "ray":
        expected[plan.spec.ray_head_service_account] = "roles/storage.objectViewer"
    assert roles == expected
    # Registry: the nodes read; nobody else is granted anything there.
    for grant in plan.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember"):
        assert grant.inputs["role"] == "roles/artifactregistry.reader"
    assert not plan.of_type("gcp:serviceaccount/key:Key")  # no service-account keys, ever


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_nothing_is_public(plans: dict[str, PlanResult], env: str) -> None:
    plan = plans[env]
    [cluster] = plan.of_type("gcp:container/cluster:Cluster")
    assert cluster.inputs["privateClusterConfig"]["enablePrivateNodes"] is True
    assert cluster.inputs["workloadIdentityConfig"]["workloadPool"].endswith(".svc.id.goog")
    [bucket] = plan.of_type("gcp:storage/bucket:Bucket")
    assert bucket.inputs["publicAccessPrevention"] == "enforced" and bucket.inputs["uniformBucketLevelAccess"]
    everything = json.dumps([r.inputs for r in plan.resources])
    assert "allUsers" not in everything and "allAuthenticatedUsers" not in everything
    for rule in plan.of_type("gcp:compute/firewall:Firewall"):
        assert "0.0.0.0/0" not in (rule.inputs.get("sourceRanges") or []), rule.name
    for pool in plan.of_type("gcp:container/nodePool:NodePool"):
        assert pool.inputs["nodeConfig"]["workloadMetadataConfig"] == {"mode": "GKE_METADATA"}, pool.name


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_pods_are_unprivileged_and_read_secrets_from_secrets(plans: dict[str, PlanResult], env: str) -> None:
    plan = plans[env]
    spec = plan.spec
    pods = _pod_specs(plan)
    assert pods
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"] + pod.get("initContainers", []):
            ctx = c.get("securityContext", {})
            assert ctx.get("privileged") is not True and ctx.get("allowPrivilegeEscalation") is False, c["name"]
            assert not (ctx.get("capabilities") or {}).get("add"), c["name"]
            for e in c.get("env", []):
                if SECRETISH.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e.get("valueFrom", {}), e["name"]
        # The host network only where a JobSet's TPU hosts must reach each other without DRANET (workloads/jobset.py
        # says why); Ray pods stay on the pod network.
        group = spec.trainer_group
        needs_host = bool(group) and (group.shape.multi_host or spec.trainer.slices > 1) and not (
            spec.dranet_networks_for(group)) and spec.trainer.launcher == "jobset"
        assert pod.get("hostNetwork", False) is needs_host
        assert not pod.get("hostPID") and not pod.get("hostIPC")
    for obj in kubernetes_objects(plan):
        if obj["kind"] == "Secret":
            assert set(obj.get("stringData", {}).values()) <= {SECRET_MASK}  # Pulumi secrets all the way
