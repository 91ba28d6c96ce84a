"""The `service` section: the Tinker-compatible post-training service, its Cloud SQL store and how clients reach
its API."""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from envspec.sections.fields import _bundled, _cidr, _Model, _short_name, _subnet

_SQL_TIER = re.compile(r"^db-custom-(\d+)-(\d+)$")


class DatabaseSpec(_Model):
    """The service's Cloud SQL for PostgreSQL instance: private IP in the environment's VPC, IAM database
    authentication only (no built-in users, no passwords), automated backups with point-in-time recovery."""

    tier: str = Field("db-custom-1-3840", description="Cloud SQL machine tier db-custom-<vCPUs>-<MiB of memory> "
                      "(Enterprise edition; 0.9 to 6.5 GiB per vCPU, memory a multiple of 256 MiB)")
    version: Literal["POSTGRES_16", "POSTGRES_17"] = Field("POSTGRES_17", description="PostgreSQL major version")
    disk_gb: int = Field(10, ge=10, le=65536, description="SSD storage in GB; Cloud SQL grows it automatically")
    availability: Literal["zonal", "regional"] = Field(
        "zonal", description="'regional': a standby in another zone of the region takes over on a zone failure "
        "(twice the price)")
    backup_retention_days: int = Field(7, ge=1, le=365, description="days of automated daily backups kept "
                                       "(point-in-time recovery covers the same window)")
    protect: bool | None = Field(None, description="Cloud SQL deletion protection and retain on `pulumi destroy`; "
                                 "as storage.protect when unset")
    private_service_cidr: str = Field("10.24.0.0/20", description="the range reserved in the VPC for Google's "
                                      "private services (Cloud SQL's private IP); like every range of the "
                                      "environment it must not overlap the others")

    @field_validator("tier")
    @classmethod
    def _tier(cls, v: str) -> str:
        m = _SQL_TIER.match(v)
        if not m:
            raise ValueError(f"{v!r} is not a Cloud SQL custom tier like db-custom-1-3840 (db-custom-<vCPUs>-<MiB>); "
                             "shared-core tiers (db-f1-micro, db-g1-small) have no SLA")
        cpus, mib = int(m[1]), int(m[2])
        if not (cpus == 1 or (cpus % 2 == 0 and 2 <= cpus <= 96)):
            raise ValueError(f"{v!r}: vCPUs must be 1 or an even number from 2 to 96")
        if mib % 256 or not 0.9 * 1024 * cpus <= mib <= 6.5 * 1024 * cpus:
            raise ValueError(f"{v!r}: memory must be a multiple of 256 MiB and 0.9 to 6.5 GiB per vCPU "
                             f"({math.ceil(0.9 * 1024 * cpus / 256) * 256}..{int(6.5 * 1024 * cpus) // 256 * 256} MiB "
                             f"for {cpus} vCPU)")
        return v

    @field_validator("private_service_cidr")
    @classmethod
    def _psa(cls, v: str) -> str:
        cidr = _subnet(v)
        if ipaddress.ip_network(cidr).prefixlen > 24:
            raise ValueError(f"{cidr}: private services access needs at least a /24")
        return cidr

    @property
    def cpus(self) -> int:
        # The field's validator matched _SQL_TIER already.
        return int(_SQL_TIER.match(self.tier)[1])  # type: ignore[index]

    @property
    def memory_gib(self) -> float:
        # The field's validator matched _SQL_TIER already.
        return int(_SQL_TIER.match(self.tier)[2]) / 1024  # type: ignore[index]


class ServiceAccessSpec(_Model):
    internal_load_balancer: bool = Field(False, description="also expose the API on an internal passthrough "
                                         "Network Load Balancer in the VPC (off: `kubectl port-forward` only)")
    allowed_cidrs: list[str] = Field(default_factory=list, description="VPC ranges allowed to reach the API "
                                     "through the internal load balancer (its source ranges and the API's "
                                     "NetworkPolicy); required with internalLoadBalancer")

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        return [_cidr(c) for c in v]

    @model_validator(mode="after")
    def _pair(self) -> ServiceAccessSpec:
        if self.internal_load_balancer and not self.allowed_cidrs:
            raise ValueError("access.internalLoadBalancer needs access.allowedCidrs (the VPC ranges of the API's "
                             "clients)")
        if self.allowed_cidrs and not self.internal_load_balancer:
            raise ValueError("access.allowedCidrs admits clients through the internal load balancer; set "
                             "access.internalLoadBalancer: true or remove it")
        return self


class ServiceSpec(_Model):
    """The Tinker-compatible post-training service (trainer/service): the API as a Deployment on the CPU system
    pool, the engine as a Kueue-queued JobSet on a TPU slice group, the store in Cloud SQL."""

    name: str = Field("tinker", description="prefix of the service's objects: <name>-api (Deployment, Service, "
                      "service account), <name>-engine (JobSet, service account), the Cloud SQL instance")
    config: str = Field(description="the engine's config: a bundled service config under trainer/configs/ (one "
                        "with a service section)")
    slice_group: str | None = Field(None, description="which slice group runs the engine; the first when unset")
    suspend: bool = Field(False, description="true: no engine (its slice is free for other work); the API keeps "
                          "accepting requests, which run when the engine is back; nothing is lost")
    priority: str = Field("default", description="the engine's Kueue priority class, a key of "
                          "queues.priorityClasses")
    max_restarts: int = Field(100, ge=0, le=10000, description="the engine JobSet's failurePolicy.maxRestarts: how "
                              "many times over its life the engine's own restart code (42, its database or process "
                              "group unavailable at start) restarts it before it fails; a preemption, node loss or a "
                              "signal restarts it without limit, a bug's exit code fails it; every restart restores "
                              "every model from the bucket")
    termination_grace_seconds: int = Field(120, ge=30, le=3600, description="the engine pods' grace period: the "
                                           "request in flight finishes or is re-run after the restart")
    api_replicas: int = Field(2, ge=1, le=20, description="API pods (stateless; spread over the system pool's nodes)")
    args: list[str] = Field(default_factory=list, description="arguments appended to the engine's command line, "
                            "e.g. [\"--set\", \"service.idle_unload_s=1800\"]")
    stage_model: bool = Field(True, description="stage the config's service.base_model from Hugging Face into the "
                              "bucket with a Job before the engine starts (gated repos need gke-tpu-rl:hfToken)")
    database: DatabaseSpec = Field(DatabaseSpec(), description="the store: Cloud SQL for PostgreSQL")
    access: ServiceAccessSpec = Field(ServiceAccessSpec(), description="how clients reach the API")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _short_name(v, "it prefixes the service's Kubernetes objects, service accounts and Cloud SQL instance")

    @field_validator("config")
    @classmethod
    def _config(cls, v: str, info: ValidationInfo) -> str:
        allowed = _bundled(info).services
        if v not in allowed:
            raise ValueError(f"{v!r} is not a bundled service config under trainer/configs/; allowed: "
                             f"{', '.join(allowed)}")
        return v
