"""Turns a PlanResult into what a reviewer reads: a resource tree, a summary, and a markdown PR comment."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from infra.checks import grace, placement
from infra.offline import shipped
from infra.offline.cost import EnvironmentCost, environment_cost, slice_groups, system_pool, usd
from infra.offline.mockrun import (
    IMAGE_TYPE,
    MOCK_DNS_SUFFIX,
    MOCK_ENDPOINT,
    MOCK_VERSION_SUFFIX,
    SECRET_MASK,
    PlanResult,
    Resource,
)
from infra.offline.plan import is_kubernetes_object

if TYPE_CHECKING:
    from envspec.config import EnvironmentSpec
    from trainer.fit.preflight import FitReport
    from trainer.fit.search import SearchResult as FitSearch

# ---------------------------------------------------------------- which settings the tree shows, per type

Field = tuple[str, str | Callable[[dict[str, Any]], Any]]  # (label, input path or extractor)


def _segments(path: str) -> list[str]:
    # Label keys contain dots; `\\.` in a path is a literal dot.
    marker = "\x00"
    return [p.replace(marker, ".") for p in path.replace("\\.", marker).split(".")] if path else []


def _walk(data: Any, segments: list[str]) -> Any:
    if data is None or not segments:
        return data
    key, _, index = segments[0].partition("[")
    value = data.get(key) if isinstance(data, dict) and key else (data if not key else None)
    if index:
        index = index.rstrip("]")
        if not isinstance(value, list):
            return None
        if index == "*":
            got = [_walk(v, segments[1:]) for v in value]
            return [g for g in got if g is not None] or None
        i = int(index)
        value = value[i] if -len(value) <= i < len(value) else None
    return _walk(value, segments[1:])


def path_get(data: Any, path: str) -> Any:
    """`a.b[0].c`, with `[*]` mapping over a list and `\\.` a literal dot; None when a step is missing."""
    return _walk(data, _segments(path))


def _capacity(inputs: dict[str, Any]) -> str:
    node = inputs.get("nodeConfig") or {}
    if node.get("spot"):
        return "spot"
    if node.get("flexStart") or path_get(inputs, "queuedProvisioning.enabled"):
        return "flex-start"
    affinity = node.get("reservationAffinity") or {}
    if affinity.get("consumeReservationType") == "SPECIFIC_RESERVATION":
        return "reservation:" + ",".join(affinity.get("values") or [])
    return "on-demand"


def _quota(inputs: dict[str, Any]) -> list[str]:
    out = []
    for group in path_get(inputs, "spec.resourceGroups") or []:
        for flavor in group.get("flavors") or []:
            for res in flavor.get("resources") or []:
                out.append(f"{flavor.get('name')}:{res.get('name')}={res.get('nominalQuota')}")
    return out


def _devices(inputs: dict[str, Any]) -> list[str]:
    out = []
    for req in path_get(inputs, "spec.spec.devices.requests") or []:
        exactly = req.get("exactly") or req
        out.append(f"{exactly.get('deviceClassName')} x{exactly.get('count', 1)}")
    return out


def _secret_keys(inputs: dict[str, Any]) -> list[str]:
    return sorted({*(inputs.get("stringData") or {}), *(inputs.get("data") or {})})


_JOB = "spec.replicatedJobs[*]"
_POD = "spec.replicatedJobs[*].template.spec.template.spec"
_RAY = "spec.rayClusterSpec"
_WORKER = "spec.rayClusterSpec.workerGroupSpecs[*].template.spec"

FIELDS: dict[str, list[Field]] = {
    "gcp:compute/network:Network": [("mtu", "mtu"), ("routing", "routingMode")],
    "gcp:compute/subnetwork:Subnetwork": [
        ("cidr", "ipCidrRange"), ("region", "region"),
        ("secondary", lambda i: [f"{r.get('rangeName')}={r.get('ipCidrRange')}"
                                 for r in i.get("secondaryIpRanges") or []] or None)],
    "gcp:compute/firewall:Firewall": [("direction", "direction"), ("sources", "sourceRanges"),
                                      ("allow", "allows[*].protocol")],
    "gcp:compute/router:Router": [("region", "region")],
    "gcp:compute/routerNat:RouterNat": [("ips", "natIpAllocateOption")],
    "gcp:compute/resourcePolicy:ResourcePolicy": [("workload", "workloadPolicy.type"),
                                                  ("topology", "workloadPolicy.acceleratorTopology")],
    "gcp:container/cluster:Cluster": [
        ("location", "location"), ("channel", "releaseChannel.channel"), ("minVersion", "minMasterVersion"),
        ("datapath", "datapathProvider"), ("multiNetworking", "enableMultiNetworking"),
        ("privateNodes", "privateClusterConfig.enablePrivateNodes"),
        ("workloadPool", "workloadIdentityConfig.workloadPool"),
        ("gcsFuse", "addonsConfig.gcsFuseCsiDriverConfig.enabled"),
        ("rayOperator", "addonsConfig.rayOperatorConfigs[*].enabled"),
        ("authorizedNetworks", "masterAuthorizedNetworksConfig.cidrBlocks[*].cidrBlock"),
        ("dnsEndpoint", "controlPlaneEndpointsConfig.dnsEndpointConfig.allowExternalTraffic"),
        ("deletionProtection", "deletionProtection")],
    "gcp:container/nodePool:NodePool": [
        ("machine", "nodeConfig.machineType"), ("nodes", "nodeCount"), ("initialNodes", "initialNodeCount"),
        ("maxNodes", "autoscaling.totalMaxNodeCount"),
        ("placement", "placementPolicy.type"), ("topology", "placementPolicy.tpuTopology"),
        ("policy", "placementPolicy.policyName"), ("capacity", _capacity),
        ("queuedProvisioning", "queuedProvisioning.enabled"),
        ("extraNetworks", "networkConfig.additionalNodeNetworkConfigs[*].network"),
        ("gvnic", "nodeConfig.gvnic.enabled"), ("disk", "nodeConfig.diskType"), ("labels", "nodeConfig.labels"),
        ("taints", lambda i: [f"{t.get('key')}:{t.get('effect')}"
                              for t in path_get(i, "nodeConfig.taints") or []] or None)],
    "gcp:storage/bucket:Bucket": [
        ("name", "name"), ("location", "location"), ("uniformAccess", "uniformBucketLevelAccess"),
        ("publicAccessPrevention", "publicAccessPrevention"), ("forceDestroy", "forceDestroy"),
        ("versioning", "versioning.enabled"), ("softDeleteSeconds", "softDeletePolicy.retentionDurationSeconds")],
    "gcp:storage/bucketIAMMember:BucketIAMMember": [("bucket", "bucket"), ("role", "role"), ("member", "member")],
    "gcp:projects/iAMMember:IAMMember": [("role", "role"), ("member", "member")],
    "gcp:serviceaccount/account:Account": [("accountId", "accountId")],
    "gcp:serviceaccount/iAMMember:IAMMember": [("role", "role"), ("member", "member")],
    "gcp:artifactregistry/repository:Repository": [("id", "repositoryId"), ("location", "location"),
                                                   ("format", "format")],
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": [
        ("repository", "repository"), ("role", "role"), ("member", "member")],
    IMAGE_TYPE: [("dockerfile", "dockerfile.location"), ("context", "context.location"),
                                 ("platforms", "platforms"), ("tags", "tags"), ("push", "push"),
                                 ("buildOnPreview", "buildOnPreview")],
    "kubernetes:helm.sh/v3:Release": [("chart", "chart"), ("version", "version"), ("namespace", "namespace")],
    "pulumi:providers:kubernetes": [("serverSideApply", "enableServerSideApply")],
    "kubernetes:core/v1:ServiceAccount": [("annotations", "metadata.annotations")],
    "kubernetes:core/v1:Secret": [("type", "type"), ("keys", _secret_keys)],
    "kubernetes:kueue.x-k8s.io/v1beta2:ResourceFlavor": [("nodeLabels", "spec.nodeLabels")],
    "kubernetes:kueue.x-k8s.io/v1beta2:ClusterQueue": [
        ("quota", _quota), ("admissionChecks", "spec.admissionChecksStrategy.admissionChecks[*].name"),
        ("preemption", "spec.preemption.withinClusterQueue")],
    "kubernetes:kueue.x-k8s.io/v1beta2:LocalQueue": [("clusterQueue", "spec.clusterQueue")],
    "kubernetes:kueue.x-k8s.io/v1beta2:WorkloadPriorityClass": [("value", "value")],
    "kubernetes:kueue.x-k8s.io/v1beta2:AdmissionCheck": [("controller", "spec.controllerName")],
    "kubernetes:kueue.x-k8s.io/v1beta2:ProvisioningRequestConfig": [("class", "spec.provisioningClassName")],
    "kubernetes:resource.k8s.io/v1:ResourceClaimTemplate": [("devices", _devices)],
    "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet": [
        ("queue", "metadata.labels.kueue\\.x-k8s\\.io/queue-name"),
        ("priority", "metadata.labels.kueue\\.x-k8s\\.io/priority-class"),
        ("replicas", f"{_JOB}.replicas"), ("parallelism", f"{_JOB}.template.spec.parallelism"),
        ("tpuPerPod", f"{_POD}.containers[0].resources.limits.google\\.com/tpu"),
        ("nodeSelector", f"{_POD}.nodeSelector"), ("maxRestarts", "spec.failurePolicy.maxRestarts"),
        ("image", f"{_POD}.containers[0].image")],
    "kubernetes:batch/v1:Job": [
        ("runs", lambda i: " ".join(path_get(i, "spec.template.spec.containers[0].command") or [])),
        ("pool", "spec.template.spec.nodeSelector"),
    ],
    "kubernetes:ray.io/v1:RayJob": [
        ("queue", "metadata.labels.kueue\\.x-k8s\\.io/queue-name"),
        ("priority", "metadata.labels.kueue\\.x-k8s\\.io/priority-class"),
        ("elastic", "metadata.annotations.kueue\\.x-k8s\\.io/elastic-job"),
        ("slices", lambda i: [f"{g.get('groupName')}={g.get('minReplicas')}..{g.get('maxReplicas')}"
                              for g in path_get(i, f"{_RAY}.workerGroupSpecs") or []] or None),
        ("hostsPerSlice", f"{_RAY}.workerGroupSpecs[*].numOfHosts"),
        ("tpuPerPod", f"{_WORKER}.containers[0].resources.limits.google\\.com/tpu"),
        ("nodeSelector", f"{_WORKER}.nodeSelector"), ("backoffLimit", "spec.backoffLimit"),
        ("image", f"{_WORKER}.containers[0].image")],
}


def _one(value: Any) -> Any:
    # `[*]` over a single replicated job / container reads better unwrapped.
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


# What the offline plan makes up where only GCP can answer (infra/offline/mockrun.py): GKE versions, the API endpoints
# and the built image's digest. Marked, so a reviewer does not take them for what `pulumi up` will get.
MOCK_MARK = " (mock)"
_MOCK_MARKERS = (MOCK_ENDPOINT, MOCK_DNS_SUFFIX, MOCK_VERSION_SUFFIX)


def _mark_mock(value: str, built_image: bool) -> str:
    mocked = any(m in value for m in _MOCK_MARKERS) or (built_image and "@sha256:" in value)
    return value + MOCK_MARK if mocked else value


def builds_image(result: PlanResult) -> bool:
    """The stack builds the trainer image, so its digest in the plan is a stand-in."""
    return not result.spec.trainer.image and bool(result.of_type(IMAGE_TYPE))


def settings_of(resource: Resource, built_image: bool = False) -> list[tuple[str, str]]:
    """The (label, value) pairs the tree shows for a resource: its type's table, plus protection flags."""
    out: list[tuple[str, str]] = []
    fields = FIELDS.get(resource.type, [])
    if resource.type.startswith("kubernetes:") and not resource.type.startswith("kubernetes:helm.sh/"):
        fields = [("namespace", "metadata.namespace"), *fields]
    for label, getter in fields:
        value = getter(resource.inputs) if callable(getter) else path_get(resource.inputs, getter)
        value = _one(value)
        if value is not None and value != [] and value != {}:
            out.append((label, _mark_mock(fmt(value), built_image)))
    for flag in ("protect", "retainOnDelete"):
        if resource.options.get(flag):
            out.append((flag, "true"))
    return out


# ---------------------------------------------------------------- tree


def _label(resource: Resource, built_image: bool) -> Text:
    text = Text()
    text.append(resource.name, style="bold")
    text.append(f"  {resource.type}", style="cyan" if resource.custom else "magenta")
    for key, value in settings_of(resource, built_image):
        text.append(f"  {key}=", style="dim")
        text.append(value, style="red" if value == SECRET_MASK else "")
    return text


def resource_tree(result: PlanResult) -> Tree:
    tree = Tree(Text(f"{result.stack_urn.rsplit('::', 1)[-1]}  pulumi:pulumi:Stack", style="bold"))
    nodes, built = {result.stack_urn: tree}, builds_image(result)
    for r in result.resources:  # parents come before children (depth-first order)
        nodes[r.urn] = nodes.get(r.parent or result.stack_urn, tree).add(_label(r, built))
    return tree


def plain(renderable: Any, width: int = 400) -> str:
    """Renders without colour at a width no line reaches, so text is stable for golden files."""
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False, no_color=True,
            legacy_windows=False, emoji=False, highlight=False).print(renderable, soft_wrap=True)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


# ---------------------------------------------------------------- summary


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


@dataclass(frozen=True)
class SliceRow:
    group: str
    tpu_type: str
    topology: str
    machine_type: str
    slices: int
    hosts_per_slice: int
    chips_per_host: int
    chips_per_slice: int
    capacity: str
    price: str  # list price of the whole group per hour, or "no price"

    @property
    def hosts(self) -> int:
        return self.slices * self.hosts_per_slice

    @property
    def chips(self) -> int:
        return self.slices * self.chips_per_slice


@dataclass(frozen=True)
class Summary:
    env: str
    project: str
    zone: str
    cluster: str
    slices: list[SliceRow]
    chips_by_type: dict[str, int]
    peak_bf16_pflops: float
    hbm_gib: int
    networks: list[str]
    buckets: list[str]
    queues: list[str]
    controllers: list[str]
    trainer: str | None
    service: str | None
    resources: int
    kubernetes_objects: int
    cost: EnvironmentCost
    warnings: list[str]  # settings that cost performance against the shipped examples (infra/offline/shipped.py)

    @property
    def total_slices(self) -> int:
        return sum(r.slices for r in self.slices)

    @property
    def total_hosts(self) -> int:
        return sum(r.hosts for r in self.slices)

    @property
    def total_chips(self) -> int:
        return sum(self.chips_by_type.values())

    def facts(self) -> list[tuple[str, str]]:
        """One (label, text) line per fact, shared by the text and markdown renderings."""
        chips = ", ".join(f"{t}: {n}" for t, n in self.chips_by_type.items())
        return [
            ("TPU", f"{_n(self.total_slices, 'slice')}, {_n(self.total_hosts, 'host')}, "
                    f"{_n(self.total_chips, 'chip')} ({chips}); "
                    f"peak {self.peak_bf16_pflops:g} PFLOP/s bf16, {self.hbm_gib} GiB HBM"),
            ("Networks", "; ".join(self.networks) or "none"),
            ("Buckets", "; ".join(self.buckets) or "none"),
            ("Queues", "; ".join(self.queues) or "none"),
            ("Controllers", "; ".join(self.controllers) or "none"),
            ("Cost", self.cost.line()),
            ("Trainer", self.trainer or "disabled"),
            *([("Service", self.service)] if self.service else []),
            ("Resources", f"{self.resources} registered, {self.kubernetes_objects} Kubernetes objects"),
        ]


def summarize(result: PlanResult) -> Summary:
    """Slice facts come from the spec through the TPU catalog; names of what exists come from the resources."""
    spec = result.spec
    rows = []
    chips_by_type: dict[str, int] = {}
    pflops = 0.0
    hbm = 0
    costs = environment_cost(slice_groups(spec), spec.region, pool=system_pool(spec))
    for g, c in zip(spec.slices, costs.groups, strict=True):
        shape = g.shape
        capacity = f"reservation:{g.reservation}" if g.capacity == "reservation" else g.capacity
        price = "no price" if c.usd_per_hour is None else f"{usd(c.usd_per_hour)} ({c.basis})"
        rows.append(SliceRow(g.name, g.tpu_type, g.topology, shape.machine_type, g.count, shape.hosts,
                             shape.chips_per_host, shape.chips, capacity, price))
        chips_by_type[g.tpu_type] = chips_by_type.get(g.tpu_type, 0) + g.count * shape.chips
        pflops += g.count * shape.peak_bf16_tflops / 1000
        hbm += g.count * shape.hbm_gib

    networks = []
    for net in result.of_type("gcp:compute/network:Network"):
        # A subnet's `network` input is the network's id; its dependencies name the network's URN.
        subnets = [s for s in result.of_type("gcp:compute/subnetwork:Subnetwork")
                   if net.urn in s.options.get("dependsOn", [])]
        cidrs = ",".join(s.inputs.get("ipCidrRange", "?") for s in subnets)
        networks.append(f"{net.name} (mtu {net.inputs.get('mtu', 'default')}{', ' + cidrs if cidrs else ''})")
    buckets = []
    for b in result.of_type("gcp:storage/bucket:Bucket"):
        kept = "kept on destroy" if b.options.get("retainOnDelete") or b.options.get("protect") else (
            "force-destroy" if b.inputs.get("forceDestroy") else "deleted on destroy")
        buckets.append(f"gs://{b.inputs.get('name', b.name)} ({b.inputs.get('location', '?')}, {kept})")
    queues = []
    for cq in result.of_type("kubernetes:kueue.x-k8s.io/v1beta2:ClusterQueue"):
        queues.append(f"ClusterQueue {cq.inputs['metadata']['name']} [{', '.join(_quota(cq.inputs))}]")
    for lq in result.of_type("kubernetes:kueue.x-k8s.io/v1beta2:LocalQueue"):
        meta = lq.inputs["metadata"]
        queues.append(f"LocalQueue {meta.get('namespace')}/{meta['name']}")
    priorities = sorted(result.of_type("kubernetes:kueue.x-k8s.io/v1beta2:WorkloadPriorityClass"),
                        key=lambda p: p.inputs.get("value", 0))
    if priorities:
        queues.append("priorities " + ", ".join(f"{p.inputs['metadata']['name']}={p.inputs.get('value')}"
                                                for p in priorities))
    controllers = [f"{r.inputs.get('name', r.name)} {r.inputs.get('version', '?')}"
                   for r in result.of_type("kubernetes:helm.sh/v3:Release")]
    trainer = None
    group = spec.trainer_group
    if spec.trainer.enabled and group is not None:
        t = spec.trainer
        pods = f"{_n(t.slices * group.shape.hosts, 'pod')} x {group.shape.chips_per_host} chips"
        if t.launcher == "ray":
            trainer = (f"RayJob {spec.queues.namespace}/{t.name} (elastic): {spec.ray_min_slices}..{t.slices} x "
                       f"{group.name} ({group.topology}), at most {pods}, priority {t.priority}, up to "
                       f"{t.max_failures} Ray Train restarts then {t.max_restarts} RayJob retries, config "
                       f"{t.config or 'demo.yaml'}")
        else:
            trainer = (f"JobSet {spec.queues.namespace}/{t.name}: {t.slices} x {group.name} ({group.topology}) = "
                       f"{pods}, priority {t.priority}, max {t.max_restarts} restarts, config "
                       f"{t.config or 'demo.yaml'}")
        split = placement.line(spec)
        if split is not None:
            trainer += f"; {split}"
        if t.launcher == "ray":
            trainer += "; any change replaces it, resuming from its last periodic checkpoint"
        else:
            found = grace.estimate(spec)
            need = f", a SIGTERM checkpoint needs about {found.seconds} s" if found else ""
            trainer += (f"; any change replaces it, resuming from the checkpoint it saves on SIGTERM (grace period "
                        f"{t.termination_grace_seconds} s{need})")
    return Summary(
        env=result.env, project=spec.project, zone=spec.zone, cluster=spec.cluster_name, slices=rows,
        chips_by_type=dict(sorted(chips_by_type.items())), peak_bf16_pflops=round(pflops, 2), hbm_gib=hbm,
        networks=networks, buckets=buckets, queues=queues, controllers=controllers, trainer=trainer,
        service=_service_fact(spec),
        resources=len(result.resources), kubernetes_objects=sum(is_kubernetes_object(r) for r in result.resources),
        cost=costs, warnings=shipped.warnings(spec))


def _service_fact(spec: EnvironmentSpec) -> str | None:
    """The service in one line: the API, the engine (or that it is suspended) and the store."""
    svc, group = spec.service, spec.service_group
    if svc is None or group is None:
        return None
    ns = spec.queues.namespace
    access = "kubectl port-forward" + (f", internal load balancer for {', '.join(svc.access.allowed_cidrs)}"
                                       if svc.access.internal_load_balancer else "")
    engine = ("suspended (no engine: requests queue until it is back)" if svc.suspend else
              f"JobSet {ns}/{spec.service_engine_name} on 1 x {group.name} ({group.topology}), priority "
              f"{svc.priority}, restarted without limit on preemption, config {svc.config}; a restart restores every "
              "model from its last snapshot")
    db = svc.database
    return (f"API Deployment {ns}/{spec.service_api_name} x {svc.api_replicas} on the system pool ({access}); engine "
            f"{engine}; store Cloud SQL {db.version} {db.tier} {db.availability}, private IP, IAM auth, "
            f"{db.backup_retention_days} days of backups{', deletion-protected' if spec.sql_protected else ''}")


_SLICE_HEADERS = ("group", "tpu", "topology", "machine", "slices", "hosts/slice", "chips/host", "chips/slice",
                  "chips", "capacity", "list $/hour")


def _slice_cells(row: SliceRow) -> list[str]:
    return [row.group, row.tpu_type, row.topology, row.machine_type, str(row.slices), str(row.hosts_per_slice),
            str(row.chips_per_host), str(row.chips_per_slice), str(row.chips), row.capacity, row.price]


def _outputs_lines(result: PlanResult) -> list[tuple[str, str]]:
    built = builds_image(result)
    return [(k, _mark_mock(fmt(v), built)) for k, v in result.outputs.items()]


MOCK_LEGEND = ("Values marked (mock) are the offline plan's stand-ins for what only GCP knows (GKE versions, API "
               "endpoints, the built image's digest); `pulumi up` gets the real ones.")


# ---------------------------------------------------------------- whole plans


def print_fit(report: FitReport, console: Console) -> None:
    """`gke-tpu-rl fit`'s report (also `plan --fit`): headline, one row per program, the step's MFU, notes."""
    console.rule(Text(f"fit: {report.title}", style="bold"))
    for line in report.headline():
        console.print(line, highlight=False)
    table = Table(*report.headers(), title="Per-program HBM (per " + report.unit + "), FLOPs and time per RL step",
                  title_justify="left")
    styles = {"fits": "green", "tight": "yellow", "does not fit": "bold red", "skipped": "dim"}
    for row, p in zip(report.rows(), report.programs, strict=True):
        table.add_row(*row[:-1], Text(row[-1], style=styles.get(report.status(p), "")))
    console.print(table)
    console.print(Text(report.summary_line(), style="bold"))
    for line in report.split_lines():
        console.print(line, highlight=False)
    for w in report.warnings():
        console.print(Text.assemble(("warning: ", "bold yellow"), w))
    for e in report.errors():
        console.print(Text(e) if e.startswith("  ") else Text.assemble(("error: ", "bold red"), e))
    for n in report.notes():
        console.print(Text(n, style="dim"))


def print_fit_search(result: FitSearch, console: Console) -> None:
    """`gke-tpu-rl fit --search`'s outcome, after the report of the config it ends on: the settings to add (or why
    there are none) and every configuration it compiled."""
    head, *rest = result.lines()
    console.print(Text(head, style="bold green" if result.found else "bold red"))
    for line in rest:
        console.print(Text(line, style="bold" if line.startswith("  --set") else ""), highlight=False)


def print_text(result: PlanResult, console: Console, fit: FitReport | None = None) -> None:
    s = summarize(result)
    console.rule(Text(f"plan: {s.env}  (cluster {s.cluster}, project {s.project}, zone {s.zone})", style="bold"))
    table = Table(*_SLICE_HEADERS, title="TPU slices", title_justify="left")
    for row in s.slices:
        table.add_row(*_slice_cells(row))
    console.print(table)
    for label, text in s.facts():
        console.print(Text.assemble((f"{label}: ", "bold"), text))
    for w in s.warnings:
        console.print(Text.assemble(("warning: ", "bold yellow"), w))
    console.print()
    console.print(resource_tree(result))
    console.print()
    console.print(Text("Stack outputs", style="bold"))
    for key, value in _outputs_lines(result):
        console.print(Text.assemble(f"  {key}: ", (value, "red" if value == SECRET_MASK else "")))
    console.print(Text(MOCK_LEGEND, style="dim"))
    if fit is not None:
        console.print()
        print_fit(fit, console)


def text(result: PlanResult, width: int = 400, fit: FitReport | None = None) -> str:
    buf = io.StringIO()
    print_text(result, Console(file=buf, width=width, color_system=None, no_color=True, force_terminal=False,
                               emoji=False, highlight=False, legacy_windows=False), fit)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def _md_cell(value: str) -> str:
    return value.replace("|", "\\|")


def markdown(result: PlanResult, fit: FitReport | None = None) -> str:
    """A block fit for a PR comment: summary up front (with `fit`, the trainer's preflight after it), the full
    tree and outputs folded away."""
    s = summarize(result)
    lines = [f"### gke-tpu-rl plan: `{s.env}`", "",
             f"Cluster `{s.cluster}` in project `{s.project}`, zone `{s.zone}`.", "",
             "| " + " | ".join(_SLICE_HEADERS) + " |", "|" + "---|" * len(_SLICE_HEADERS)]
    lines += ["| " + " | ".join(_md_cell(c) for c in _slice_cells(row)) + " |" for row in s.slices]
    lines.append("")
    lines += [f"- **{label}**: {_md_cell(text)}" for label, text in s.facts()]
    lines += [f"- **Warning**: {_md_cell(w)}" for w in s.warnings]
    if fit is not None:
        lines += ["", fit.markdown(heading="####").rstrip("\n")]
    lines += ["", f"<details><summary>Resource tree ({s.resources} resources)</summary>", "", "```text",
              plain(resource_tree(result)).rstrip("\n"), "```", "", "</details>", "",
              "<details><summary>Stack outputs</summary>", ""]
    lines += [f"- `{k}`: `{v.removesuffix(MOCK_MARK)}`" + (" (mock)" if v.endswith(MOCK_MARK) else "")
              for k, v in _outputs_lines(result)]
    lines += ["", MOCK_LEGEND, "", "</details>", ""]
    return "\n".join(lines)
