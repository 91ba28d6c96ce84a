"""Review 2026-11-28 #4: every IAM grant whose member names the project's workload identity pool
(`serviceAccount:<project>.svc.id.goog[ns/ksa]`, `principal://.../workloadIdentityPools/<project>.svc.id.goog/...`)
waits for the cluster, whose creation creates the pool; IAM refuses the member until it exists ("Error 400: Identity
Pool does not exist"), and a first `pulumi up` / `terraform apply` in a new project would otherwise race it. Checked
on both backends: the Pulumi program's registrations and the Terraform synth's depends_on."""

from __future__ import annotations

import json
from typing import Any

import pytest

from infra.offline.mockrun import PlanResult
from infra.terraform.document import synthesize
from tests.infra.conftest import ENVIRONMENTS, stack_config

CLUSTER = "gcp:container/cluster:Cluster"
IAM_MEMBER_TYPES = ("gcp:serviceaccount/iAMMember:IAMMember", "gcp:storage/bucketIAMMember:BucketIAMMember",
                    "gcp:projects/iAMMember:IAMMember")


def _names_the_pool(inputs: dict[str, Any], project: str) -> bool:
    return f"{project}.svc.id.goog" in json.dumps(inputs.get("member", ""))


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_grants_to_the_workload_pool_wait_for_the_cluster(plans: dict[str, PlanResult], env: str) -> None:
    plan = plans[env]
    [cluster] = plan.of_type(CLUSTER)
    grants = [r for t in IAM_MEMBER_TYPES for r in plan.of_type(t) if _names_the_pool(r.inputs, plan.spec.project)]
    # Every shipped environment has at least one: the trainer's KSA on the bucket, or the service's bindings.
    assert grants, env
    for r in grants:
        assert cluster.urn in r.options.get("dependsOn", []), f"{env}: {r.name} does not wait for the cluster"


def test_the_service_bindings_wait_for_the_cluster_and_the_rest_does_not_need_to(plans: dict[str, PlanResult]) -> None:
    plan = plans["tinker"]
    [cluster] = plan.of_type(CLUSTER)
    waits = {r.name for t in IAM_MEMBER_TYPES for r in plan.of_type(t) if cluster.urn in r.options.get("dependsOn", [])}
    assert waits == {"tinker-database-api-workload-identity", "tinker-database-engine-workload-identity",
                     "tinker-database-engine-ksa-object-user", "tinker-database-engine-ksa-state-user"}


@pytest.mark.parametrize("env", ["staging", "tinker"])
def test_the_terraform_stack_orders_them_after_the_cluster_too(env: str) -> None:
    document = synthesize(env, stack_config(env)).document
    resources = document["stacks"]["gcp"]["resources"]
    [cluster] = [e for e in resources if e["type"] == "google_container_cluster"]
    address = f"google_container_cluster.{cluster['name']}"
    grants = [e for e in resources if e["type"].endswith("_iam_member")
              and _names_the_pool(e["args"], stack_config(env)["gke-tpu-rl:project"])]
    assert grants
    for e in grants:
        assert address in e.get("depends_on", []), f"{env}: {e['type']}.{e['name']}"
