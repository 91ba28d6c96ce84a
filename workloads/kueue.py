"""Kueue (v1beta2) objects: one ResourceFlavor per slice shape, the ClusterQueue, LocalQueue and priorities."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from envspec.config import EnvironmentSpec
from envspec.sections.slices import SliceGroupSpec
from envspec.tpu import SliceShape
from workloads.dra import DRANET_DEVICE_CLASS
from workloads.labels import MANAGED_BY, SYSTEM_POOL, TPU_ACCELERATOR, TPU_RESOURCE, TPU_TOPOLOGY
from workloads.rayjob import head_quota

API = "kueue.x-k8s.io/v1beta2"
PROVISIONING_CHECK = "flex-start"
# GKE's ProvisioningRequest class for flex-start (queued provisioning) node pools.
QUEUED_PROVISIONING_CLASS = "queued-provisioning.gke.io"
# Kueue 0.19 turns DRA on by default and admits a pod with a ResourceClaimTemplate only when the claim's DeviceClass
# maps to a quota resource (resources.deviceClassMappings; kueue pkg/dra/claims.go, docs tasks/manage/setup_dra.md).
# This is that resource: one unit per DRANET network device a pod claims.
DRANET_RESOURCE = "gke-tpu-rl/netdev"
# The Kueue chart's own manager Configuration per chart version (charts/kueue/values.yaml,
# managerConfig.controllerManagerConfigYaml, at tag v<version>), restated because the chart takes it as one YAML
# string: overriding it to add the DRA mapping must keep these, the default integrations above all. Config
# validation refuses any controllers.kueueVersion not listed in envspec/config.py KUEUE_CHART_VERSIONS, and a test
# keeps that list equal to these keys and compares each entry with the chart's values.yaml (a vendored copy under
# tests/fixtures/), so a chart bump cannot silently keep an older chart's config.
CHART_MANAGER_CONFIGS: dict[str, dict[str, Any]] = {
    "0.19.2": {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": ":8081"},
        "metrics": {"bindAddress": ":8443"},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": True, "resourceName": "c1f6bfd2.kueue.x-k8s.io"},
        "controller": {"groupKindConcurrency": {
            "Job.batch": 5, "Pod": 5, "Workload.kueue.x-k8s.io": 10, "LocalQueue.kueue.x-k8s.io": 5,
            "ClusterQueue.kueue.x-k8s.io": 5, "ResourceFlavor.kueue.x-k8s.io": 1}},
        "clientConnection": {"qps": 300, "burst": 500},
        "integrations": {"frameworks": [
            "batch/job", "kubeflow.org/mpijob", "ray.io/rayjob", "ray.io/rayservice", "ray.io/raycluster",
            "jobset.x-k8s.io/jobset", "workload.codeflare.dev/appwrapper", "trainer.kubeflow.org/trainjob", "pod",
            "deployment", "statefulset", "leaderworkerset.x-k8s.io/leaderworkerset"]},
    },
}


def _meta(name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(MANAGED_BY)}
    if namespace:
        meta["namespace"] = namespace
    return meta


def flavor_name(shape: SliceShape) -> str:
    return shape.key


def resource_flavor(shape: SliceShape) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "ResourceFlavor",
        "metadata": _meta(flavor_name(shape)),
        "spec": {"nodeLabels": {TPU_ACCELERATOR: shape.accelerator, TPU_TOPOLOGY: shape.topology}},
    }


def _sum_by_flavor(spec: EnvironmentSpec, per_slice: Callable[[SliceGroupSpec], int]) -> dict[str, int]:
    """`per_slice(group)` x its slice count, summed per flavor across groups."""
    quota: dict[str, int] = defaultdict(int)
    for group in spec.slices:
        quota[flavor_name(group.shape)] += per_slice(group) * group.count
    return dict(quota)


def tpu_quota_by_flavor(spec: EnvironmentSpec) -> dict[str, int]:
    """Chips per flavor: every declared slice of that shape, across groups."""
    return _sum_by_flavor(spec, lambda g: g.shape.chips)


def dranet_quota_by_flavor(spec: EnvironmentSpec) -> dict[str, int]:
    """DRANET devices per flavor: every host of every declared slice claims one per extra network."""
    return _sum_by_flavor(spec, lambda g: g.shape.hosts * spec.dranet_networks_for(g))


def manager_config(spec: EnvironmentSpec) -> dict[str, Any]:
    """Kueue's manager Configuration: the deployed chart version's, plus the DRANET DeviceClass mapping when pods
    claim devices."""
    version = spec.controllers.kueue_version
    if version not in CHART_MANAGER_CONFIGS:  # config validation refuses it first; this guards a direct caller
        raise ValueError(f"no restated Kueue manager config for chart {version!r}; "
                         f"have: {', '.join(CHART_MANAGER_CONFIGS)}")
    config = copy.deepcopy(CHART_MANAGER_CONFIGS[version])
    if spec.dranet_network_count:
        config["resources"] = {"deviceClassMappings": [
            {"name": DRANET_RESOURCE, "deviceClassNames": [DRANET_DEVICE_CLASS]}]}
    return config


# The CPU system pool's flavor: a Ray head's CPU and memory are admitted from it (launcher: ray).
SYSTEM_FLAVOR = "system"


def resource_flavors(spec: EnvironmentSpec) -> list[dict[str, Any]]:
    shapes = {flavor_name(g.shape): g.shape for g in spec.slices}
    flavors = [resource_flavor(s) for s in shapes.values()]
    if spec.runs_on_ray:
        flavors.append({"apiVersion": API, "kind": "ResourceFlavor", "metadata": _meta(SYSTEM_FLAVOR),
                        "spec": {"nodeLabels": dict(SYSTEM_POOL)}})
    return flavors


def _flex_flavors(spec: EnvironmentSpec) -> list[str]:
    return sorted({flavor_name(g.shape) for g in spec.slices if g.capacity == "flex-start"})


def cluster_queue(spec: EnvironmentSpec) -> dict[str, Any]:
    q = spec.queues
    body: dict[str, Any] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": q.namespace}},
        "queueingStrategy": "BestEffortFIFO",
        "preemption": {"withinClusterQueue": "LowerPriority"},
        "resourceGroups": [
            {
                "coveredResources": [TPU_RESOURCE],
                "flavors": [
                    {"name": name, "resources": [{"name": TPU_RESOURCE, "nominalQuota": chips}]}
                    for name, chips in tpu_quota_by_flavor(spec).items()
                ],
            }
        ],
    }
    if spec.dranet_network_count:
        # Same group as the chips, so a workload's TPUs and its network devices come from one flavor; a flavor
        # without DRANET (v5p) covers the resource with zero quota, as Kueue requires of every flavor in a group.
        dranet = dranet_quota_by_flavor(spec)
        group = body["resourceGroups"][0]
        group["coveredResources"].append(DRANET_RESOURCE)
        for flavor in group["flavors"]:
            flavor["resources"].append({"name": DRANET_RESOURCE, "nominalQuota": dranet.get(flavor["name"], 0)})
    if spec.runs_on_ray:
        # Kueue admits a workload only when every resource its pods request is covered: the Ray head's pod set
        # asks for CPU and memory (its own, the autoscaler's and the submitter's). Quota for exactly one head; the
        # TPU pods request no CPU or memory, so they never take this flavor (and its node selector).
        quota = head_quota()
        body["resourceGroups"].append({"coveredResources": ["cpu", "memory"], "flavors": [
            {"name": SYSTEM_FLAVOR, "resources": [{"name": r, "nominalQuota": quota[r]} for r in ("cpu", "memory")]}]})
    if flex := _flex_flavors(spec):
        body["admissionChecksStrategy"] = {
            "admissionChecks": [{"name": PROVISIONING_CHECK, "onFlavors": flex}]
        }
    return {"apiVersion": API, "kind": "ClusterQueue", "metadata": _meta(q.cluster_queue), "spec": body}


def local_queue(spec: EnvironmentSpec) -> dict[str, Any]:
    q = spec.queues
    return {
        "apiVersion": API,
        "kind": "LocalQueue",
        "metadata": _meta(q.local_queue, q.namespace),
        "spec": {"clusterQueue": q.cluster_queue},
    }


def priority_classes(spec: EnvironmentSpec) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": API,
            "kind": "WorkloadPriorityClass",
            "metadata": _meta(name),
            "value": value,
            "description": f"gke-tpu-rl {name} priority",
        }
        for name, value in sorted(spec.queues.priority_classes.items(), key=lambda kv: kv[1])
    ]


def flex_start_admission(spec: EnvironmentSpec) -> list[dict[str, Any]]:
    """ProvisioningRequest admission for flex-start slices; empty when no group uses flex-start."""
    if not _flex_flavors(spec):
        return []
    config_name = f"{PROVISIONING_CHECK}-config"
    return [
        {
            "apiVersion": API,
            "kind": "ProvisioningRequestConfig",
            "metadata": _meta(config_name),
            "spec": {"provisioningClassName": QUEUED_PROVISIONING_CLASS, "managedResources": [TPU_RESOURCE]},
        },
        {
            "apiVersion": API,
            "kind": "AdmissionCheck",
            "metadata": _meta(PROVISIONING_CHECK),
            "spec": {
                "controllerName": "kueue.x-k8s.io/provisioning-request",
                "parameters": {
                    "apiGroup": "kueue.x-k8s.io",
                    "kind": "ProvisioningRequestConfig",
                    "name": config_name,
                },
            },
        },
    ]
