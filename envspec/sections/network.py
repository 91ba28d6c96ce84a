"""The `network` section: the VPC's IP ranges and the extra high-MTU networks of GKE managed DRANET."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator

from envspec import rules
from envspec.sections.fields import _cidr, _Model, _subnet


class DranetSpec(_Model):
    enabled: bool = Field(False, description="GKE managed DRANET: the multi-host pods of DRANET machines (ct6e, "
                          "i.e. v6e) claim the NICs of extra high-MTU VPCs and send the DCN traffic between slices "
                          "over them")
    networks: int | None = Field(None, ge=1, le=8, description="extra high-MTU networks; derived from the TPU "
                                 "catalog (the NICs of the DRANET machines) when unset, and must match it when set")
    mtu: int = Field(8896, ge=1460, le=8896, description="MTU of the extra DRANET VPCs")
    cidrs: list[str] | None = Field(None, description="one subnet CIDR per extra network; derived when unset")

    @field_validator("cidrs")
    @classmethod
    def _check_cidrs(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [_subnet(c) for c in v]

    def subnet_cidrs(self, count: int) -> list[str]:
        return self.cidrs or [f"10.{200 + i}.0.0/16" for i in range(count)]


class NetworkSpec(_Model):
    node_cidr: str = Field("10.0.0.0/20", description="the node subnet's primary range")
    pod_cidr: str = Field("10.16.0.0/14", description="the node subnet's secondary range for pod IPs")
    service_cidr: str = Field("10.20.0.0/20", description="the node subnet's secondary range for Service IPs")
    master_cidr: str = Field("172.16.0.0/28", description="the private control plane's IPv4 /28; like every "
                             "range of the environment, it must not overlap the others")
    dranet: DranetSpec = Field(DranetSpec(), description="extra high-MTU networks for the DCN traffic between "
                               "multi-host slices (GKE managed DRANET)")

    @field_validator("node_cidr", "pod_cidr", "service_cidr")
    @classmethod
    def _cidrs(cls, v: str) -> str:
        return _subnet(v)

    @field_validator("master_cidr")
    @classmethod
    def _master(cls, v: str) -> str:
        cidr = _cidr(v)
        network = ipaddress.ip_network(cidr)
        if network.version != 4 or network.prefixlen != rules.CONTROL_PLANE_PREFIX:
            raise ValueError(f"{cidr} is not a /{rules.CONTROL_PLANE_PREFIX}: a private cluster's control plane "
                             f"takes an IPv4 /{rules.CONTROL_PLANE_PREFIX}")
        rules.allowed_in_vpc(network)
        return cidr
