"""The typed environment spec: stack config in, a validated EnvironmentSpec out, before any resource exists.

No Pulumi here: the Pulumi program (and the offline plan, which runs it under mocks) reads the running stack's
config (infra/base/stack_config.py), `gke-tpu-rl fit` reads the stack file (infra/base/stack_file.py), and both hand the
values to parse_spec.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from envspec import machines, repo, rules, tpu, zones

NAMESPACE = "gke-tpu-rl"
STACK_NAME = "stack name"  # how errors name the environment, which is not a config key
# The trainer JobSet's one replicated job (workloads/jobset.py); here because the JobSet name's length depends on it.
REPLICATED_JOB = "slice"
# Config keys read outside the typed spec because they hold Pulumi secrets.
SECRET_KEYS = ("hfToken",)
# Managed DRANET needs this GKE version or later (Standard clusters).
DRANET_MIN_GKE = "1.34.1-gke.1829001"
# The Kueue chart versions whose default manager Configuration workloads/kueue.py restates (CHART_MANAGER_CONFIGS,
# one entry per version; a test keeps the two in step and compares each with that chart's values.yaml). The chart
# takes the config as one YAML string, so the stack's override (the DRANET DeviceClass mapping) replaces the chart's
# own: under another chart version the restated one would silently stand in for that version's defaults.
KUEUE_CHART_VERSIONS = ("0.19.2",)

# Slice group names: RFC 1035 labels short enough that `<group>-<index>` is a GKE node pool name (40 characters).
_GROUP_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")
_PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_VERSION_PREFIX = re.compile(r"^\d+\.\d+\.?$")
_GKE_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:-gke\.(\d+))?$")


class ConfigError(ValueError):
    """A stack config problem; the message names the config key, the value and what is allowed.

    A plain ValueError: the Pulumi program turns it into a RunError at its boundary (infra/base/stack_config.py), so
    `pulumi up` prints the message without a traceback."""


@dataclass(frozen=True)
class BundledConfigs:
    """The trainer configs the trainer image bundles (trainer/configs/): what trainer.config and service.config may
    name. The spec sits below the trainer and never imports it, so the caller passes the trainer's own listing
    (trainer.base.config.bundled_configs())."""

    runs: Sequence[str]  # RL training runs
    services: Sequence[str]  # the post-training service's engine configs (a `service` section)


_BUNDLED = "bundled_configs"  # the validation context's key for them (parse_spec sets it)


def _bundled(info: ValidationInfo) -> BundledConfigs:
    configs = (info.context or {}).get(_BUNDLED)
    if not isinstance(configs, BundledConfigs):
        # A programming error, not a config problem: pydantic lets a TypeError through unchanged.
        raise TypeError("the spec names a bundled trainer config; validate it with parse_spec(raw, env, "
                        "bundled_configs) so it can be checked")
    return configs


class _Model(BaseModel):
    # Pulumi stack config is camelCase; unknown keys are typos, so they are errors.
    # NaN and infinity are never a valid setting (YAML's .nan/.inf would otherwise pass a range check).
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
                              allow_inf_nan=False)


def gke_version_tuple(version: str) -> tuple[int, int, int, int]:
    m = _GKE_VERSION.match(version)
    if not m:
        raise ValueError(f"{version!r} is not a GKE version like 1.34.1-gke.1829001")
    return tuple(int(g or 0) for g in m.groups())  # type: ignore[return-value]


def prefix_can_reach(prefix: str, version: str) -> bool:
    """Whether some version starting with `prefix` (e.g. '1.34.') is at least `version`."""
    parts = [int(p) for p in prefix.rstrip(".").split(".")]
    floor = gke_version_tuple(version)
    return tuple(parts) >= floor[:len(parts)]


def _short_name(value: str, why: str) -> str:
    if not _GROUP_NAME.match(value):
        raise ValueError(f"{value!r} must be a lowercase DNS label (a-z, 0-9, '-', starting with a letter), at most "
                         f"32 characters: {why}")
    return value


def _cidr(value: str) -> str:
    if not isinstance(value, str) or "/" not in value:  # a bare address is not a range GCP accepts
        raise ValueError(f"{value!r} is not a CIDR block like 10.0.0.0/20 (address/prefix length)")
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError as e:
        raise ValueError(f"{value!r} is not a CIDR block like 10.0.0.0/20 ({e})") from None


def _subnet(value: str) -> str:
    cidr = _cidr(value)
    rules.subnet_range(ipaddress.ip_network(cidr))
    return cidr


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


Capacity = Literal["on-demand", "spot", "reservation", "flex-start"]


class SliceGroupSpec(_Model):
    """`count` identical slices of one shape; each slice becomes one node pool."""

    name: str = Field(description="the group's name; its node pools are <name>-0, <name>-1, ...")
    tpu_type: str = Field(description="TPU generation: a name or alias of the TPU catalog (envspec/tpu.py)")
    topology: str = Field(description="the slice's topology (chips along each axis); one the TPU type offers")
    count: int = Field(1, ge=1, le=64, description="identical slices in the group, one node pool each")
    capacity: Capacity = Field("on-demand", description="how the slices' VMs are obtained: on-demand, spot, a "
                               "reservation (named in reservation), or flex-start (queued provisioning through "
                               "Kueue's ProvisioningRequest)")
    reservation: str | None = Field(None, description="the reservation's name; required with capacity "
                                    "'reservation', and only then")
    skip_zone_check: bool = Field(False, description="skip the check that `zone` offers tpuType (the table in "
                                  "envspec/tpu_zones.yaml, from Google's TPU zone list): for a zone Google opened "
                                  "after that table was read")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _short_name(v, "so its node pools' names (<name>-<index>) fit GKE's 40")

    @field_validator("reservation")
    @classmethod
    def _reservation_name(cls, v: str | None) -> str | None:
        return None if v is None else rules.gcp_name(v, 63, "reservation")

    @field_validator("tpu_type")
    @classmethod
    def _type(cls, v: str) -> str:
        return tpu.canonical_type(v)

    @field_validator("topology")
    @classmethod
    def _topology(cls, v: str, info: Any) -> str:
        if "tpu_type" in info.data:  # else the type error is reported already
            tpu.slice_shape(info.data["tpu_type"], v)
        return v

    @model_validator(mode="after")
    def _reservation(self) -> SliceGroupSpec:
        if (self.capacity == "reservation") != (self.reservation is not None):
            raise ValueError("reservation (a reservation name) is required with capacity 'reservation' "
                             "and only then")
        return self

    @property
    def shape(self) -> tpu.SliceShape:
        return tpu.slice_shape(self.tpu_type, self.topology)

    def pool_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]


class StorageSpec(_Model):
    location: str | None = Field(None, description="bucket location; the region when unset")
    protect: bool = Field(True, description="retain the checkpoint bucket on destroy")
    force_destroy: bool = Field(False, description="let the bucket be deleted with its objects in it (needs "
                                "protect: false)")
    versioning: bool = Field(True, description="object versioning on the checkpoint bucket")
    soft_delete_days: int = Field(7, ge=0, le=90, description="days Cloud Storage keeps deleted objects restorable: "
                                  "0 (soft delete off) or 7 to 90")

    @field_validator("soft_delete_days")
    @classmethod
    def _soft_delete(cls, v: int) -> int:
        # Cloud Storage soft delete: 0 (off) or a retention of 7 to 90 days (docs: storage/docs/soft-delete).
        if 0 < v < 7:
            raise ValueError(f"{v} days: Cloud Storage keeps soft-deleted objects 7 to 90 days, or 0 to turn it off")
        return v

    @field_validator("location")
    @classmethod
    def _location(cls, v: str | None) -> str | None:
        # A region (us-east5), dual-region (nam4) or multi-region (US): letters, digits and '-'.
        if v is not None and not re.match(r"^[A-Za-z][-A-Za-z0-9]*[A-Za-z0-9]$", v):
            raise ValueError(f"{v!r} is not a Cloud Storage location like us-east5, nam4 or US")
        return v

    @model_validator(mode="after")
    def _safe(self) -> StorageSpec:
        if self.protect and self.force_destroy:
            raise ValueError("forceDestroy would delete checkpoints on destroy; it needs protect: false")
        return self


class ControllersSpec(_Model):
    jobset_version: str = Field("0.12.0", description="the JobSet Helm chart's version")
    kueue_version: str = Field("0.19.2", description="the Kueue Helm chart's version")
    namespace: str = Field("gke-tpu-rl-system", description="namespace the JobSet and Kueue charts are installed in")

    @field_validator("jobset_version", "kueue_version")
    @classmethod
    def _version(cls, v: str) -> str:
        return rules.semver(v)

    @field_validator("kueue_version")
    @classmethod
    def _kueue_version(cls, v: str) -> str:
        if v not in KUEUE_CHART_VERSIONS:
            raise ValueError(
                f"{v!r} is not a Kueue chart version whose default manager config the stack restates; allowed: "
                f"{', '.join(KUEUE_CHART_VERSIONS)}. To deploy it, restate that chart's "
                f"managerConfig.controllerManagerConfigYaml (charts/kueue/values.yaml at tag v{v}) in "
                "workloads/kueue.py CHART_MANAGER_CONFIGS, vendor it under tests/fixtures/kueue/, and add the "
                "version to KUEUE_CHART_VERSIONS in envspec/config.py")
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return rules.dns_label(v, what="a Kubernetes namespace name (DNS-1123 label)")


class QueuesSpec(_Model):
    namespace: str = Field("rl", description="namespace of the LocalQueue and the training job (its pods, service "
                           "accounts and Hugging Face token secret)")
    cluster_queue: str = Field("tpu-cluster-queue", description="name of the Kueue ClusterQueue that holds the TPU "
                               "quota")
    local_queue: str = Field("tpu", description="name of the Kueue LocalQueue the training job is queued in")
    priority_classes: dict[str, int] = Field(
        default_factory=lambda: {"low": 100, "default": 500, "high": 1000},
        description="Kueue WorkloadPriorityClasses: name to priority value (int32); trainer.priority names one")

    @field_validator("namespace", "local_queue")
    @classmethod
    def _dns(cls, v: str) -> str:
        # The local queue's name is also the JobSet's kueue.x-k8s.io/queue-name label value.
        return rules.dns_label(v)

    @field_validator("cluster_queue")
    @classmethod
    def _subdomain(cls, v: str) -> str:
        return rules.dns_subdomain(v)

    @field_validator("priority_classes")
    @classmethod
    def _priorities(cls, v: dict[str, int]) -> dict[str, int]:
        for name, value in v.items():
            # A WorkloadPriorityClass name, and the JobSet's kueue.x-k8s.io/priority-class label value.
            rules.dns_label(name, what="a priority class name (DNS-1123 label)")
            if not rules.INT32_MIN <= value <= rules.INT32_MAX:
                raise ValueError(f"{name!r}: {value} is outside Kueue's int32 priority range "
                                 f"[{rules.INT32_MIN}, {rules.INT32_MAX}]")
        return v


_HF_REPO = re.compile(r"^[A-Za-z0-9][-\w.]{0,95}/[-\w.]{1,96}$")


class StageSpec(_Model):
    """What a Job stages into the bucket before the trainer starts (python -m trainer.stage, workloads/stage.py):
    the Hugging Face model behind the trainer config's init.path and the dataset file behind its task.path."""

    model: str | None = Field(None, description="Hugging Face model repo (ORG/NAME) downloaded into the trainer "
                              "config's init.path, e.g. Qwen/Qwen3-0.6B; gated repos need gke-tpu-rl:hfToken")
    revision: str | None = Field(None, description="branch, tag or commit of the model repo; its default branch "
                                 "when unset")
    dataset: str | None = Field(None, description="Hugging Face dataset repo (ORG/NAME) one file of which becomes the "
                                "trainer config's task.path, e.g. openai/gsm8k")
    dataset_file: str | None = Field(None, description="that file's path in the dataset repo (.parquet or .jsonl), "
                                     "e.g. main/train-00000-of-00001.parquet")
    timeout_minutes: int = Field(180, ge=5, le=1440, description="how long `pulumi up` waits for the staging Job "
                                 "before it gives up (a 70B model is about 140 GB)")

    @field_validator("model", "dataset")
    @classmethod
    def _repo(cls, v: str | None) -> str | None:
        if v is not None and not _HF_REPO.match(v):
            raise ValueError(f"{v!r} is not a Hugging Face repo id like ORG/NAME")
        return v

    @model_validator(mode="after")
    def _pairs(self) -> StageSpec:
        if (self.dataset is None) != (self.dataset_file is None):
            raise ValueError("stage.dataset and stage.datasetFile go together")
        if self.revision is not None and self.model is None:
            raise ValueError("stage.revision needs stage.model")
        if self.model is None and self.dataset is None:
            raise ValueError("stage: set model, or dataset with datasetFile, or leave stage out")
        return self


class TrainerSpec(_Model):
    enabled: bool = Field(True, description="deploy the training job; false: the environment without one")
    name: str = Field("grpo", description="name of the JobSet or RayJob")
    image: str | None = Field(None, description="a prebuilt trainer image; when unset the stack builds "
                              "trainer/Dockerfile, pushes it to the environment's registry and runs it by digest")
    image_tag: str = Field("latest", description="the tag the stack's build pushes (the JobSet uses the digest)")
    config: str | None = Field(None, description="the trainer YAML, passed to the pod as --config: a file name "
                               "under trainer/configs/, or with trainer.code a path inside that folder; the trainer's "
                               "embedded demo config when unset")
    code: str | None = Field(None, description="a folder of this repository (relative to Pulumi.yaml) with your own "
                             "tasks and rewards: a Python project (pyproject.toml) or a folder of modules, built into "
                             "the trainer image; the trainer config names them as MODULE:NAME (docs/own-tasks.md)")
    args: list[str] = Field(default_factory=list, description="arguments appended to the trainer's command line, "
                            "e.g. [\"--set\", \"steps=200\"]")
    slice_group: str | None = Field(None, description="which slice group runs the trainer; the first when unset")
    slices: int = Field(1, ge=1, description="slices of the trainer's group the job runs on, at most the group's "
                        "count; with launcher 'ray', the most it grows to")
    max_restarts: int = Field(3, ge=0, le=100, description="restarts of the whole job before it fails: the JobSet's "
                              "failurePolicy.maxRestarts, or the RayJob's backoffLimit")
    priority: str = Field("default", description="the job's Kueue priority class, a key of queues.priorityClasses")
    termination_grace_seconds: int = Field(600, ge=30, le=3600, description="the trainer pods' termination grace "
                                           "period, the time for the SIGTERM checkpoint; on the JobSet launcher it "
                                           "is refused when below an estimate of that checkpoint's time")
    service_account: str = Field("trainer", description="the trainer's Kubernetes service account, granted the "
                                 "checkpoint bucket through workload identity")
    launcher: Literal["jobset", "ray"] = Field(
        "jobset", description="'jobset': a JobSet restarts every slice from the last checkpoint on any failure; "
        "'ray': a Kueue-queued elastic RayJob whose Ray Train JaxTrainer goes on with the slices left when one is "
        "lost (down to minSlices) and grows back when capacity returns")
    min_slices: int | None = Field(
        None, ge=1, description="launcher 'ray' only: the fewest slices training goes on with (1 when unset); "
        "`slices` is the most")
    max_failures: int = Field(3, ge=0, le=100, description="launcher 'ray' only: Ray Train's FailureConfig, "
                              "worker-group restarts before the run fails")
    stage: StageSpec | None = Field(None, description="stage the model weights and the dataset into the bucket with "
                                    "a Job before the trainer is created (the trainer's pods read them from there)")

    @property
    def config_in_code(self) -> bool:
        """trainer.config names a file inside trainer.code (which wins over a bundled config of the same name)."""
        v = self.config
        return (v is not None and self.code is not None and repo.within_repo(v)
                and (repo.REPO_ROOT / self.code / v).is_file())

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # The JobSet's or RayJob's name (length checked against the slice count and launcher below).
        if not rules.DNS1035_LABEL.match(v):
            raise ValueError(f"{v!r} is not a JobSet or RayJob name: a-z, 0-9 and '-', starting with a letter")
        return v

    @field_validator("service_account")
    @classmethod
    def _service_account(cls, v: str) -> str:
        return rules.dns_label(v, what="a Kubernetes service account name (DNS-1123 label)")

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return None if v is None else rules.image_reference(v)

    @field_validator("image_tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        return rules.image_tag(v)

    @field_validator("code")
    @classmethod
    def _code(cls, v: str | None) -> str | None:
        if v is None:
            return None
        repo.repo_folder(v)
        if not (repo.REPO_ROOT / v).is_dir():
            raise ValueError(f"{v!r} is not a folder of this repository ({repo.REPO_ROOT})")
        return v

    @model_validator(mode="after")
    def _code_in_built_image(self) -> TrainerSpec:
        if self.code is not None and self.image is not None:
            raise ValueError("trainer.code is built into the image the stack builds; with trainer.image (a prebuilt "
                             "image) set, install your code in that image and unset trainer.code, or unset "
                             "trainer.image")
        return self

    @model_validator(mode="after")
    def _config(self, info: ValidationInfo) -> TrainerSpec:
        # The image holds the trainer package and trainer.code, so the pod can only name a config in one of them.
        v = self.config
        if v is None or self.config_in_code:
            return self
        bundled = _bundled(info).runs  # a service config is not a run: the trainer refuses it
        if "/" not in v and v in bundled:
            return self
        inside = f", or a file inside trainer.code ({self.code})" if self.code else ""
        raise ValueError(f"trainer.config: {v!r} is not a trainer config under trainer/configs/{inside}; allowed: "
                         f"{', '.join(bundled)}")


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
        return int(_SQL_TIER.match(self.tier)[1])  # type: ignore[index]

    @property
    def memory_gib(self) -> float:
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


class EnvironmentSpec(_Model):
    env: str = Field(description="the environment (stack) name")
    project: str = Field(description="the GCP project id")
    region: str = Field(description="GCP region of the network, the registry and (by default) the bucket")
    zone: str = Field(description="zone of the cluster (zonal) and of every node pool; in region")
    labels: dict[str, str] = Field(default_factory=dict, description="labels added to the GCP resources (cluster, "
                                   "node pools, bucket, registry) beside app and env")
    network: NetworkSpec = Field(NetworkSpec(), description="the VPC's IP ranges and the DRANET networks")
    cluster: ClusterSpec = Field(ClusterSpec(), description="the GKE Standard cluster and its CPU system pool")
    slices: list[SliceGroupSpec] = Field(min_length=1, description="TPU slice groups: each is count identical "
                                         "slices of one shape, one node pool per slice")
    storage: StorageSpec = Field(StorageSpec(), description="the checkpoint bucket")
    controllers: ControllersSpec = Field(ControllersSpec(), description="the JobSet and Kueue controllers, from "
                                         "their upstream Helm charts")
    queues: QueuesSpec = Field(QueuesSpec(), description="Kueue's queues and priority classes for the training job")
    trainer: TrainerSpec = Field(TrainerSpec(), description="the training job: a JobSet, or an elastic RayJob with "
                                 "launcher 'ray'")
    service: ServiceSpec | None = Field(None, description="the Tinker-compatible post-training service: an "
                                        "always-up API, a TPU engine and a Cloud SQL store; none when unset")

    @field_validator("env")
    @classmethod
    def _env(cls, v: str) -> str:
        # The stack name goes into GCP and Kubernetes names (cluster rl-<env>, bucket, service account).
        return _short_name(v, "it becomes part of GCP resource names")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return rules.labels(v)

    @field_validator("project")
    @classmethod
    def _project(cls, v: str) -> str:
        if not _PROJECT.match(v):
            raise ValueError(f"{v!r} is not a GCP project id (6-30 chars: a-z, 0-9, '-', starting with a letter)")
        return v

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if not _REGION.match(v):
            raise ValueError(f"{v!r} is not a region like us-east5")
        return v

    @field_validator("zone")
    @classmethod
    def _zone(cls, v: str, info: Any) -> str:
        region = info.data.get("region")
        if not re.match(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$", v):
            raise ValueError(f"{v!r} is not a zone like us-east5-b")
        if region and not v.startswith(region + "-"):
            raise ValueError(f"zone {v!r} is not in region {region!r}; use {region}-<letter>")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> EnvironmentSpec:
        names = [g.name for g in self.slices]
        if len(set(names)) != len(names):
            raise ValueError(f"slices: group names must be unique, got {names}")
        prefix = self.cluster.version_prefix
        if self.network.dranet.enabled and prefix is not None and not prefix_can_reach(prefix, DRANET_MIN_GKE):
            raise ValueError(
                f"cluster.versionPrefix: {prefix!r} has no version new enough for managed DRANET "
                f"(network.dranet.enabled needs {DRANET_MIN_GKE} or later); use '1.34.' or later")
        zones.check_slice_zones(self.slices, self.zone)
        self._check_dranet()
        self._check_ranges()
        self._check_range_sizes()
        self._check_names()
        t = self.trainer
        if t.enabled:
            group = self.trainer_group
            if group is None:
                raise ValueError(f"trainer.sliceGroup: {t.slice_group!r} is not a slice group; allowed: {names}")
            if t.slices > group.count:
                raise ValueError(f"trainer.slices: {t.slices} is more slices than group {group.name!r} declares "
                                 f"({group.count}); allowed: 1..{group.count}")
            if t.launcher != "ray" and t.min_slices is not None:
                raise ValueError("trainer.minSlices: only the 'ray' launcher resizes; a JobSet always runs "
                                 f"trainer.slices ({t.slices}); remove it or set trainer.launcher: ray")
            if t.priority not in self.queues.priority_classes:
                raise ValueError(f"trainer.priority: {t.priority!r} is not a priority class; "
                                 f"allowed: {sorted(self.queues.priority_classes)}")
            if t.launcher == "ray":
                self._check_ray()
            # JobSet's webhook: <jobset>-<replicatedJob>-<jobIndex>-<podIndex> plus a 5-character suffix must be a
            # DNS-1035 label (jobset pkg/webhooks/jobset_webhook.go, placement.GenPodName).
            pod = f"{t.name}-{REPLICATED_JOB}-{t.slices - 1}-{group.shape.hosts - 1}-abcde"
            if t.launcher == "jobset" and len(pod) > rules.DNS_LABEL_MAX:
                raise ValueError(f"trainer.name: {t.name!r} is too long: the JobSet's pod names ({pod}) would "
                                 f"exceed {rules.DNS_LABEL_MAX} characters; use at most "
                                 f"{len(t.name) - (len(pod) - rules.DNS_LABEL_MAX)}")
        if self.service is not None:
            self._check_service()
        return self

    def _check_service(self) -> None:
        svc = self.service
        assert svc is not None
        names = [g.name for g in self.slices]
        group = self.service_group
        if group is None:
            raise ValueError(f"service.sliceGroup: {svc.slice_group!r} is not a slice group; allowed: {names}")
        if svc.priority not in self.queues.priority_classes:
            raise ValueError(f"service.priority: {svc.priority!r} is not a priority class; "
                             f"allowed: {sorted(self.queues.priority_classes)}")
        if self.trainer.enabled and self.trainer.name in (self.service_api_name, self.service_engine_name):
            raise ValueError(f"trainer.name: {self.trainer.name!r} is also a name of the service's objects; "
                             "rename one")
        pod = f"{self.service_engine_name}-{REPLICATED_JOB}-0-{group.shape.hosts - 1}-abcde"
        if len(pod) > rules.DNS_LABEL_MAX:
            raise ValueError(f"service.name: {svc.name!r} is too long: the engine's pod names ({pod}) would exceed "
                             f"{rules.DNS_LABEL_MAX} characters; use at most "
                             f"{len(svc.name) - (len(pod) - rules.DNS_LABEL_MAX)}")
        for role, account in self.service_gcp_accounts.items():
            if not rules.SERVICE_ACCOUNT_ID.match(account):
                raise ValueError(f"service.name: {svc.name!r} with stack {self.env!r} makes the {role}'s Google "
                                 f"service account id {account!r}, which must be 6-30 characters; use a shorter "
                                 "name")
        rules.gcp_name(self.sql_instance_name, 98, "service.name: the Cloud SQL instance name")
        if not rules.BUCKET_NAME.match(self.service_state_bucket):
            raise ValueError(f"service.name: the service's state bucket name {self.service_state_bucket!r} "
                             "(<project>-<stack>-<service>-state) is longer than Cloud Storage's 63 characters; use a "
                             "shorter service name")

    def _check_ray(self) -> None:
        t = self.trainer
        if self.cluster.ray_operator is False:
            raise ValueError("cluster.rayOperator: false, but trainer.launcher 'ray' runs on the GKE Ray operator "
                             "add-on; set it true or leave it unset")
        if self.ray_min_slices > t.slices:
            raise ValueError(f"trainer.minSlices: {t.min_slices} is more than trainer.slices ({t.slices}); "
                             f"allowed: 1..{t.slices}")
        group = self.trainer_group
        if group is not None and group.name == "head":
            raise ValueError("trainer.sliceGroup: 'head' names the Ray worker group, and Kueue reserves it for the "
                             "head's pod set; rename the slice group")
        head = self.ray_head_service_account
        if len(head) > rules.DNS_LABEL_MAX:
            raise ValueError(f"trainer.serviceAccount: {t.service_account!r} is too long: the Ray head's account "
                             f"{head!r} must fit {rules.DNS_LABEL_MAX} characters")
        if len(t.name) > rules.RAYJOB_NAME_MAX:
            raise ValueError(f"trainer.name: {t.name!r} is longer than KubeRay's {rules.RAYJOB_NAME_MAX} characters "
                             "for a RayJob")

    def _check_ranges(self) -> None:
        """No two IP ranges of the environment overlap: GCP refuses overlapping subnet ranges in a VPC, the control
        plane's range must not overlap them (GKE private clusters), and a DRANET pod routes by destination over
        both its pod network and the extra VPCs."""
        net = self.network
        named = [("network.nodeCidr", net.node_cidr), ("network.podCidr", net.pod_cidr),
                 ("network.serviceCidr", net.service_cidr), ("network.masterCidr", net.master_cidr)]
        n = self.dranet_network_count
        given = net.dranet.cidrs is not None
        for i, cidr in enumerate(net.dranet.subnet_cidrs(n)):
            named.append((f"network.dranet.cidrs[{i}]" + ("" if given else " (derived; set network.dranet.cidrs)"),
                          cidr))
        if self.service is not None:
            named.append(("service.database.privateServiceCidr", self.service.database.private_service_cidr))
        clash = rules.overlaps(named)
        if clash:
            ka, a, kb, b = clash[0]
            raise ValueError(f"{ka.split(' ')[0]}: {a} overlaps {NAMESPACE}:{kb} {b}; every range of an "
                             "environment must be disjoint")

    def _check_range_sizes(self) -> None:
        """The node subnet, the pod range and each DRANET subnet hold every node the environment can have (GCP and
        GKE refuse to add nodes past that, which `pulumi up` would find out only half-way through)."""
        net = self.network
        system = self.cluster.system_pool.nodes
        tpu_hosts = sum(g.count * g.shape.hosts for g in self.slices)
        nodes = system + 1 + tpu_hosts  # the system pool's surge node during upgrades (TPU pools surge 0)
        what = f"{system} system node(s) plus 1 surge node and {tpu_hosts} TPU host(s)"
        node_net, pod_net = ipaddress.ip_network(net.node_cidr), ipaddress.ip_network(net.pod_cidr)
        if rules.nodes_in_subnet(node_net) < nodes:
            raise ValueError(f"network.nodeCidr: {node_net} holds {rules.nodes_in_subnet(node_net)} nodes "
                             f"({node_net.num_addresses} addresses less GCP's {rules.SUBNET_RESERVED_ADDRESSES} "
                             f"reserved), but the environment has {nodes}: {what}; use a larger range")
        if rules.nodes_in_pod_range(pod_net) < nodes:
            raise ValueError(f"network.podCidr: {pod_net} holds the pod ranges of "
                             f"{rules.nodes_in_pod_range(pod_net)} nodes (a /{rules.POD_RANGE_PER_NODE_PREFIX} each "
                             f"for GKE's default of 110 pods per node), but the environment has {nodes}: {what}; use "
                             "a larger range")
        dranet_hosts = sum(g.count * g.shape.hosts for g in self.slices if self.dranet_networks_for(g))
        for i, cidr in enumerate(net.dranet.subnet_cidrs(self.dranet_network_count)):
            subnet = ipaddress.ip_network(cidr)
            if rules.nodes_in_subnet(subnet) < dranet_hosts:
                raise ValueError(f"network.dranet.cidrs[{i}]: {subnet} holds {rules.nodes_in_subnet(subnet)} nodes, "
                                 f"but {dranet_hosts} DRANET host(s) attach to it; use a larger range")

    def _check_names(self) -> None:
        """Names derived from the stack name, project and groups fit what GCP accepts."""
        rules.gcp_name(self.cluster_name, rules.GKE_CLUSTER_NAME_MAX, f"{STACK_NAME}: the GKE cluster name")
        account = f"{self.cluster_name}-nodes"
        if not rules.SERVICE_ACCOUNT_ID.match(account):
            raise ValueError(f"{STACK_NAME}: {self.env!r} is too long: the node service account id {account!r} "
                             "must be 6-30 characters")
        if not rules.BUCKET_NAME.match(self.bucket_name):
            raise ValueError(f"project: the checkpoint bucket name {self.bucket_name!r} (<project>-<stack>-"
                             "checkpoints) is longer than Cloud Storage's 63 characters; use a shorter stack name")
        for g in self.slices:
            if g.shape.multi_host and g.shape.generation.uses_workload_policy:
                rules.gcp_name(f"{self.cluster_name}-{g.name}-placement", 63,
                               f"slices: group {g.name!r}'s resource policy name")

    def _check_dranet(self) -> None:
        d = self.network.dranet
        if not d.enabled:
            return
        capable = sorted({g.shape.machine_type for g in self.slices if self.dranet_networks_for(g)})
        if not capable:
            machines = sorted({g.shape.machine_type for g in self.slices})
            raise ValueError(f"network.dranet.enabled: none of the slice groups' machines ({', '.join(machines)}) "
                             "supports GKE managed DRANET (multi-host ct6e, i.e. v6e)")
        n = self.dranet_network_count
        if d.networks is not None and d.networks != n:
            raise ValueError(f"network.dranet.networks: {d.networks}, but the DRANET machines here "
                             f"({', '.join(capable)}) have {n} NICs; use {n} or leave it unset")
        if d.cidrs is not None and len(d.cidrs) != n:
            raise ValueError(f"network.dranet.cidrs: lists {len(d.cidrs)} blocks; {n} networks need {n}")

    def dranet_networks_for(self, group: SliceGroupSpec) -> int:
        """Extra networks a slice group's pods attach (0: no DRANET there), from the TPU catalog."""
        shape = group.shape
        return shape.generation.dranet_nics if self.network.dranet.enabled and shape.multi_host else 0

    @property
    def dranet_network_count(self) -> int:
        """Extra VPCs the environment creates: the most any slice group attaches."""
        return max((self.dranet_networks_for(g) for g in self.slices), default=0)

    @property
    def trainer_group(self) -> SliceGroupSpec | None:
        if self.trainer.slice_group is None:
            return self.slices[0]
        return next((g for g in self.slices if g.name == self.trainer.slice_group), None)

    @property
    def runs_on_ray(self) -> bool:
        """The stack deploys the trainer as a RayJob (its head account, bucket grant and Kueue CPU flavor)."""
        return self.trainer.enabled and self.trainer.launcher == "ray"

    @property
    def ray_operator_enabled(self) -> bool:
        """The Ray operator add-on: as set, else on exactly when the trainer runs on Ray."""
        if self.cluster.ray_operator is not None:
            return self.cluster.ray_operator
        return self.runs_on_ray

    @property
    def ray_head_service_account(self) -> str:
        """The Ray head's own account: KubeRay binds its autoscaler's RBAC to it, which the TPU pods never need."""
        return f"{self.trainer.service_account}-ray-head"

    @property
    def ray_min_slices(self) -> int:
        return self.trainer.min_slices or 1

    @property
    def gke_version_floor(self) -> str | None:
        """The oldest GKE version this environment can run on (managed DRANET's minimum), checked at deploy time
        against the version the channel and prefix resolve to."""
        return DRANET_MIN_GKE if self.network.dranet.enabled else None

    @property
    def service_group(self) -> SliceGroupSpec | None:
        svc = self.service
        if svc is None:
            return None
        if svc.slice_group is None:
            return self.slices[0]
        return next((g for g in self.slices if g.name == svc.slice_group), None)

    @property
    def service_api_name(self) -> str:
        """The API's Deployment, Service and Kubernetes service account."""
        assert self.service is not None
        return f"{self.service.name}-api"

    @property
    def service_engine_name(self) -> str:
        """The engine's JobSet and Kubernetes service account."""
        assert self.service is not None
        return f"{self.service.name}-engine"

    @property
    def service_gcp_accounts(self) -> dict[str, str]:
        """The Google service accounts (ids) the API and the engine act as: Cloud SQL IAM database users must be
        service accounts, so their Kubernetes accounts impersonate these through workload identity."""
        assert self.service is not None
        return {"api": f"{self.env}-{self.service.name}-api", "engine": f"{self.env}-{self.service.name}-eng"}

    @property
    def service_state_bucket(self) -> str:
        """The bucket of the engine's model-state snapshots (service.state_dir)."""
        assert self.service is not None
        return f"{self.project}-{self.env}-{self.service.name}-state"

    @property
    def sql_instance_name(self) -> str:
        assert self.service is not None
        return f"{self.cluster_name}-{self.service.name}"

    @property
    def sql_protected(self) -> bool:
        assert self.service is not None
        p = self.service.database.protect
        return self.storage.protect if p is None else p

    @property
    def cluster_name(self) -> str:
        return f"rl-{self.env}"

    @property
    def bucket_name(self) -> str:
        return f"{self.project}-{self.env}-checkpoints"

    @property
    def registry_id(self) -> str:
        return self.cluster_name

    @property
    def registry_host(self) -> str:
        return f"{self.region}-docker.pkg.dev"

    @property
    def trainer_image_repository(self) -> str:
        """Where the stack pushes the trainer image it builds (no tag or digest)."""
        return f"{self.registry_host}/{self.project}/{self.registry_id}/trainer"

    def resource_labels(self) -> dict[str, str]:
        return {"app": "gke-tpu-rl", "env": self.env, **self.labels}


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + to_camel(str(part))
    return out


def _describe(err: dict[str, Any]) -> str:
    key = _format_loc(tuple(err["loc"]))
    msg = err["msg"].removeprefix("Value error, ")
    if not key:  # cross-field checks name their own key at the start of the message
        return msg if msg.startswith(STACK_NAME) else f"{NAMESPACE}:{msg}"
    if msg.startswith(key + ".") and ": " in msg:  # a section's cross-field check names the key inside it
        return f"{NAMESPACE}:{msg}"
    where = STACK_NAME if key == "env" else f"{NAMESPACE}:{key}"
    value = err.get("input")
    if err["type"] == "missing":
        return f"{where}: required but not set"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    if isinstance(value, str | int | float | bool) and repr(value) not in msg:
        return f"{where}: {msg} (got {value!r})"
    return f"{where}: {msg}"


def parse_spec(raw: dict[str, Any], env: str, bundled: BundledConfigs) -> EnvironmentSpec:
    """Validates a stack's config (keys without the namespace) into an EnvironmentSpec, or raises ConfigError.

    bundled: the trainer configs the trainer image holds (trainer.base.config.bundled_configs()), which trainer.config
    and service.config are checked against."""
    values = {k: v for k, v in raw.items() if k not in SECRET_KEYS}
    try:
        return EnvironmentSpec.model_validate({**values, "env": env}, context={_BUNDLED: bundled})
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ConfigError(f"invalid stack config for environment {env!r}:\n  " + "\n  ".join(lines)) from None
