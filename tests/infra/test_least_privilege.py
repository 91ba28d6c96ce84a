"""Least privilege over every environment's rendered stack: what each identity may do, and what each pod may do."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from infra.components.database import CONNECTOR_ROLES, instance_condition
from infra.components.iam import NODE_ROLES
from infra.offline.mockrun import SECRET_MASK, PlanResult
from infra.offline.plan import kubernetes_objects
from tests.infra.conftest import ENVIRONMENTS
from trainer.service.store import CLOUDSQL_CREDENTIALS_ENV
from workloads import service

WORKLOAD_PRINCIPAL = re.compile(r"^principal(Set)?://iam\.googleapis\.com/.*/workloadIdentityPools/")
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE_?KEY", re.I)


def _pod_specs(plan: PlanResult) -> list[dict[str, Any]]:
    pods = []
    for obj in kubernetes_objects(plan):
        if obj["kind"] == "JobSet":
            pods += [rj["template"]["spec"]["template"]["spec"] for rj in obj["spec"]["replicatedJobs"]]
        elif obj["kind"] in ("Deployment", "Job"):
            pods.append(obj["spec"]["template"]["spec"])
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
    # Project-level roles go to the nodes' own account (the logging/monitoring ones only) and, with a service, to its
    # API's and engine's accounts: the Cloud SQL connector's roles, conditioned on the service's own instance.
    assert project_grants and all(r.inputs["member"].startswith("serviceAccount:") for r in project_grants)
    service_accounts = set()
    if plan.spec.service is not None:
        service_accounts = {f"serviceAccount:{a}@{plan.spec.project}.iam.gserviceaccount.com"
                            for a in plan.spec.service_gcp_accounts.values()}
    for r in project_grants:
        if r.inputs["member"] in service_accounts:
            assert r.inputs["role"] in CONNECTOR_ROLES
            assert r.inputs["condition"]["expression"] == instance_condition(plan.spec.project,
                                                                            plan.spec.sql_instance_name)
        else:
            assert r.inputs["role"] in NODE_ROLES and "condition" not in r.inputs, r.name
    assert not any(WORKLOAD_PRINCIPAL.match(r.inputs["member"]) for r in project_grants)
    assert not plan.of_type("gcp:projects/iAMBinding:IAMBinding") and not plan.of_type(
        "gcp:projects/iAMPolicy:IAMPolicy")  # nothing that rewrites project policy wholesale
    # The workloads' only grants are on the buckets they use: the trainer as a per-object user, a Ray head (which
    # only reads the checkpoint's headers) as a viewer, the service's engine on the checkpoint bucket and on its state
    # bucket, and its API (which serves downloads of what the engine saved) as a viewer of the checkpoint bucket.
    spec = plan.spec
    buckets = {b.inputs["name"] for b in plan.of_type("gcp:storage/bucket:Bucket")}
    roles = set()
    for grant in plan.of_type("gcp:storage/bucketIAMMember:BucketIAMMember"):
        who = grant.inputs["member"]
        roles.add((grant.inputs["bucket"], who.rsplit("/sa/", 1)[-1], grant.inputs["role"]))
    expected = set()
    if spec.trainer.enabled:
        expected.add((spec.bucket_name, spec.trainer.service_account, "roles/storage.objectUser"))
        if spec.trainer.launcher == "ray":
            expected.add((spec.bucket_name, spec.ray_head_service_account, "roles/storage.objectViewer"))
    if spec.service is not None:
        engines = {f"serviceAccount:{spec.service_gcp_accounts['engine']}@{spec.project}.iam.gserviceaccount.com"}
        if service.engine_on_host_network(spec):  # GCS FUSE's sidecar then uses the KSA's own token
            engines.add(spec.service_engine_name)
        expected |= {(b, e, "roles/storage.objectUser") for b in (spec.bucket_name, spec.service_state_bucket)
                     for e in engines}
        api = f"serviceAccount:{spec.service_gcp_accounts['api']}@{spec.project}.iam.gserviceaccount.com"
        expected.add((spec.bucket_name, api, "roles/storage.objectViewer"))
    assert roles == expected
    assert {b for b, _, _ in roles} <= buckets
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
    for bucket in plan.of_type("gcp:storage/bucket:Bucket"):
        assert bucket.inputs["publicAccessPrevention"] == "enforced" and bucket.inputs["uniformBucketLevelAccess"]
    for instance in plan.of_type("gcp:sql/databaseInstance:DatabaseInstance"):  # private IP only, TLS only
        ip = instance.inputs["settings"]["ipConfiguration"]
        assert ip["ipv4Enabled"] is False and not ip.get("authorizedNetworks") and ip["sslMode"] == "ENCRYPTED_ONLY"
    assert not plan.of_type("gcp:sql/user:User") or all(
        u.inputs["type"] == "CLOUD_IAM_SERVICE_ACCOUNT" and "password" not in u.inputs
        for u in plan.of_type("gcp:sql/user:User"))
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
                if e["name"] == CLOUDSQL_CREDENTIALS_ENV:
                    # A credential configuration, not a credential: where the pod's own token is and whom it
                    # becomes (workloads/service.py engine_credentials); no key material.
                    config = json.loads(e["value"])
                    assert config["type"] == "external_account" and set(config["credential_source"]) == {"file"}
                    assert not {"private_key", "client_secret", "refresh_token"} & set(config), config
                elif SECRETISH.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e.get("valueFrom", {}), e["name"]
        # The host network only where a JobSet's TPU hosts must reach each other without DRANET (workloads/jobset.py
        # says why): the trainer's, or the service engine's; Ray pods and CPU pods stay on the pod network.
        on_tpu = "cloud.google.com/gke-tpu-topology" in pod.get("nodeSelector", {})
        if on_tpu and pod["serviceAccountName"] == spec.trainer.service_account and spec.trainer.launcher == "jobset":
            group, slices = spec.trainer_group, spec.trainer.slices
        elif on_tpu and spec.service is not None and pod["serviceAccountName"] == spec.service_engine_name:
            group, slices = spec.service_group, 1
        else:
            group, slices = None, 1
        needs_host = bool(group) and (group.shape.multi_host or slices > 1) and not spec.dranet_networks_for(group)
        assert pod.get("hostNetwork", False) is needs_host, pod["serviceAccountName"]
        assert not pod.get("hostPID") and not pod.get("hostIPC")
    for obj in kubernetes_objects(plan):
        if obj["kind"] == "Secret":
            assert set(obj.get("stringData", {}).values()) <= {SECRET_MASK}  # Pulumi secrets all the way
