"""Network: the VPC and node subnet (with pod/service ranges), Cloud NAT for private nodes, DRANET's extra VPCs."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.config import EnvironmentSpec

POD_RANGE = "pods"
SERVICE_RANGE = "services"
WEBHOOK_PORT = "9443"  # controller-runtime's default webhook port, used by the JobSet and Kueue managers


@dataclass(frozen=True)
class NetworkArgs:
    spec: EnvironmentSpec


class Network(pulumi.ComponentResource):
    vpc: gcp.compute.Network
    subnet: gcp.compute.Subnetwork
    dranet_vpcs: list[gcp.compute.Network]
    dranet_subnets: list[gcp.compute.Subnetwork]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:Network", name, None, opts)
        spec, net = args.spec, args.spec.network
        child = pulumi.ResourceOptions(parent=self)

        self.vpc = gcp.compute.Network(
            f"{name}-vpc", project=spec.project, auto_create_subnetworks=False, routing_mode="REGIONAL",
            opts=child)
        self.subnet = gcp.compute.Subnetwork(
            f"{name}-nodes", project=spec.project, region=spec.region, network=self.vpc.id,
            ip_cidr_range=net.node_cidr, private_ip_google_access=True,
            secondary_ip_ranges=[
                gcp.compute.SubnetworkSecondaryIpRangeArgs(range_name=POD_RANGE, ip_cidr_range=net.pod_cidr),
                gcp.compute.SubnetworkSecondaryIpRangeArgs(range_name=SERVICE_RANGE, ip_cidr_range=net.service_cidr),
            ],
            opts=child)
        # Private nodes have no public IPs: NAT gives them egress for images and charts.
        router = gcp.compute.Router(f"{name}-router", project=spec.project, region=spec.region,
                                    network=self.vpc.id, opts=child)
        gcp.compute.RouterNat(
            f"{name}-nat", project=spec.project, region=spec.region, router=router.name,
            nat_ip_allocate_option="AUTO_ONLY", source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
            opts=child)

        # GKE's own control-plane rule opens only 443 and 10250 to private nodes; the JobSet and Kueue admission
        # webhooks listen on 9443, so without this creating the queues and the JobSet fails with "failed calling
        # webhook" (GKE private-cluster docs: "Adding firewall rules for specific use cases").
        gcp.compute.Firewall(
            f"{name}-webhooks", project=spec.project, network=self.vpc.id, direction="INGRESS",
            source_ranges=[net.master_cidr],
            allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=[WEBHOOK_PORT])],
            description="control plane to admission webhooks (JobSet, Kueue)", opts=child)

        self.dranet_vpcs, self.dranet_subnets = [], []
        if net.dranet.enabled:
            for i, cidr in enumerate(net.dranet.subnet_cidrs(spec.dranet_network_count)):
                vpc = gcp.compute.Network(
                    f"{name}-dranet-{i}", project=spec.project, auto_create_subnetworks=False,
                    mtu=net.dranet.mtu, routing_mode="REGIONAL", opts=child)
                subnet = gcp.compute.Subnetwork(
                    f"{name}-dranet-{i}", project=spec.project, region=spec.region, network=vpc.id,
                    ip_cidr_range=cidr, opts=child)
                # TPU hosts talk to each other over these networks; nothing else reaches them.
                gcp.compute.Firewall(
                    f"{name}-dranet-{i}-internal", project=spec.project, network=vpc.id, direction="INGRESS",
                    source_ranges=[cidr], allows=[gcp.compute.FirewallAllowArgs(protocol="all")], opts=child)
                self.dranet_vpcs.append(vpc)
                self.dranet_subnets.append(subnet)

        self.register_outputs({
            "vpc": self.vpc.id, "subnet": self.subnet.id,
            "dranet_networks": [v.name for v in self.dranet_vpcs],
        })
