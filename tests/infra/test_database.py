"""The service's Cloud SQL store (infra/components/database.py) under Pulumi mocks: private IP only, IAM database
authentication and no password anywhere, backups with point-in-time recovery, deletion protection as the spec says, and
the grants of the API's and the engine's Google service accounts (each narrowed to the instance; the bucket for the
engine alone). The component runs alone in a program of its own, through the plan's harness
(infra.offline.mockrun.run_stack, which sets pulumi.runtime's mocks and records every registration with its options)."""

from __future__ import annotations

import copy
from typing import Any, cast

import pulumi
import pulumi_gcp as gcp
import pytest

from envspec.config import parse_spec
from infra.base.stack_config import load_spec
from infra.components import database
from infra.offline.mockrun import PlanResult, run_stack
from tests.infra.conftest import stack_config
from trainer.base.config import bundled_configs

INSTANCE = "gcp:sql/databaseInstance:DatabaseInstance"
USER = "gcp:sql/user:User"
PROJECT_MEMBER = "gcp:projects/iAMMember:IAMMember"
SA_MEMBER = "gcp:serviceaccount/iAMMember:IAMMember"
BUCKET_MEMBER = "gcp:storage/bucketIAMMember:BucketIAMMember"
ACCOUNT = "gcp:serviceaccount/account:Account"
VPC_ID = "vpc-id"  # what the mocks give the stand-in VPC as its id
CLUSTER_NAME = "cluster"  # the stand-in cluster, whose creation makes the workload identity pool


def _program() -> None:
    spec = load_spec()
    vpc = gcp.compute.Network("vpc", project=spec.project, auto_create_subnetworks=False)
    cluster = gcp.container.Cluster(CLUSTER_NAME, project=spec.project, location=spec.zone)
    db = database.ServiceDatabase(f"{spec.env}-database", database.ServiceDatabaseArgs(
        spec, network=vpc.id, project_number="123456789012", cluster=cluster))
    pulumi.export("connectionName", db.connection_name)
    pulumi.export("database", db.database)
    pulumi.export("accounts", db.accounts)
    pulumi.export("users", db.users)


def _tinker(**service: Any) -> dict[str, Any]:
    config = copy.deepcopy(stack_config("tinker"))
    for key, value in service.items():
        if key == "storage":
            config["gke-tpu-rl:storage"] = {**config["gke-tpu-rl:storage"], **value}
        else:
            config["gke-tpu-rl:service"].setdefault("database", {})[key] = value
    return config


def _plan(config: dict[str, Any] | None = None) -> PlanResult:
    return run_stack("tinker", config or stack_config("tinker"), program=_program)


@pytest.fixture(scope="module")
def plan() -> PlanResult:
    return _plan()


def _instance(plan: PlanResult) -> dict[str, Any]:
    [instance] = plan.of_type(INSTANCE)
    return instance.inputs


def _walk(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _walk(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _walk(v, f"{path}[{i}]")]
    return [(path, value)]


def test_the_instance_has_a_private_ip_only(plan: PlanResult) -> None:
    inputs = _instance(plan)
    ip = inputs["settings"]["ipConfiguration"]
    assert ip["ipv4Enabled"] is False and ip["privateNetwork"] == VPC_ID
    assert ip["sslMode"] == "ENCRYPTED_ONLY" and not ip.get("authorizedNetworks")
    settings = inputs["settings"]
    assert settings["connectorEnforcement"] == "REQUIRED" and settings["dataApiAccess"] == "DISALLOW_DATA_API"
    # Its private IP comes from the private services access range reserved in the environment's VPC.
    address = plan.get("gcp:compute/globalAddress:GlobalAddress", "tinker-database-psa-range").inputs
    assert (address["purpose"], address["addressType"], address["network"]) == ("VPC_PEERING", "INTERNAL", VPC_ID)
    assert (address["address"], address["prefixLength"]) == ("10.24.0.0", 20)  # service.database.privateServiceCidr
    assert ip["allocatedIpRange"] == address["name"] == "rl-tinker-tinker-psa"
    connection = plan.get("gcp:servicenetworking/connection:Connection", "tinker-database-psa")
    assert connection.inputs["service"] == "servicenetworking.googleapis.com"
    assert connection.inputs["reservedPeeringRanges"] == [address["name"]]
    assert connection.inputs["deletionPolicy"] == "REMOVE_PEERING"
    # Created only once the peering exists.
    [instance] = plan.of_type(INSTANCE)
    assert connection.urn in instance.options["dependsOn"]


def test_the_instance_is_enterprise_postgres_as_the_spec_says(plan: PlanResult) -> None:
    inputs = _instance(plan)
    spec = plan.spec
    assert inputs["name"] == spec.sql_instance_name == "rl-tinker-tinker" and inputs["region"] == "us-central1"
    assert inputs["databaseVersion"] == "POSTGRES_17"
    settings = inputs["settings"]
    assert (settings["edition"], settings["tier"], settings["availabilityType"]) == ("ENTERPRISE", "db-custom-1-3840",
                                                                                     "ZONAL")
    assert (settings["diskType"], settings["diskSize"], settings["diskAutoresize"]) == ("PD_SSD", 10, True)
    assert settings["locationPreference"]["zone"] == "us-central1-b"
    assert settings["userLabels"] == spec.resource_labels() == {"app": "gke-tpu-rl", "env": "tinker", "team": "rl"}
    assert settings["maintenanceWindow"] == {"day": 7, "hour": 4, "updateTrack": "stable"}
    [db] = plan.of_type("gcp:sql/database:Database")
    assert db.inputs["name"] == "tinker" and db.inputs["instance"] == "rl-tinker-tinker"
    assert plan.outputs["database"] == "tinker"
    assert plan.outputs["connectionName"] == "acme-rl-tinker:us-central1:rl-tinker-tinker"


def test_iam_database_authentication_and_no_password_anywhere(plan: PlanResult) -> None:
    flags = _instance(plan)["settings"]["databaseFlags"]
    assert {"name": "cloudsql.iam_authentication", "value": "on"} in flags
    for r in plan.resources:
        for path, _ in _walk(r.inputs):
            assert "password" not in path.lower(), (r.name, path)
    users = plan.of_type(USER)
    assert len(users) == 2 and all(u.inputs["type"] == "CLOUD_IAM_SERVICE_ACCOUNT" for u in users)


def test_the_users_are_the_service_accounts_of_the_api_and_the_engine(plan: PlanResult) -> None:
    accounts = {a.name: a.inputs["accountId"] for a in plan.of_type(ACCOUNT)}
    assert accounts == {"tinker-database-api": "tinker-tinker-api", "tinker-database-engine": "tinker-tinker-eng"}
    assert plan.outputs["accounts"] == {"api": "tinker-tinker-api@acme-rl-tinker.iam.gserviceaccount.com",
                                        "engine": "tinker-tinker-eng@acme-rl-tinker.iam.gserviceaccount.com"}
    # PostgreSQL IAM users of service accounts: the e-mail without ".gserviceaccount.com".
    assert plan.outputs["users"] == {"api": "tinker-tinker-api@acme-rl-tinker.iam",
                                     "engine": "tinker-tinker-eng@acme-rl-tinker.iam"}
    users = {u.name: u.inputs for u in plan.of_type(USER)}
    assert {n: u["name"] for n, u in users.items()} == {
        "tinker-database-api-db-user": "tinker-tinker-api@acme-rl-tinker.iam",
        "tinker-database-engine-db-user": "tinker-tinker-eng@acme-rl-tinker.iam"}
    for u in users.values():
        assert u["instance"] == "rl-tinker-tinker" and u["databaseRoles"] == [database.OWNER_ROLE]
        assert u["deletionPolicy"] == "ABANDON"


def test_each_account_is_bound_to_its_kubernetes_service_account(plan: PlanResult) -> None:
    bindings = {m.name: m.inputs for m in plan.of_type(SA_MEMBER)}
    # The account's id (projects/P/serviceAccounts/EMAIL, what service_account_id must match), a reference on both
    # backends; its `name` under the mocks is the Pulumi resource name (review 2026-11-28 #6).
    ids = {a.name: a.id for a in plan.of_type(ACCOUNT)}
    assert bindings == {
        "tinker-database-api-workload-identity": {
            "member": "serviceAccount:acme-rl-tinker.svc.id.goog[rl/tinker-api]",
            "role": "roles/iam.workloadIdentityUser", "serviceAccountId": ids["tinker-database-api"]},
        "tinker-database-engine-workload-identity": {
            "member": "serviceAccount:acme-rl-tinker.svc.id.goog[rl/tinker-engine]",
            "role": "roles/iam.workloadIdentityUser", "serviceAccountId": ids["tinker-database-engine"]}}
    assert None not in ids.values()
    assert plan.spec.queues.namespace == "rl"
    assert (plan.spec.service_api_name, plan.spec.service_engine_name) == ("tinker-api", "tinker-engine")


def test_grants_naming_the_workload_pool_wait_for_the_cluster(plan: PlanResult) -> None:
    """Review 2026-11-28 #4: the pool <project>.svc.id.goog exists once the cluster does; the bindings and the KSA's
    bucket grants name it, so they depend on the cluster. The GSA's own grants need no pool."""
    [cluster] = plan.of_type("gcp:container/cluster:Cluster")
    for r in [*plan.of_type(SA_MEMBER), *plan.of_type(BUCKET_MEMBER), *plan.of_type(PROJECT_MEMBER)]:
        names_pool = "svc.id.goog" in r.inputs["member"]
        assert (cluster.urn in r.options.get("dependsOn", [])) is names_pool, r.name


def test_the_connector_roles_are_granted_on_the_one_instance_only(plan: PlanResult) -> None:
    grants = sorted((m.inputs["member"], m.inputs["role"]) for m in plan.of_type(PROJECT_MEMBER))
    api = "serviceAccount:tinker-tinker-api@acme-rl-tinker.iam.gserviceaccount.com"
    engine = "serviceAccount:tinker-tinker-eng@acme-rl-tinker.iam.gserviceaccount.com"
    assert grants == [(api, "roles/cloudsql.client"), (api, "roles/cloudsql.instanceUser"),
                      (engine, "roles/cloudsql.client"), (engine, "roles/cloudsql.instanceUser")]
    for m in plan.of_type(PROJECT_MEMBER):
        assert m.inputs["project"] == "acme-rl-tinker"
        assert m.inputs["condition"]["expression"] == (
            "resource.name == 'projects/acme-rl-tinker/instances/rl-tinker-tinker' && "
            "resource.type == 'sqladmin.googleapis.com/Instance'")
        assert m.inputs["condition"]["title"]


def test_the_engine_writes_both_buckets_and_the_api_only_reads_the_checkpoints(plan: PlanResult) -> None:
    """The checkpoint bucket (the users' checkpoints) and the state bucket (each model's snapshot) for the engine; the
    checkpoint bucket read-only for the API, whose pods serve external weights downloads from it (their read-only
    GCS FUSE mount, workloads/service.py api_checkpoint_mount)."""
    engine = "serviceAccount:tinker-tinker-eng@acme-rl-tinker.iam.gserviceaccount.com"
    api = "serviceAccount:tinker-tinker-api@acme-rl-tinker.iam.gserviceaccount.com"
    # tinker's engine runs on the host network (4 hosts, no DRANET): GCS FUSE's sidecar uses its KSA's own token.
    # The API runs on the pod network, where the driver acts as the GSA its KSA names: no KSA principal for it.
    ksa = ("principal://iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/"
           "acme-rl-tinker.svc.id.goog/subject/ns/rl/sa/tinker-engine")
    assert sorted((g.inputs["bucket"], g.inputs["role"], g.inputs["member"]) for g in plan.of_type(BUCKET_MEMBER)) == [
        ("acme-rl-tinker-tinker-checkpoints", "roles/storage.objectUser", ksa),
        ("acme-rl-tinker-tinker-checkpoints", "roles/storage.objectUser", engine),
        ("acme-rl-tinker-tinker-checkpoints", "roles/storage.objectViewer", api),
        ("acme-rl-tinker-tinker-tinker-state", "roles/storage.objectUser", ksa),
        ("acme-rl-tinker-tinker-tinker-state", "roles/storage.objectUser", engine)]


def test_the_api_deployment_waits_for_its_bucket_grant(plans: dict[str, PlanResult]) -> None:
    """The API pods' mount needs the viewer role when they start (the CSI driver checks the bucket before it mounts,
    gcs-fuse-csi-driver pkg/csi_driver/node.go NodePublishVolume), and a rollout adding the mount would otherwise
    stall at the first new pod: the Deployment depends on the grant (through the database component, whose
    children pulumi's depends_on expands to), as the engine's JobSet does on the engine's grants."""
    plan = plans["tinker"]  # the whole stack
    [grant] = [g for g in plan.of_type(BUCKET_MEMBER) if g.inputs["role"] == "roles/storage.objectViewer"]
    assert grant.name == "tinker-database-api-object-viewer"
    [engine_grant] = [g for g in plan.of_type(BUCKET_MEMBER) if g.name == "tinker-database-engine-object-user"]
    [deployment] = plan.of_type("kubernetes:apps/v1:Deployment")
    [jobset] = plan.of_type("kubernetes:jobset.x-k8s.io/v1alpha2:JobSet")
    for workload, needs in ((deployment, grant), (jobset, engine_grant)):
        assert needs.urn in workload.options.get("dependsOn", []), workload.name


def test_backups_and_point_in_time_recovery(plan: PlanResult) -> None:
    backup = _instance(plan)["settings"]["backupConfiguration"]
    assert backup["enabled"] is True and backup["pointInTimeRecoveryEnabled"] is True
    assert backup["backupRetentionSettings"] == {"retainedBackups": 7, "retentionUnit": "COUNT"}
    assert backup["transactionLogRetentionDays"] == 7 and backup["startTime"]
    # More days of backups than Enterprise edition keeps transaction logs: PITR stays at its 7-day maximum.
    month = _instance(_plan(_tinker(backupRetentionDays=30)))["settings"]["backupConfiguration"]
    assert month["backupRetentionSettings"]["retainedBackups"] == 30 and month["transactionLogRetentionDays"] == 7
    short = _instance(_plan(_tinker(backupRetentionDays=3)))["settings"]["backupConfiguration"]
    assert short["backupRetentionSettings"]["retainedBackups"] == 3 and short["transactionLogRetentionDays"] == 3


KEPT = ("gcp:sql/databaseInstance:DatabaseInstance", "gcp:sql/database:Database",
        "gcp:compute/globalAddress:GlobalAddress", "gcp:servicenetworking/connection:Connection")


@pytest.mark.parametrize(("change", "protected"), [
    ({}, True),  # tinker: storage.protect true, database.protect unset
    ({"protect": False}, False),
    ({"storage": {"protect": False}}, False),  # unset follows storage.protect
    ({"storage": {"protect": False}, "protect": True}, True),
], ids=["storage-protect", "database-off", "follows-storage-off", "database-on"])
def test_deletion_protection_follows_the_spec(change: dict[str, Any], protected: bool) -> None:
    plan = _plan(_tinker(**change))
    assert plan.spec.sql_protected is protected
    inputs = _instance(plan)
    assert inputs["deletionProtection"] is protected
    assert inputs["settings"]["deletionProtectionEnabled"] is protected
    for type_ in KEPT:
        [r] = plan.of_type(type_)
        assert bool(r.options.get("retainOnDelete")) is protected, type_


def test_a_regional_instance_and_another_version() -> None:
    inputs = _instance(_plan(_tinker(availability="regional", version="POSTGRES_16", tier="db-custom-2-7680",
                                     diskGb=50)))
    settings = inputs["settings"]
    assert inputs["databaseVersion"] == "POSTGRES_16"
    assert (settings["availabilityType"], settings["tier"], settings["diskSize"]) == ("REGIONAL", "db-custom-2-7680",
                                                                                      50)


def test_an_environment_without_a_service_has_no_database() -> None:
    config = copy.deepcopy(stack_config("tinker"))
    del config["gke-tpu-rl:service"]
    spec = parse_spec({k.removeprefix("gke-tpu-rl:"): v for k, v in config.items()}, "tinker", bundled_configs())
    with pytest.raises(ValueError, match="no service section"):
        database.ServiceDatabase("x", database.ServiceDatabaseArgs(spec, network="vpc", project_number="1",
                                                                   cluster=cast(pulumi.Resource, None)))


def test_helpers() -> None:
    assert database.iam_user_name("a-b@p.iam.gserviceaccount.com") == "a-b@p.iam"
    assert database.iam_user_name("someone@example.com") == "someone@example.com"
    assert database.instance_condition("p", "i") == (
        "resource.name == 'projects/p/instances/i' && resource.type == 'sqladmin.googleapis.com/Instance'")
