"""Registry: the Artifact Registry repository the trainer image lives in, readable by the nodes."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec


@dataclass(frozen=True)
class RegistryArgs:
    spec: EnvironmentSpec
    node_service_account: pulumi.Input[str]


class Registry(pulumi.ComponentResource):
    repository: gcp.artifactregistry.Repository

    def __init__(self, name: str, args: RegistryArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:Registry", name, None, opts)
        spec = args.spec
        child = pulumi.ResourceOptions(parent=self)
        self.repository = gcp.artifactregistry.Repository(
            f"{name}-images", project=spec.project, location=spec.region, repository_id=spec.registry_id,
            format="DOCKER", description=f"gke-tpu-rl images for {spec.env}", labels=spec.resource_labels(),
            opts=child)
        gcp.artifactregistry.RepositoryIamMember(
            f"{name}-nodes-read", project=spec.project, location=spec.region,
            repository=self.repository.repository_id, role="roles/artifactregistry.reader",
            member=pulumi.Output.concat("serviceAccount:", args.node_service_account), opts=child)
        self.register_outputs({"repository": self.repository.id})
