"""Cluster: a private GKE Standard cluster with dataplane v2, multi-networking and workload identity."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec
from envspec.sections.cluster import gke_version_tuple
from infra.components.network import POD_RANGE, SERVICE_RANGE
from workloads.labels import SYSTEM_POOL

OAUTH_SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]


@dataclass(frozen=True)
class ClusterArgs:
    spec: EnvironmentSpec
    network: pulumi.Input[str]
    subnetwork: pulumi.Input[str]
    node_service_account: pulumi.Input[str]


def kubeconfig(name: str, endpoint: pulumi.Input[str], ca: pulumi.Input[str] | None) -> pulumi.Output[str]:
    """A kubeconfig for the gke-gcloud-auth-plugin, so no long-lived credentials land in the config or the state.

    ca None: the DNS-based endpoint, which serves a publicly trusted certificate, so the config carries no CA
    (as `gcloud container clusters get-credentials --dns-endpoint` writes it)."""
    def render(v: list[str]) -> str:
        ca_line = f"\n    certificate-authority-data: {v[1]}" if len(v) > 1 else ""
        return f"""apiVersion: v1
kind: Config
clusters:
- name: {name}
  cluster:
    server: https://{v[0]}{ca_line}
contexts:
- name: {name}
  context: {{cluster: {name}, user: {name}}}
current-context: {name}
users:
- name: {name}
  user:
    exec:
      apiVersion: client.authentication.k8s.io/v1beta1
      command: gke-gcloud-auth-plugin
      provideClusterInfo: true
      interactiveMode: Never
"""
    return pulumi.Output.all(*([endpoint] if ca is None else [endpoint, ca])).apply(render)


class Cluster(pulumi.ComponentResource):
    cluster: gcp.container.Cluster
    system_pool: gcp.container.NodePool
    version: pulumi.Output[str | None]  # minMasterVersion: resolved from the channel and versionPrefix
    api_endpoint: pulumi.Output[str]  # the host the Kubernetes provider talks to
    kubeconfig: pulumi.Output[str]

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:Cluster", name, None, opts)
        spec, c = args.spec, args.spec.cluster
        child = pulumi.ResourceOptions(parent=self)

        addons = gcp.container.ClusterAddonsConfigArgs(
            gcs_fuse_csi_driver_config=gcp.container.ClusterAddonsConfigGcsFuseCsiDriverConfigArgs(enabled=True),
            ray_operator_configs=[gcp.container.ClusterAddonsConfigRayOperatorConfigArgs(enabled=True)]
            if spec.ray_operator_enabled else None,
        )
        # The DNS-based endpoint lets a hosted CI runner reach the API server with IAM
        # (container.clusters.connect) instead of an IP allow-list; the IP endpoint keeps its authorized networks.
        endpoints = gcp.container.ClusterControlPlaneEndpointsConfigArgs(
            dns_endpoint_config=gcp.container.ClusterControlPlaneEndpointsConfigDnsEndpointConfigArgs(
                allow_external_traffic=True)) if c.control_plane_endpoint == "dns" else None
        authorized = gcp.container.ClusterMasterAuthorizedNetworksConfigArgs(
            cidr_blocks=[gcp.container.ClusterMasterAuthorizedNetworksConfigCidrBlockArgs(cidr_block=b)
                         for b in c.master_authorized_cidrs]) if c.master_authorized_cidrs else None

        # Like Cluster Toolkit's gke-cluster: the channel's newest version under the prefix (or the channel default),
        # looked up at deploy time, and not a pinned patch; later lookups do not move it (the channel upgrades).
        versions = gcp.container.get_engine_versions_output(
            project=spec.project, location=spec.zone, version_prefix=c.version_prefix)
        self.version = versions.apply(lambda v: choose_version(
            v.release_channel_default_version, v.release_channel_latest_version, c.release_channel,
            c.version_prefix, spec.gke_version_floor))
        self.cluster = gcp.container.Cluster(
            spec.cluster_name,
            name=spec.cluster_name,
            project=spec.project,
            location=spec.zone,
            network=args.network,
            subnetwork=args.subnetwork,
            # Node pools are managed separately; the bootstrap pool is removed right away.
            remove_default_node_pool=True,
            initial_node_count=1,
            node_config=gcp.container.ClusterNodeConfigArgs(service_account=args.node_service_account,
                                                            oauth_scopes=OAUTH_SCOPES),
            release_channel=gcp.container.ClusterReleaseChannelArgs(channel=c.release_channel),
            min_master_version=self.version,
            datapath_provider="ADVANCED_DATAPATH",
            enable_multi_networking=True,
            ip_allocation_policy=gcp.container.ClusterIpAllocationPolicyArgs(
                cluster_secondary_range_name=POD_RANGE, services_secondary_range_name=SERVICE_RANGE),
            private_cluster_config=gcp.container.ClusterPrivateClusterConfigArgs(
                enable_private_nodes=True, enable_private_endpoint=False,
                master_ipv4_cidr_block=spec.network.master_cidr),
            master_authorized_networks_config=authorized,
            control_plane_endpoints_config=endpoints,
            workload_identity_config=gcp.container.ClusterWorkloadIdentityConfigArgs(
                workload_pool=f"{spec.project}.svc.id.goog"),
            addons_config=addons,
            resource_labels=spec.resource_labels(),
            deletion_protection=c.deletion_protection,
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["minMasterVersion"]),
        )
        # Runs the JobSet and Kueue controllers and their webhooks, away from the TPU hosts.
        self.system_pool = gcp.container.NodePool(
            f"{name}-system",
            project=spec.project,
            location=spec.zone,
            cluster=self.cluster.name,
            node_count=c.system_pool.nodes,
            node_config=gcp.container.NodePoolNodeConfigArgs(
                machine_type=c.system_pool.machine_type,
                service_account=args.node_service_account,
                oauth_scopes=OAUTH_SCOPES,
                workload_metadata_config=gcp.container.NodePoolNodeConfigWorkloadMetadataConfigArgs(
                    mode="GKE_METADATA"),
                labels=dict(SYSTEM_POOL),
                resource_labels=spec.resource_labels(),
            ),
            management=gcp.container.NodePoolManagementArgs(auto_repair=True, auto_upgrade=True),
            opts=child,
        )
        if c.control_plane_endpoint == "dns":
            self.api_endpoint = self.cluster.control_plane_endpoints_config.apply(_dns_endpoint)
            config = kubeconfig(spec.cluster_name, self.api_endpoint, None)
        else:
            self.api_endpoint = self.cluster.endpoint
            config = kubeconfig(spec.cluster_name, self.api_endpoint, self.cluster.master_auth.cluster_ca_certificate)
        self.kubeconfig = pulumi.Output.secret(config)
        self.register_outputs({"name": self.cluster.name, "endpoint": self.api_endpoint})


def choose_version(defaults: Mapping[str, str] | None, latest: Mapping[str, str] | None, channel: str,
                   prefix: str | None, floor: str | None) -> str | None:
    """The cluster's starting version: with a prefix, the channel's newest under it; else None (GKE's channel
    default). Fails the deploy, naming the setting, when it is older than the environment's floor."""
    chosen = (latest if prefix else defaults or {}) or {}
    version = chosen.get(channel)
    if prefix and not version:
        raise ValueError(f"gke-tpu-rl:cluster.versionPrefix: the {channel} channel offers no version starting with "
                         f"{prefix!r} here; channel versions: {latest or {}}")
    if floor and version and gke_version_tuple(version) < gke_version_tuple(floor):
        where = f"versionPrefix {prefix!r}" if prefix else "default"
        raise ValueError(f"gke-tpu-rl:cluster: the {channel} channel's {where} version {version} is older than "
                         f"{floor}, which managed DRANET needs; set cluster.versionPrefix to '1.34.' or later")
    return version if prefix else None


def _dns_endpoint(config: gcp.container.outputs.ClusterControlPlaneEndpointsConfig | None) -> str:
    endpoint = config.dns_endpoint_config.endpoint if config and config.dns_endpoint_config else None
    if not endpoint:
        raise ValueError("the cluster reports no DNS endpoint although controlPlaneEndpoint is 'dns'")
    return endpoint
