"""TPU slices: one node pool per slice, sized and placed from the TPU catalog."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec
from envspec.sections.slices import SliceGroupSpec
from infra.components.cluster import OAUTH_SCOPES
from workloads.labels import DRANET_NODE

RESERVATION_KEY = "compute.googleapis.com/reservation-name"


@dataclass(frozen=True)
class TpuSlicesArgs:
    spec: EnvironmentSpec
    cluster: pulumi.Input[str]
    node_service_account: pulumi.Input[str]
    dranet_networks: list[pulumi.Input[str]]
    dranet_subnets: list[pulumi.Input[str]]


def _capacity(group: SliceGroupSpec) -> dict[str, dict[str, Any]]:
    """Node-pool arguments that express where the capacity comes from."""
    if group.capacity == "spot":
        return {"node": {"spot": True}}
    if group.capacity == "reservation":
        assert group.reservation is not None  # envspec requires one with capacity: reservation
        return {"node": {"reservation_affinity": gcp.container.NodePoolNodeConfigReservationAffinityArgs(
            consume_reservation_type="SPECIFIC_RESERVATION", key=RESERVATION_KEY, values=[group.reservation])}}
    if group.capacity == "flex-start":
        # Queued provisioning: nodes appear when Kueue's ProvisioningRequest is granted, all hosts at once.
        hosts = group.shape.hosts
        return {
            "node": {"flex_start": True, "reservation_affinity":
                     gcp.container.NodePoolNodeConfigReservationAffinityArgs(consume_reservation_type="NO_RESERVATION")},
            "pool": {
                "queued_provisioning": gcp.container.NodePoolQueuedProvisioningArgs(enabled=True),
                "autoscaling": gcp.container.NodePoolAutoscalingArgs(
                    total_min_node_count=0, total_max_node_count=hosts, location_policy="ANY"),
                "initial_node_count": 0,
            },
        }
    return {}


class TpuSlices(pulumi.ComponentResource):
    pools: dict[str, gcp.container.NodePool]

    def __init__(self, name: str, args: TpuSlicesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:TpuSlices", name, None, opts)
        spec = args.spec
        child = pulumi.ResourceOptions(parent=self)
        self.pools = {}
        for group in spec.slices:
            shape = group.shape
            policy_name = None
            if shape.multi_host and shape.generation.uses_workload_policy:
                # Ironwood places multi-host slices with a HIGH_THROUGHPUT workload policy over the slice's
                # topology (Cluster Toolkit modules/compute/resource-policy, examples/gke-tpu-7x).
                policy_name = gcp.compute.ResourcePolicy(
                    f"{group.name}-placement", name=f"{spec.cluster_name}-{group.name}-placement",
                    project=spec.project, region=spec.region,
                    workload_policy=gcp.compute.ResourcePolicyWorkloadPolicyArgs(
                        type="HIGH_THROUGHPUT", accelerator_topology=shape.topology),
                    opts=child).name
            capacity = _capacity(group)
            labels = {"gke-tpu-rl/slice-group": group.name}
            nics = spec.dranet_networks_for(group)  # 0 on machines without managed DRANET (v5p)
            if nics:
                labels[DRANET_NODE] = "true"
            for pool_name in group.pool_names():
                placement = None
                if shape.multi_host:
                    # With a workload policy the pool still names its topology, as Cluster Toolkit's gke-node-pool
                    # passes policy_name and tpu_topology together.
                    placement = gcp.container.NodePoolPlacementPolicyArgs(
                        type="COMPACT", policy_name=policy_name, tpu_topology=shape.topology)
                network_config = gcp.container.NodePoolNetworkConfigArgs(
                    additional_node_network_configs=[
                        gcp.container.NodePoolNetworkConfigAdditionalNodeNetworkConfigArgs(
                            network=net, subnetwork=sub)
                        for net, sub in zip(args.dranet_networks[:nics], args.dranet_subnets[:nics], strict=True)
                    ]) if nics else None
                # Flex-start pools start empty and scale to a whole slice when capacity is granted.
                pool_args = capacity.get("pool") or {"node_count": shape.hosts}
                self.pools[pool_name] = gcp.container.NodePool(
                    pool_name,
                    name=pool_name,
                    project=spec.project,
                    location=spec.zone,
                    cluster=args.cluster,
                    node_locations=[spec.zone],
                    placement_policy=placement,
                    network_config=network_config,
                    node_config=gcp.container.NodePoolNodeConfigArgs(
                        machine_type=shape.machine_type,
                        service_account=args.node_service_account,
                        oauth_scopes=OAUTH_SCOPES,
                        # gVNIC on every TPU pool (xpk passes --enable-gvnic for all; DCN bandwidth needs it).
                        gvnic=gcp.container.NodePoolNodeConfigGvnicArgs(enabled=True),
                        disk_type=shape.generation.boot_disk_type,
                        workload_metadata_config=gcp.container.NodePoolNodeConfigWorkloadMetadataConfigArgs(
                            mode="GKE_METADATA"),
                        labels=labels,
                        resource_labels=spec.resource_labels(),
                        **capacity.get("node", {}),
                    ),
                    # TPU slices are repaired as a whole by GKE; surge upgrades would split a slice.
                    management=gcp.container.NodePoolManagementArgs(
                        auto_repair=group.capacity != "flex-start", auto_upgrade=True),
                    upgrade_settings=gcp.container.NodePoolUpgradeSettingsArgs(max_surge=0, max_unavailable=1),
                    **pool_args,
                    opts=child,
                )
        self.register_outputs({"pools": list(self.pools)})
