"""Identities: the node service account (instead of the over-privileged default) and workload-identity principals."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec

# What a GKE node needs and nothing more: write logs and metrics.
NODE_ROLES = ("roles/logging.logWriter", "roles/monitoring.metricWriter", "roles/monitoring.viewer",
              "roles/stackdriver.resourceMetadata.writer")


def workload_principal(project_number: pulumi.Input[str], project: str, namespace: str,
                       ksa: str) -> pulumi.Output[str]:
    """The IAM principal of a Kubernetes service account under Workload Identity Federation for GKE. A grant to it
    must be created with after_pool."""
    return pulumi.Output.concat(
        "principal://iam.googleapis.com/projects/", project_number, "/locations/global/workloadIdentityPools/",
        project, ".svc.id.goog/subject/ns/", namespace, "/sa/", ksa)


def after_pool(parent: pulumi.Resource, cluster: pulumi.Resource) -> pulumi.ResourceOptions:
    """Options for an IAM grant whose member names the project's workload identity pool (<project>.svc.id.goog: a
    `principal://...` of workload_principal, or `serviceAccount:<pool>[ns/ksa]`). The pool comes into being with the
    first cluster that has workload identity on, and IAM refuses such a member until then ("Error 400: Identity Pool
    does not exist", googleforgames/global-multiplayer-demo#39; terraform-google-kubernetes-engine#916). A grant
    takes seconds and the cluster minutes, so without this dependency a first `pulumi up` in a new project loses the
    race (review 2026-11-28 #4). depends_on is explicit on both backends: the Terraform synth copies it
    (infra/terraform/document.py)."""
    return pulumi.ResourceOptions(parent=parent, depends_on=[cluster])


@dataclass(frozen=True)
class NodeIdentityArgs:
    spec: EnvironmentSpec


class NodeIdentity(pulumi.ComponentResource):
    account: gcp.serviceaccount.Account

    def __init__(self, name: str, args: NodeIdentityArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:NodeIdentity", name, None, opts)
        spec = args.spec
        child = pulumi.ResourceOptions(parent=self)
        self.account = gcp.serviceaccount.Account(
            f"{name}-sa", project=spec.project, account_id=f"{spec.cluster_name}-nodes",
            display_name=f"GKE nodes of {spec.cluster_name}", opts=child)
        member = pulumi.Output.concat("serviceAccount:", self.account.email)
        for role in NODE_ROLES:
            gcp.projects.IAMMember(f"{name}-{role.split('/')[1]}", project=spec.project, role=role,
                                   member=member, opts=child)
        self.register_outputs({"email": self.account.email})
