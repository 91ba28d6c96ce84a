"""The `cluster` section: the GKE Standard cluster (release channel, version prefix, control plane access) and its
CPU system pool, with how GKE version strings compare."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from envspec import machines, rules
from envspec.sections.fields import _cidr, _Model

_VERSION_PREFIX = re.compile(r"^\d+\.\d+\.?$")
_GKE_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:-gke\.(\d+))?$")


def gke_version_tuple(version: str) -> tuple[int, int, int, int]:
    m = _GKE_VERSION.match(version)
    if not m:
        raise ValueError(f"{version!r} is not a GKE version like 1.34.1-gke.1829001")
    major, minor, patch, gke = (int(g or 0) for g in m.groups())
    return major, minor, patch, gke


def prefix_can_reach(prefix: str, version: str) -> bool:
    """Whether some version starting with `prefix` (e.g. '1.34.') is at least `version`."""
    parts = [int(p) for p in prefix.rstrip(".").split(".")]
    floor = gke_version_tuple(version)
    return tuple(parts) >= floor[:len(parts)]


class SystemPoolSpec(_Model):
    machine_type: str = Field("e2-standard-8", description="machine type of the system pool; `plan` and "
                              "`pulumi up` refuse one whose nodes cannot hold what is pinned to the pool")
    nodes: int = Field(2, ge=1, le=20, description="nodes in the system pool")

    @field_validator("machine_type")
    @classmethod
    def _machine(cls, v: str) -> str:
        # A type whose vCPUs and memory the system-pool check knows (envspec/machines.py MACHINE_FAMILIES).
        machines.machine(rules.gcp_name(v, 63, "machine type"))
        return v


class ClusterSpec(_Model):
    release_channel: Literal["RAPID", "REGULAR", "STABLE"] = Field(
        "RAPID", description="GKE release channel; the control plane and the node pools follow its upgrades")
    version_prefix: str | None = Field(
        None, description="a GKE minor like '1.34.': the cluster starts on the channel's newest version with that "
        "prefix (Cluster Toolkit's version_prefix); the channel's default when unset. Never a pinned patch, which "
        "GKE stops offering; the channel upgrades the cluster from there")
    ray_operator: bool | None = Field(
        None, description="the GKE Ray operator add-on (KubeRay); on by default when trainer.launcher is 'ray'")
    system_pool: SystemPoolSpec = Field(SystemPoolSpec(), description="the CPU node pool for what stays off the "
                                        "TPU hosts: the JobSet and Kueue controllers, GKE's own pods, the Ray head")
    master_authorized_cidrs: list[str] = Field(
        default_factory=list, description="CIDR blocks allowed to reach the control plane's IP endpoint (master "
        "authorized networks); empty: no allow-list")
    control_plane_endpoint: Literal["dns", "ip"] = Field(
        "dns", description="how `pulumi up` reaches the API server: the DNS-based endpoint (IAM-authenticated, "
        "reachable from any runner, no IP allow-list) or the IP endpoint (callers must be in masterAuthorizedCidrs)")
    deletion_protection: bool = Field(False, description="GKE deletion protection: while true, the cluster "
                                      "cannot be deleted (`pulumi destroy` fails)")

    @model_validator(mode="before")
    @classmethod
    def _no_pinned_version(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("minVersion" in data or "min_version" in data):
            raise ValueError("cluster.minVersion pinned a patch GKE stops offering; use cluster.versionPrefix "
                             "(a minor such as '1.34.') or leave it unset for the release channel's default")
        return data

    @field_validator("version_prefix")
    @classmethod
    def _prefix(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not _VERSION_PREFIX.match(v):
            raise ValueError(f"{v!r} is not a GKE version prefix like '1.34.' (major.minor)")
        # A trailing dot, so '1.3' cannot match 1.30 and later (Cluster Toolkit's advice for version_prefix).
        return v if v.endswith(".") else v + "."

    @field_validator("master_authorized_cidrs")
    @classmethod
    def _authorized(cls, v: list[str]) -> list[str]:
        return [_cidr(c) for c in v]
