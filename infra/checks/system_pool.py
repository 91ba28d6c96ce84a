"""Whether the CPU system pool can hold every pod the stack pins to it (label gke-tpu-rl/pool: system): the JobSet and
Kueue controllers, GKE's own pods (the TPU pools are tainted, so they land here) and, on the Ray path, the Ray head.

Checked before any resource is registered (infra/components/program.py main), by requests against GKE's allocatable per
node, packed first-fit-decreasing onto the pool's nodes: a pod cannot span nodes, so a sum alone would pass pools whose
nodes are each too small.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from envspec.config import NAMESPACE, ConfigError, EnvironmentSpec
from envspec.machines import (
    MACHINE_FAMILIES,
    Machine,
    Requests,
    allocatable,
    cpu_millicores,
    machine,
    memory_mib,
    requests_of,
)
from infra.base.pod_config import hub_splits
from workloads.rayjob import AUTOSCALER_RESOURCES, HEAD_RESOURCES, SUBMITTER_REQUESTS
from workloads.service import API_GCSFUSE_SIDECAR, API_MAX_SURGE, API_RESOURCES
from workloads.stage import STAGE_RESOURCES
from workloads.trainer_pod import GCSFUSE_SIDECAR

POOL_KEY = f"{NAMESPACE}:cluster.systemPool"
MACHINE_KEY = f"{POOL_KEY}.machineType"

# ---------------------------------------------------------------- GKE's own pods

# No GKE page lists the requests of GKE's own pods, and they change with GKE versions and add-ons: these are headroom
# estimates (rounded up from what such clusters run; adjust them here). On every node, DaemonSets: anetd (Dataplane
# V2), netd, gke-metadata-server (Workload Identity), fluentbit-gke and gke-metrics-agent (Cloud Logging and
# Monitoring), the Persistent Disk and GCS FUSE CSI node plugins, the managed-Prometheus collector.
GKE_NODE_DAEMONS = Requests(cpu_m=400, memory_mib=640)
# Once per cluster, on untainted nodes, so here (the TPU pools are tainted): kube-dns (two replicas), its autoscaler,
# metrics-server, konnectivity-agent and its autoscaler, event-exporter, l7-default-backend, the managed-Prometheus
# operator. Counted as one pod (conservative: they cannot be split across nodes here). Not counted: the Ray operator
# add-on's KubeRay, which GKE manages outside the node pools.
GKE_CLUSTER_ADDONS = Requests(cpu_m=700, memory_mib=768)


# ---------------------------------------------------------------- the controllers


@dataclass(frozen=True)
class ChartPods:
    """A controller chart's Deployment at its default values: replicas and each container's requests.
    infra/components/controllers.py sets only nodeSelector (and Kueue's manager config), so the defaults are
    what runs."""

    name: str
    replicas: int
    containers: Mapping[str, Mapping[str, str]]
    source: str

    @property
    def requests(self) -> Requests:
        return sum((requests_of(c) for c in self.containers.values()), Requests(0, 0))


# Keyed by chart version: a version bump without reading its chart is refused (requests and containers change between
# releases). One Deployment each; Kueue's chart also has KueueViz Deployments, off by default (enableKueueViz: false).
KUEUE_CHART_PODS: dict[str, ChartPods] = {
    "0.19.2": ChartPods(
        "Kueue controller-manager", 1, {"manager": {"cpu": "500m", "memory": "512Mi"}},
        "kubernetes-sigs/kueue v0.19.2 charts/kueue/values.yaml (controllerManager.replicas, "
        "controllerManager.manager.resources.requests); templates/manager/manager.yaml has one container"),
}
JOBSET_CHART_PODS: dict[str, ChartPods] = {
    "0.12.0": ChartPods(
        "JobSet controller", 1, {"controller": {"cpu": "500m", "memory": "128Mi"}},
        "kubernetes-sigs/jobset v0.12.0 charts/jobset/values.yaml (controller.replicas, "
        "controller.resources.requests); templates/controller/deployment.yaml has one container"),
}


def _refused(env: str, message: str) -> ConfigError:
    return ConfigError(f"invalid stack config for environment {env!r}:\n  {message}")


def _chart(spec: EnvironmentSpec, table: Mapping[str, ChartPods], version: str, key: str, what: str,
           where: str) -> ChartPods:
    if version not in table:
        known = ", ".join(table)
        raise _refused(spec.env, (
            f"{NAMESPACE}:controllers.{key} {version}: the system-pool check knows the requests of {what} {known} "
            f"only; read every container's resources.requests and the replicas of its Deployment in {where} at tag "
            f"v{version} and add them to infra/checks/system_pool.py"))
    return table[version]


# ---------------------------------------------------------------- the pods


@dataclass(frozen=True)
class Pod:
    name: str
    requests: Requests
    detail: str = ""  # what it adds up from, for the error


def ray_head() -> Pod:
    """The Ray head pod: its container, the two KubeRay adds (Kueue counts them too) and the gcsfuse sidecar GKE's
    webhook injects for the checkpoint mount, with the requests its annotations set."""
    parts = {
        "ray-head": requests_of(HEAD_RESOURCES),
        "autoscaler": requests_of(AUTOSCALER_RESOURCES),
        "submitter": requests_of(SUBMITTER_REQUESTS),
        "gcsfuse sidecar": _sidecar(),
    }
    return Pod("Ray head", sum(parts.values(), Requests(0, 0)),
               " + ".join(f"{n} {r.vcpu}" for n, r in parts.items()) + " vCPU")


def _sidecar(annotations: Mapping[str, str] = GCSFUSE_SIDECAR) -> Requests:
    return Requests(cpu_millicores(annotations["gke-gcsfuse/cpu-request"]),
                    memory_mib(annotations["gke-gcsfuse/memory-request"]))


def api_pod(name: str) -> Pod:
    """An API pod: its container and the gcsfuse sidecar of its read-only checkpoint mount (workloads/service.py
    API_GCSFUSE_SIDECAR)."""
    api, sidecar = requests_of(API_RESOURCES), _sidecar(API_GCSFUSE_SIDECAR)
    return Pod(name, api + sidecar, f"api {api.vcpu} + gcsfuse sidecar {sidecar.vcpu} vCPU")


def stage_pod() -> Pod:
    """The staging Job's pod (trainer.stage): its container and the gcsfuse sidecar. It runs before the trainer, so
    it never overlaps a Ray head of the same environment, but counting both keeps the check simple and safe."""
    total = requests_of(STAGE_RESOURCES) + _sidecar()
    return Pod("staging Job", total, f"stage {requests_of(STAGE_RESOURCES).vcpu} + gcsfuse sidecar "
               f"{_sidecar().vcpu} vCPU")


def pinned_pods(spec: EnvironmentSpec) -> list[Pod]:
    """Every pod that must run on the system pool, by requests."""
    c = spec.controllers
    kueue = _chart(spec, KUEUE_CHART_PODS, c.kueue_version, "kueueVersion", "Kueue",
                   "kubernetes-sigs/kueue charts/kueue (values.yaml, templates/manager/manager.yaml)")
    jobset = _chart(spec, JOBSET_CHART_PODS, c.jobset_version, "jobsetVersion", "JobSet",
                    "kubernetes-sigs/jobset charts/jobset (values.yaml, templates/controller/deployment.yaml)")
    pods = [Pod(chart.name, chart.requests) for chart in (kueue, jobset) for _ in range(chart.replicas)]
    pods.append(Pod("GKE add-ons", GKE_CLUSTER_ADDONS))
    if spec.runs_on_ray:
        pods.append(ray_head())
    if spec.trainer.enabled and (spec.trainer.stage is not None or hub_splits(spec) is not None):
        pods.append(stage_pod())
    if spec.service is not None:
        # The API's replicas (spread over nodes by preference only, so packing them anywhere is what can happen),
        # the rollout's surge pod beside them on every new image (maxSurge, maxUnavailable 0), each with its gcsfuse
        # sidecar, and the base model's staging Job.
        pods += [api_pod(f"service API {i}") for i in range(spec.service.api_replicas)]
        pods += [api_pod(f"service API rollout surge {i}") for i in range(API_MAX_SURGE)]
        if spec.service.stage_model and not spec.service.suspend:
            pods.append(stage_pod())
    return pods


# ---------------------------------------------------------------- packing


@dataclass
class Fit:
    machine: Machine
    nodes: int
    allocatable: Requests  # per node, GKE's
    free: Requests  # per node, less GKE's node daemons
    pods: list[Pod]
    placed: list[list[Pod]] = field(default_factory=list)  # per node
    unplaced: list[Pod] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.unplaced

    @property
    def requested(self) -> Requests:
        return sum((p.requests for p in self.pods), Requests(0, 0))

    @property
    def pool(self) -> str:
        return (f"{self.nodes} x {self.machine.name}: {self.allocatable} allocatable per node, {self.free} after "
                f"GKE's node daemons")

    def spare(self) -> list[Requests]:
        """What each node has left once the pods are placed."""
        out = []
        for node in self.placed:
            left = self.free
            for p in node:
                left = left - p.requests
            out.append(left)
        return out


def pack(pods: list[Pod], nodes: int, free: Requests) -> tuple[list[list[Pod]], list[Pod]]:
    """First-fit decreasing by each pod's larger share of a node (CPU or memory): (pods per node, pods left over)."""
    def share(p: Pod) -> float:
        return max(p.requests.cpu_m / max(free.cpu_m, 1e-9), p.requests.memory_mib / max(free.memory_mib, 1e-9))

    placed: list[list[Pod]] = [[] for _ in range(nodes)]
    left = [free] * nodes
    unplaced = []
    for pod in sorted(pods, key=share, reverse=True):
        for i in range(nodes):
            if pod.requests.fits_in(left[i]):
                placed[i].append(pod)
                left[i] = left[i] - pod.requests
                break
        else:
            unplaced.append(pod)
    return placed, unplaced


def fit(spec: EnvironmentSpec, machine_type: str | None = None, nodes: int | None = None) -> Fit:
    """The environment's pinned pods packed onto its system pool (or onto another machine type / node count)."""
    m = machine(machine_type or spec.cluster.system_pool.machine_type)
    n = nodes or spec.cluster.system_pool.nodes
    alloc = allocatable(m)
    free = alloc - GKE_NODE_DAEMONS
    pods = pinned_pods(spec)
    placed, unplaced = pack(pods, n, free)
    return Fit(m, n, alloc, free, pods, placed, unplaced)


def _suggestion(spec: EnvironmentSpec, current: Fit) -> str:
    """The next size of the same family and kind that holds the pods, and the fewest nodes of this one that do."""
    m, nodes = current.machine, current.nodes
    _, sizes = MACHINE_FAMILIES[m.family][m.kind]
    bigger = next((f"{m.family}-{m.kind}-{s}" for s in sizes if s > m.vcpus
                   and fit(spec, f"{m.family}-{m.kind}-{s}", nodes).fits), None)
    more = next((n for n in range(nodes + 1, 21) if fit(spec, m.name, n).fits), None)
    options = [f"cluster.systemPool.machineType to {bigger}"] if bigger else []
    if more:
        options.append(f"cluster.systemPool.nodes to {more}")
    if not options:
        return "; no size of this machine type holds them: use a larger family or kind"
    return "; set " + " or ".join(options)


def check(spec: EnvironmentSpec) -> Fit:
    """Refuses (ConfigError) an environment whose system pool cannot hold the pods pinned to it."""
    try:
        machine(spec.cluster.system_pool.machine_type)
    except ValueError as e:  # the spec validated it already; a spec built by hand may not have
        raise _refused(spec.env, f"{MACHINE_KEY}: {e}") from None
    result = fit(spec)
    if result.fits:
        return result
    pods = sorted(result.pods, key=lambda p: p.requests.cpu_m, reverse=True)
    listed = " + ".join(f"{p.name} {p.requests}" for p in pods)
    details = "; ".join(f"{p.name}: {p.detail}" for p in pods if p.detail)
    left = ", ".join(p.name for p in result.unplaced)
    nodes = f"{result.nodes} node{'s' if result.nodes > 1 else ''}"
    raise _refused(spec.env, (
        f"{POOL_KEY}: the system pool ({result.pool}) cannot hold the pods pinned to it: {listed} = "
        f"{result.requested} requested, and a pod cannot span nodes: packed onto {nodes}, {left} find no room"
        + (f" ({details})" if details else "") + _suggestion(spec, result)))
