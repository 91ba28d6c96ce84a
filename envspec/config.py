"""The typed environment spec: stack config in, a validated EnvironmentSpec out, before any resource exists.

No Pulumi here: the Pulumi program (and the offline plan, which runs it under mocks) reads the running stack's
config (infra/base/stack_config.py), `gke-tpu-rl fit` reads the stack file (infra/base/stack_file.py), and both hand the
values to parse_spec.

This module is the spec's top: EnvironmentSpec with the checks that read several sections at once and the names
derived from the whole environment, parse_spec and its ConfigError, and the stack-wide constants. Each section of
the stack file is a model of its own under envspec/sections/ (network, cluster, slices, storage, queues, trainer,
service). The controllers section stays here beside KUEUE_CHART_VERSIONS, which its error message tells a developer
to extend in this file.
"""

from __future__ import annotations

import ipaddress
import re
import types
import typing
from typing import Any, Union

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails

from envspec import locations, rules, suggest, zones
from envspec.sections.cluster import ClusterSpec, prefix_can_reach
from envspec.sections.fields import _BUNDLED, BundledConfigs, _Model, _short_name
from envspec.sections.network import NetworkSpec
from envspec.sections.queues import QueuesSpec
from envspec.sections.service import ServiceSpec
from envspec.sections.slices import SliceGroupSpec
from envspec.sections.storage import StorageSpec
from envspec.sections.trainer import TrainerSpec

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

_PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")


class ConfigError(ValueError):
    """A stack config problem; the message names the config key, the value and what is allowed.

    A plain ValueError: the Pulumi program turns it into a RunError at its boundary (infra/base/stack_config.py), so
    `pulumi up` prints the message without a traceback."""


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


class EnvironmentSpec(_Model):
    env: str = Field(description="the environment (stack) name")
    project: str = Field(description="the GCP project id; it begins the bucket names, so it may not begin with "
                         "'goog' nor contain 'google' (Cloud Storage's rule)")
    # Before region: its validator reads it.
    skip_region_check: bool = Field(False, description="skip the check of region against the table in "
                                    "envspec/locations.py: for a region Google opened after that table was read")
    region: str = Field(description="GCP region of the network, the registry and (by default) the bucket; one of "
                        "the table in envspec/locations.py")
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
        word = rules.project_restricted(v)
        if word:
            raise ValueError(
                f"{v!r} contains {word!r}: GCP project ids cannot contain it ({rules.PROJECT_ID_RULES}), nor can the "
                f"Cloud Storage bucket names the stack derives from the project id ({rules.BUCKET_NAMING}); set the "
                "id of the project to deploy to (`gcloud projects describe <id>` shows it)")
        return v

    @field_validator("region")
    @classmethod
    def _region(cls, v: str, info: Any) -> str:
        if not _REGION.match(v):
            raise ValueError(f"{v!r} is not a region like us-east5")
        # Here, not among the cross-checks: zone's check reads region, and a misspelled region should be named as such.
        problem = None if info.data.get("skip_region_check") else locations.region_problem(v)
        if problem:
            raise ValueError(problem)
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
        self._check_locations()
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
        self._check_bucket_words("the service's state bucket name", self.service_state_bucket,
                                 "<project>-<stack>-<service>-state",
                                 [("project", self.project), (STACK_NAME, self.env), ("service.name", svc.name)])

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
        self._check_bucket_words("the checkpoint bucket name", self.bucket_name, "<project>-<stack>-checkpoints",
                                 [("project", self.project), (STACK_NAME, self.env)])
        for g in self.slices:
            if g.shape.multi_host and g.shape.generation.uses_workload_policy:
                rules.gcp_name(f"{self.cluster_name}-{g.name}-placement", 63,
                               f"slices: group {g.name!r}'s resource policy name")

    @staticmethod
    def _check_bucket_words(what: str, bucket: str, pattern: str, parts: list[tuple[str, str]]) -> None:
        """A bucket name the stack derives from config values (`parts`: key and value, in the order they make the
        name) holds no word Cloud Storage reserves; the error names the key whose value brings it in."""
        fixes = {"project": "the stack names its buckets after the project id, so deploy to a project whose id does "
                            f"not begin with {rules.BUCKET_RESERVED_PREFIX!r} nor contain 'google'",
                 STACK_NAME: "use a stack name without it (pulumi stack init <name>)",
                 "service.name": "use a service name without it"}
        for i, (key, value) in enumerate(parts):
            rule = rules.bucket_reserved_word(value, first=i == 0)
            if rule:
                raise ValueError(f"{key}: {value!r} makes {what} {bucket!r} ({pattern}), which Cloud Storage "
                                 f"refuses: {rule} ({rules.BUCKET_NAMING}); {fixes[key]}")

    def _check_locations(self) -> None:
        s = self.storage
        # The bucket goes in the region when storage.location is unset: a region may run TPUs and have no bucket
        # location (us-central2), which the bucket would find out after the network and the cluster exist.
        problem = None if s.location is not None or s.skip_location_check else \
            locations.storage_location_problem(self.region)
        if problem:
            raise ValueError(f"storage.location: unset, so the bucket would be in the region, and {problem}")

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


def _describe(err: ErrorDetails) -> str:
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
        return f"{where}: unknown key{_suggest_key(tuple(err['loc']))}"
    if isinstance(value, str | int | float | bool) and repr(value) not in msg:
        return f"{where}: {msg} (got {value!r})"
    return f"{where}: {msg}"


def _step(annotation: Any, part: str | int) -> Any:
    """The type found one loc part below `annotation`: a model's field, a list's item, a dict's value; None when the
    loc leaves the typed spec."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return next((t for a in typing.get_args(annotation) if (t := _step(a, part)) is not None), None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(part, str):
        field = next((f for name, f in annotation.model_fields.items() if part in (name, f.alias)), None)
        return None if field is None else field.annotation
    if origin in (list, tuple) and isinstance(part, int):
        return typing.get_args(annotation)[0]
    if origin is dict and isinstance(part, str):
        return typing.get_args(annotation)[1]
    return None


def _suggest_key(loc: tuple[Any, ...]) -> str:
    """'; did you mean <key>?' for an unknown key: the closest keys the model at its place allows (difflib), or ''."""
    node: Any = EnvironmentSpec
    for part in loc[:-1]:
        node = _step(node, part)
    options = typing.get_args(node) if typing.get_origin(node) in (Union, types.UnionType) else (node,)
    model = next((t for t in options if isinstance(t, type) and issubclass(t, BaseModel)), None)
    if model is None:
        return ""
    allowed = [f.alias or name for name, f in model.model_fields.items()]
    if model is EnvironmentSpec:  # the stack name is no key; the secrets are read beside the spec
        allowed = [k for k in allowed if k != "env"] + list(SECRET_KEYS)
    parent = _format_loc(loc[:-1])
    return suggest.did_you_mean([f"{parent}.{k}" if parent else k
                                 for k in suggest.closest(str(loc[-1]), allowed, cutoff=0.6, keep_case=True)])


def parse_spec(raw: dict[str, Any], env: str, bundled: BundledConfigs) -> EnvironmentSpec:
    """Validates a stack's config (keys without the namespace) into an EnvironmentSpec, or raises ConfigError.

    bundled: the trainer configs the trainer image holds (trainer.base.config.bundled_configs()), which
    trainer.config and service.config are checked against."""
    values = {k: v for k, v in raw.items() if k not in SECRET_KEYS}
    try:
        return EnvironmentSpec.model_validate({**values, "env": env}, context={_BUNDLED: bundled})
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ConfigError(f"invalid stack config for environment {env!r}:\n  " + "\n  ".join(lines)) from None
