"""Network: the VPC and node subnet (with pod/service ranges), Cloud NAT for private nodes, DRANET's extra VPCs."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec

POD_RANGE = "pods"
SERVICE_RANGE = "services"
# What the GKE control plane must reach on the private nodes beyond the 443 and 10250 GKE's own rule opens (GKE
# private-cluster docs: "Adding firewall rules for specific use cases"), one constant per port:
# controller-runtime's default webhook port, where the JobSet and Kueue managers serve their admission webhooks
# (jobset charts/jobset/templates/controller/deployment.yaml:82 at v0.12.0; kueue charts/kueue/values.yaml:128
# `webhook.port: 9443` at v0.19.2).
WEBHOOK_PORT = "9443"
# Kueue's visibility API server. The chart registers the aggregated APIServices v1beta1 and
# v1beta2.visibility.kueue.x-k8s.io unconditionally (charts/kueue/templates/visibility/apiservice_v1beta1.yaml and
# apiservice_v1beta2.yaml: no `if` around them) behind a Service whose targetPort is 8082
# (templates/visibility/service.yaml:33, the manager's `visibility` containerPort in templates/manager/manager.yaml:73),
# Kueue's default VisibilityServer.BindPort (apis/config/v1beta2/defaults.go:54), all at v0.19.2. Unreachable, the
# APIService is Unavailable: discovery of that group fails (kubectl and every client that lists API groups warn or
# fail) and the namespace controller cannot finish deleting namespaces, which stalls `pulumi destroy`. Turning the
# API off instead is not clean: disabling the VisibilityOnDemand feature gate stops the server (cmd/kueue/main.go:433)
# but leaves both APIServices registered and pointing at a port nothing listens on.
VISIBILITY_PORT = "8082"
CONTROL_PLANE_PORTS = (WEBHOOK_PORT, VISIBILITY_PORT)


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

        # A protected Cloud SQL instance outlives `pulumi destroy` with its private IP in this VPC (its peering is
        # kept too, infra/components/database.py); GCP refuses to delete a network still peered, so the VPC is kept
        # with it.
        keep = spec.service is not None and spec.sql_protected
        self.vpc = gcp.compute.Network(
            f"{name}-vpc", project=spec.project, auto_create_subnetworks=False, routing_mode="REGIONAL",
            opts=pulumi.ResourceOptions(parent=self, retain_on_delete=keep))
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

        # GKE's own control-plane rule opens only 443 and 10250 to private nodes. Without 9443 creating the queues
        # and the JobSet fails with "failed calling webhook"; without 8082 Kueue's visibility APIService stays
        # Unavailable (see CONTROL_PLANE_PORTS). The resource keeps its first name so that adding a port updates
        # the rule in place rather than replacing it.
        gcp.compute.Firewall(
            f"{name}-webhooks", project=spec.project, network=self.vpc.id, direction="INGRESS",
            source_ranges=[net.master_cidr],
            allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=list(CONTROL_PLANE_PORTS))],
            description="control plane to admission webhooks (JobSet, Kueue) and Kueue's visibility API",
            opts=child)

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
