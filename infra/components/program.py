"""The Pulumi program: one environment, read from the stack config, as a list of what exists."""

from __future__ import annotations

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s

from envspec.config import NAMESPACE, EnvironmentSpec
from infra.base.stack_config import config_errors_for_pulumi, load_spec
from infra.checks import code_refs, grace, placement, system_pool
from infra.components import service
from infra.components.cluster import Cluster, ClusterArgs
from infra.components.controllers import Controllers, ControllersArgs
from infra.components.database import ServiceDatabase, ServiceDatabaseArgs
from infra.components.iam import NodeIdentity, NodeIdentityArgs
from infra.components.image import TrainerImage, TrainerImageArgs
from infra.components.network import Network, NetworkArgs
from infra.components.queues import Queues, QueuesArgs
from infra.components.registry import Registry, RegistryArgs
from infra.components.slices import TpuSlices, TpuSlicesArgs
from infra.components.storage import Storage, StorageArgs
from infra.components.trainer_job import TrainerJob, TrainerJobArgs, stage_targets


def build(spec: EnvironmentSpec, hf_token: pulumi.Output[str] | None) -> None:
    env = spec.env
    network = Network(f"{env}-network", NetworkArgs(spec))
    nodes = NodeIdentity(f"{env}-nodes", NodeIdentityArgs(spec))
    cluster = Cluster(f"{env}-cluster", ClusterArgs(
        spec, network=network.vpc.id, subnetwork=network.subnet.id,
        node_service_account=nodes.account.email))
    slices = TpuSlices(f"{env}-tpu", TpuSlicesArgs(
        spec, cluster=cluster.cluster.name, node_service_account=nodes.account.email,
        dranet_networks=[v.name for v in network.dranet_vpcs],
        dranet_subnets=[s.name for s in network.dranet_subnets]))
    project_number = gcp.organizations.get_project_output(project_id=spec.project).number
    storage = Storage(f"{env}-storage", StorageArgs(spec, project_number=project_number, cluster=cluster.cluster))
    registry = Registry(f"{env}-registry", RegistryArgs(spec, node_service_account=nodes.account.email))
    image: pulumi.Input[str] = spec.trainer.image or TrainerImage(
        f"{env}-image", TrainerImageArgs(spec, repository=registry.repository)).ref

    # The cluster's id names the provider's cluster: without it pulumi-kubernetes replaces the provider, and with it
    # every Helm release, queue and job, whenever the kubeconfig's server changes (IP endpoint to DNS endpoint), and
    # their re-creates fail with AlreadyExists (provider/pkg/provider/provider.go DiffConfig). A new cluster has a new
    # id, unknown in preview, which still replaces them, as it must.
    provider = k8s.Provider(f"{env}-gke", kubeconfig=cluster.kubeconfig, enable_server_side_apply=True,
                            cluster_identifier=cluster.cluster.id,
                            opts=pulumi.ResourceOptions(depends_on=[cluster.system_pool]))
    on_cluster = pulumi.ResourceOptions(provider=provider)
    controllers = Controllers(f"{env}-controllers", ControllersArgs(spec), on_cluster)
    queues = Queues(f"{env}-queues", QueuesArgs(spec),
                    pulumi.ResourceOptions(provider=provider, depends_on=[controllers]))
    if spec.trainer.enabled:
        TrainerJob(f"{env}-trainer", TrainerJobArgs(spec, image=image, hf_token=hf_token), pulumi.ResourceOptions(
            provider=provider, depends_on=[queues, storage, registry, slices]))
    if spec.service is not None:
        # The store, and the Google service accounts the API and the engine act as (with their bucket grant).
        database = ServiceDatabase(f"{env}-database", ServiceDatabaseArgs(
            spec, network=network.vpc.id, project_number=project_number, cluster=cluster.cluster,
            bucket=storage.bucket.name,
            state_bucket=storage.state_bucket.name if storage.state_bucket is not None else None))
        svc = service.Service(f"{env}-service", service.ServiceArgs(
            spec, image=image, hf_token=hf_token, instance=database.connection_name, database=database.database,
            users=database.users, accounts=database.accounts), pulumi.ResourceOptions(
            provider=provider, depends_on=[queues, storage, registry, slices, database]))
        pulumi.export("serviceApi", svc.api_address)
        pulumi.export("servicePortForward", svc.port_forward)

    pulumi.export("clusterName", cluster.cluster.name)
    pulumi.export("clusterEndpoint", cluster.api_endpoint)
    pulumi.export("kubeconfig", cluster.kubeconfig)
    pulumi.export("checkpointBucket", storage.url)
    pulumi.export("trainerImage", image)
    pulumi.export("clusterQueue", queues.cluster_queue_name)
    pulumi.export("localQueue", queues.local_queue_name)
    pulumi.export("chipsPerSliceGroup", {g.name: g.shape.chips * g.count for g in spec.slices})
    pulumi.export("nodePools", list(slices.pools))


def main() -> None:
    # A config problem found anywhere below reaches `pulumi up` as a RunError: its message, no traceback.
    with config_errors_for_pulumi():
        # Validate everything before the first resource is registered.
        spec = load_spec()
        system_pool.check(spec)  # the pods pinned to the system pool fit on its nodes (GKE's allocatable, packed)
        grace.check(spec)  # the trainer's pods have time to save a checkpoint on SIGTERM
        placement.check(spec)  # a split placement is one the trainer runs on these slices (issue 43)
        stage_targets(spec)  # what trainer.stage fetches has a place on the bucket the trainer config reads
        code_refs.check(spec)  # the trainer config's own tasks and rewards are in trainer.code
        service.check(spec)  # the service's engine config loads with the arguments its pods get
        build(spec, pulumi.Config(NAMESPACE).get_secret("hfToken"))
