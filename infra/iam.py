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
    """The IAM principal of a Kubernetes service account under Workload Identity Federation for GKE."""
    return pulumi.Output.concat(
        "principal://iam.googleapis.com/projects/", project_number, "/locations/global/workloadIdentityPools/",
        project, ".svc.id.goog/subject/ns/", namespace, "/sa/", ksa)


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
