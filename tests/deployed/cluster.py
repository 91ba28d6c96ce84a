"""The objects an environment's plan renders, run on this machine as Kubernetes and JobSet v0.12 would run them.

Each container is its rendered command and args with its rendered env and volumes (tests/deployed/sandbox.py), and
each exit code is judged by the rendered policies, as the upstream controllers judge them:

- Pod (kubelet): a container's exit code is its process's, 128 + n after a signal n. Deletion: the preStop hook,
  then SIGTERM, then SIGKILL after terminationGracePeriodSeconds. restartPolicy Always (a Deployment's pods)
  restarts the container in place after CrashLoopBackOff's delay (kubelet: 10 s doubling to 300 s,
  pkg/kubelet/kubelet.go MaxContainerBackOff). Probes (pkg/kubelet/prober): httpGet on the named port's
  containerPort, 200-399 is success, timeoutSeconds, periodSeconds, failureThreshold; liveness and readiness only once
  the startup probe has succeeded; a failed startup or liveness probe restarts the container; readiness gates the
  Service's endpoints.
- Job (k8s 1.34 pkg/controller/job): Indexed pods per completion index with `parallelism` at a time; a failed pod is
  matched against podFailurePolicy's rules in order (pod_failure_policy.go matchPodFailurePolicy: onExitCodes over
  the named container's exit code, exit code 0 never matches; FailJob / Ignore / Count); FailJob fails the Job with
  reason PodFailurePolicy at once; a counted failure beyond backoffLimit fails it with BackoffLimitExceeded;
  otherwise the pod is replaced after the pod-failure back-off (10 s doubling, DefaultJobPodFailureBackOff). A
  failed Job's other pods are deleted. All indexes succeeded: Complete.
- JobSet (v0.12.0 pkg/controllers/jobset_controller.go and failure_policy.go): one Job per replicated Job replica,
  named <jobset>-<replicatedJob>-<index>, pods labelled and annotated with jobset-name, replicatedjob-name,
  job-index, job-global-index, restart-attempt; pod hostname <job>-<completion index>, subdomain
  spec.network.subdomain (default the JobSet's name). A failed Job: the first rule of failurePolicy.rules whose
  onJobFailureReasons (empty: any) and targetReplicatedJobs (empty: any) match decides; no rule: RestartJobSet.
  RestartJobSet fails the JobSet once restartsCountTowardsMax reached maxRestarts (reason ReachedMaxRestarts),
  otherwise deletes every Job (Recreate) and creates them again with restart-attempt + 1;
  RestartJobSetAndIgnoreMaxRestarts does the same without counting; FailJobSet fails it. successPolicy All: every
  Job of targetReplicatedJobs Complete completes the JobSet.
- Deployment: `replicas` pods that restart in place; Service: a TCP proxy on 127.0.0.1 per port to the Ready pods
  its selector matches.
- RayJob (KubeRay 1.7, tests/deployed/kuberay.py): the head pod with the submitter sidecar and the worker pods KubeRay
  makes, the head Services' DNS names to the head pod, KubeRay's token Secret; once the submitter has exited, the
  Ray job's status from the dashboard (as the RayJob controller reads it) completes or fails the RayJob, and
  shutdownAfterJobFinishes deletes its pods. Init containers run in order before a pod's containers.
- pulumi up: objects created in the plan's order, each once the resources it dependsOn are ready (a Job: Complete,
  as pulumi-kubernetes' Job await; a Deployment: its replicas Ready).

Not emulated: Kueue's admission (the queues have the quota these workloads ask for), node scheduling and
resources, NetworkPolicy, the GCS FUSE sidecar (the bucket is a local folder, tests/deployed/sandbox.py: a volume's
only-dir its sub-folder, readOnly a read-only bind mount; a pod without the annotation that injects the sidecar is
refused, as the CSI driver refuses its mount).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import sharing_compiles
from tests.deployed import kuberay as K
from tests.deployed import sandbox as S

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
GCSFUSE_INJECT = "gke-gcsfuse/volumes"
IMAGE_ENTRYPOINT = ["python", "-m", "trainer"]  # trainer/Dockerfile ENTRYPOINT
TPU_RESOURCE = "google.com/tpu"
CRASH_BACKOFF_S = (10.0, 300.0)  # kubelet: initial, max
JOB_BACKOFF_S = (10.0, 360.0)  # job controller: DefaultJobPodFailureBackOff, MaxJobPodFailureBackOff
# Env vars that name another pod by its DNS name (trainer/run/distributed.py, libtpu's multislice).
HOST_VARS = ("COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


class HarnessError(Exception):
    """A rendered object this harness (and so the cluster) cannot run as written: the message names it."""


@dataclass
class Boundary:
    """What stands in for GCP and the Hub at their edge (tests/deployed/gcp.py GcpBoundary has the same shape):
    host names for every pod's /etc/hosts, env every container gets on top of its own (certificate bundles, the
    metadata server's address, the Hub mirror), folders mounted into every container (the mirror), the identity a
    pod's KSA has, projected tokens."""

    hosts: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)  # container path -> local folder

    def add_pod(self, ip: str, namespace: str, service_account: str, gcp_service_account: str | None, *,
                host_network: bool = False) -> None:
        pass

    def projected_token(self, audience: str, namespace: str, service_account: str) -> str:
        return "token"


@dataclass
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    owner: str
    hostname: str | None = None
    subdomain: str | None = None
    ip: str = ""
    netns: str = ""
    containers: list[S.Container] = field(default_factory=list)
    phase: str = "Pending"  # Pending, Running, Succeeded, Failed
    started: float = 0.0
    ready: bool = False
    started_probe_ok: bool = False
    deleting: float | None = None  # when SIGTERM was sent
    restart_at: float | None = None  # restartPolicy Always: when the crashed container starts again
    probe_failures: dict[str, int] = field(default_factory=dict)
    next_probe: dict[str, float] = field(default_factory=dict)
    ran_since: float = 0.0
    removing: bool = False  # deleted (not a liveness kill): gone once its containers have exited
    init: list[S.Container] = field(default_factory=list)  # init containers not yet succeeded, in order

    @property
    def restart_always(self) -> bool:
        return self.spec.get("restartPolicy", "Always") == "Always"

    def exit_codes(self) -> dict[str, int | None]:
        return {c.name: c.poll() for c in self.containers}

    def processes(self) -> list[S.Container]:
        """The containers that run or ran: the init container in progress, else the pod's containers."""
        return self.init[:1] or self.containers


@dataclass
class Job:
    name: str
    namespace: str
    spec: dict[str, Any]
    labels: dict[str, str]
    annotations: dict[str, str]
    hostname_prefix: str | None = None  # JobSet: pods get <job>-<index> as hostname
    subdomain: str | None = None
    pods: list[Pod] = field(default_factory=list)
    succeeded: set[int] = field(default_factory=set)
    failed: int = 0
    status: str = "Active"  # Active, Complete, Failed
    reason: str = ""
    message: str = ""
    waiting: dict[int, float] = field(default_factory=dict)  # index -> when its next pod may start
    failed_at: float = 0.0

    @property
    def completions(self) -> int:
        return int(self.spec.get("completions", 1))

    @property
    def indexed(self) -> bool:
        return self.spec.get("completionMode") == "Indexed"


@dataclass
class JobSet:
    name: str
    namespace: str
    obj: dict[str, Any]
    jobs: list[Job] = field(default_factory=list)
    restarts: int = 0
    restarts_toward_max: int = 0
    status: str = "Active"  # Active, Completed, Failed
    reason: str = ""
    message: str = ""
    recreating: bool = False
    history: list[str] = field(default_factory=list)  # each restart's cause, for the scenarios' messages


class Cluster:
    """Runs rendered objects. `work` holds every pod's folders and logs and the buckets' folders."""

    def __init__(self, objects: list[dict[str, Any]], work: Path, *, boundary: Boundary | None = None,
                 secrets: Mapping[str, str] | None = None, cpu_devices: int = 1,
                 depends_on: Mapping[str, list[str]] | None = None, time_scale: float = 1.0,
                 mounts: Mapping[str, str] | None = None, network: S.Network | None = None) -> None:
        """objects: the plan's Kubernetes objects, in its order. secrets: Pulumi secret config values by the
        masked Secret data they stand for (`[secret]` in the plan), key = "<secret name>/<key>". cpu_devices: CPU
        devices of a pod that asks for TPU chips (TRAINER_CPU_DEVICES: what a user runs locally in place of chips).
        depends_on: "<kind>/<name>" -> the "<kind>/<name>" it waits for (the Pulumi program's dependsOn).
        time_scale: multiplies the controllers' back-off delays (1.0: Kubernetes' own). mounts: container path ->
        local folder, in every container (the boundary's own folders, e.g. the Hub mirror)."""
        self.objects = objects
        self.work = work
        self.boundary: Any = boundary or Boundary()
        self.mounts = dict(mounts or {})
        self.secrets = dict(secrets or {})
        self.cpu_devices = cpu_devices
        keys = {self._key(o) for o in objects}
        self.depends_on = {k: [d for d in v if d in keys] for k, v in (depends_on or {}).items()}
        self.time_scale = time_scale
        self.pods: dict[str, Pod] = {}
        self.jobs: dict[str, Job] = {}
        self.jobsets: dict[str, JobSet] = {}
        self.deployments: dict[str, dict[str, Any]] = {}
        self.rayjobs: dict[str, K.RayJobRun] = {}
        self.generated: list[dict[str, Any]] = []  # what controllers make (KubeRay's token Secret)
        self.service_hosts: dict[str, str] = {}  # a Service's DNS name -> the pod behind it (headless, one pod)
        self.created: set[str] = set()
        self.events: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ips: dict[str, tuple[str, str]] = {}  # pod name -> (ip, netns): one address per pod name
        self._rr = itertools.count()
        self.services: dict[str, int] = {}  # "<service>:<port>" -> local port
        self._proxies: list[socket.socket] = []
        self.dry = False
        self.net: S.Network | None = network  # made here unless the boundary needed the bridge first
        self.error: Exception | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Cluster:
        if (why := S.can_run()) is not None:
            raise HarnessError(why)
        self.work.mkdir(parents=True, exist_ok=True)
        self.net = self.net or S.Network()
        self._thread = threading.Thread(target=self._loop, name="cluster", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            for pod in self.pods.values():
                for c in [*pod.init, *pod.containers]:
                    c.signal(signal.SIGKILL)
            for pod in self.pods.values():
                for c in [*pod.init, *pod.containers]:
                    if c.proc is not None:
                        with contextlib.suppress(Exception):
                            c.proc.wait(10)
        for s in self._proxies:
            with contextlib.suppress(OSError):
                s.close()
        if self.net is not None:
            self.net.close()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _event(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    # ------------------------------------------------------------------ objects

    def _key(self, obj: dict[str, Any]) -> str:
        return f"{obj['kind']}/{obj['metadata']['name']}"

    def _ready(self, key: str) -> bool:
        kind, _, name = key.partition("/")
        if key not in self.created:
            return False
        if kind == "Job":
            return self.jobs[name].status == "Complete"
        if kind == "Deployment":
            want = int(self.deployments[name]["spec"].get("replicas", 1))
            return sum(p.ready for p in self.pods.values() if p.owner == f"Deployment/{name}") >= want
        return True

    def _create_pending(self) -> None:
        for obj in self.objects:
            key = self._key(obj)
            if key in self.created or not all(self._ready(d) for d in self.depends_on.get(key, [])):
                continue
            self.created.add(key)
            self._event(f"create {key}")
            kind = obj["kind"]
            if kind == "Job":
                self._create_job(obj["metadata"]["name"], obj["metadata"].get("namespace", "default"), obj["spec"],
                                 dict(obj["metadata"].get("labels", {})), {})
            elif kind == "JobSet":
                self._create_jobset(obj)
            elif kind == "Deployment":
                self.deployments[obj["metadata"]["name"]] = obj
                self._scale_deployment(obj)
            elif kind == "Service":
                self._serve(obj)
            elif kind == "RayJob":
                self._create_rayjob(obj)

    def secret_value(self, name: str, key: str) -> str:
        for obj in [*self.objects, *self.generated]:
            if obj["kind"] == "Secret" and obj["metadata"]["name"] == name:
                if (v := obj.get("stringData", {}).get(key)) is not None:
                    return self.secrets.get(f"{name}/{key}", v) if v == "[secret]" else v
                if (v := obj.get("data", {}).get(key)) is not None:
                    return self.secrets.get(f"{name}/{key}") or base64.b64decode(v).decode()
                raise HarnessError(f"Secret {name} has no key {key!r}")
        raise HarnessError(f"no rendered Secret {name!r}")

    def service_account(self, name: str, namespace: str) -> dict[str, Any]:
        for obj in self.objects:
            if obj["kind"] == "ServiceAccount" and obj["metadata"]["name"] == name \
                    and obj["metadata"].get("namespace") == namespace:
                return obj
        raise HarnessError(f"pods run as ServiceAccount {namespace}/{name}, which the plan does not render")

    # ------------------------------------------------------------------ pods

    def _pod(self, name: str, namespace: str, template: dict[str, Any], owner: str, labels: dict[str, str],
             annotations: dict[str, str], hostname: str | None = None, subdomain: str | None = None) -> Pod:
        meta = template.get("metadata", {})
        pod = Pod(name=name, namespace=namespace, labels={**meta.get("labels", {}), **labels},
                  annotations={**meta.get("annotations", {}), **annotations}, spec=template["spec"], owner=owner,
                  hostname=hostname, subdomain=subdomain)
        if self.dry:
            pod.ip = f"{S.POD_NET}.255.{len(self.pods) % 250 + 2}"
            self.pods[name] = pod
            return pod
        assert self.net is not None
        if name not in self._ips:
            self._ips[name] = (self.net.add(name), f"gtr-{name}")
        pod.ip, pod.netns = self._ips[name]
        self.pods[name] = pod
        self._start_pod(pod)
        return pod

    def dry_run(self) -> dict[str, list[S.Container]]:
        """Every pod of every workload as it would start (all at once, ignoring dependsOn and policies), each
        container resolved as the runtime would resolve it, without starting anything: raises HarnessError for
        what the cluster could not run (an env ref, a volume, a mount, a host name no pod has)."""
        self.dry = True
        self.work.mkdir(parents=True, exist_ok=True)
        for obj in self.objects:
            self.created.add(self._key(obj))
            if obj["kind"] == "Job":
                self._create_job(obj["metadata"]["name"], obj["metadata"].get("namespace", "default"), obj["spec"],
                                 dict(obj["metadata"].get("labels", {})), {})
            elif obj["kind"] == "JobSet":
                self._create_jobset(obj)
            elif obj["kind"] == "Deployment":
                self._scale_deployment(obj)
            elif obj["kind"] == "RayJob":
                self._create_rayjob(obj)
        names = self._dns_names()
        out = {}
        for pod in self.pods.values():
            folder = self.work / "pods" / pod.name
            folder.mkdir(parents=True, exist_ok=True)
            self.service_account(pod.spec.get("serviceAccountName", "default"), pod.namespace)
            volumes = self._volumes(pod, folder)
            out[pod.name] = [self._container(pod, c, volumes, folder) for c in [*pod.spec.get("initContainers", []),
                                                                                 *pod.spec["containers"]]]
            for c in out[pod.name]:
                for var in HOST_VARS:
                    if var in c.env:
                        host = c.env[var].rsplit(":", 1)[0] if ":" in c.env[var] else c.env[var]
                        if host not in names:
                            raise HarnessError(f"pod {pod.name}: {var}={c.env[var]} names a host no pod of the "
                                               f"plan has (pods' DNS names: {sorted(names)[:6]}...)")
        return out

    def _dns_names(self) -> dict[str, str]:
        names: dict[str, str] = {}
        for pod in self.pods.values():
            if pod.hostname and pod.subdomain:
                for suffix in ("", f".{pod.namespace}", f".{pod.namespace}.svc", f".{pod.namespace}.svc.cluster.local"):
                    names[f"{pod.hostname}.{pod.subdomain}{suffix}"] = pod.ip
        for service, pod_name in self.service_hosts.items():
            if (pod := self.pods.get(pod_name)) is not None:
                name, _, namespace = service.partition(".")
                for suffix in ("", f".{namespace}", f".{namespace}.svc", f".{namespace}.svc.cluster.local"):
                    names[f"{name}{suffix}"] = pod.ip
        return names

    def _start_pod(self, pod: Pod) -> None:
        folder = self.work / "pods" / pod.name
        if folder.exists():
            shutil.rmtree(folder)  # a new pod of the same name: new emptyDirs, a new writable layer
        folder.mkdir(parents=True)
        ksa = pod.spec.get("serviceAccountName", "default")
        gsa = self.service_account(ksa, pod.namespace)["metadata"].get("annotations", {}).get(
            "iam.gke.io/gcp-service-account")
        self.boundary.add_pod(pod.ip, pod.namespace, ksa, gsa, host_network=bool(pod.spec.get("hostNetwork")))
        # The cluster's DNS only under ClusterFirst on the pod network or ClusterFirstWithHostNet (a host-network pod
        # with ClusterFirst falls back to the node's resolver, k8s pkg/kubelet/network/dns getPodDNSType).
        policy = pod.spec.get("dnsPolicy", "ClusterFirst")
        cluster_dns = policy == "ClusterFirstWithHostNet" or (policy == "ClusterFirst" and not pod.spec.get(
            "hostNetwork"))
        hosts = {**self.boundary.hosts, **(self._dns_names() if cluster_dns else {})}
        hosts[pod.hostname or pod.name] = pod.ip  # the kubelet's /etc/hosts line for the pod's own hostname
        S.write_hosts(pod.netns, hosts)
        volumes = self._volumes(pod, folder)
        pod.init = [self._container(pod, c, volumes, folder) for c in pod.spec.get("initContainers", [])]
        pod.containers = [self._container(pod, c, volumes, folder) for c in pod.spec["containers"]]
        for c in [*pod.init, *pod.containers]:
            c.hostname = pod.hostname or pod.name
        self._event(f"start pod {pod.name} ({pod.ip})")
        if pod.init:
            pod.init[0].start(pod.netns, folder)  # Pending until every init container has succeeded, in order
        else:
            self._run_containers(pod)

    def _run_containers(self, pod: Pod) -> None:
        for c in pod.containers:
            c.start(pod.netns, self.work / "pods" / pod.name)
        pod.phase, pod.started, pod.ran_since = "Running", time.monotonic(), time.monotonic()
        pod.ready = pod.started_probe_ok = False

    def _tick_init(self, pod: Pod) -> None:
        """kubelet (pkg/kubelet/kuberuntime/kuberuntime_container.go computeInitContainerActions): the next init
        container once one exits 0; a failed one restarts after the back-off unless the pod's restartPolicy is Never,
        which fails the pod."""
        c = pod.init[0]
        code = c.poll()
        if code is None or pod.deleting is not None:
            return
        if code == 0:
            pod.init.pop(0)
            if pod.init:
                pod.init[0].start(pod.netns, self.work / "pods" / pod.name)
            else:
                self._run_containers(pod)
            return
        if pod.spec.get("restartPolicy", "Always") == "Never":
            pod.phase = "Failed"
            pod.init.clear()
            self._event(f"pod {pod.name}: init container {c.name} exited {code}: pod Failed")
            return
        if pod.restart_at is None:  # CrashLoopBackOff, as for any container
            base, cap = CRASH_BACKOFF_S
            pod.restart_at = time.monotonic() + min(base * 2 ** c.restarts, cap) * self.time_scale
        elif time.monotonic() >= pod.restart_at:
            pod.restart_at = None
            c.restarts += 1
            c.start(pod.netns, self.work / "pods" / pod.name)

    def _volumes(self, pod: Pod, folder: Path) -> dict[str, tuple[str, bool]]:
        """volume name -> (local folder, read-only)."""
        out: dict[str, tuple[str, bool]] = {}
        sec = pod.spec.get("securityContext", {})
        for vol in pod.spec.get("volumes", []):
            name = vol["name"]
            if "emptyDir" in vol:
                path = folder / "volumes" / name
                path.mkdir(parents=True)
                os.chmod(path, 0o777)  # emptyDir: world-writable (kubelet's 0777)
                out[name] = (str(path), False)
            elif "csi" in vol and vol["csi"].get("driver") == GCSFUSE_DRIVER:
                if pod.annotations.get(GCSFUSE_INJECT, "").lower() != "true":
                    # gcs-fuse-csi-driver pkg/csi_driver/node.go NodePublishVolume: no sidecar, no mount ("failed to
                    # find the sidecar container in Pod spec"); pkg/webhook/mutatingwebhook.go Handle injects it only
                    # into a pod with this annotation (on the pod itself: a Deployment's or Job's template).
                    raise HarnessError(f"pod {pod.name}: GCS FUSE volume {name} without the pod annotation "
                                       f"{GCSFUSE_INJECT}: \"true\", so no sidecar is injected and the mount fails")
                attrs = vol["csi"].get("volumeAttributes", {})
                bucket = attrs["bucketName"]
                opts = dict(o.partition("=")[::2] for o in attrs.get("mountOptions", "").split(",") if o)
                # only-dir: gcsfuse shows that prefix of the bucket as the mount's root (gcsfuse
                # internal/gcsx/bucket_manager.go NewPrefixBucket); a prefix without objects is an empty folder.
                path = self.work / "buckets" / bucket / opts.get("only-dir", "").strip("/")
                if ".." in Path(opts.get("only-dir", "")).parts:
                    raise HarnessError(f"pod {pod.name}: volume {name} only-dir {opts['only-dir']!r}")
                path.mkdir(parents=True, exist_ok=True)
                uid, gid = int(opts.get("uid", 0)), int(opts.get("gid", 0))
                for p in [path, *path.rglob("*")] if os.geteuid() == 0 else []:
                    os.chown(p, uid, gid)  # gcsfuse shows every object as the mount's uid/gid
                out[name] = (str(path), vol["csi"].get("readOnly", False))
            elif "projected" in vol:
                path = folder / "volumes" / name
                path.mkdir(parents=True)
                for source in vol["projected"]["sources"]:
                    if "serviceAccountToken" not in source:
                        raise HarnessError(f"pod {pod.name}: projected source {source} not supported")
                    tok = source["serviceAccountToken"]
                    ksa = pod.spec.get("serviceAccountName", "default")
                    file = path / tok["path"]
                    file.write_text(self.boundary.projected_token(tok.get("audience", ""), pod.namespace, ksa))
                    if os.geteuid() == 0:
                        os.chown(file, int(sec.get("runAsUser", S.IMAGE_UID)), int(sec.get("fsGroup", 0)))
                    os.chmod(file, 0o600)
                out[name] = (str(path), True)
            elif "secret" in vol:
                path = folder / "volumes" / name
                path.mkdir(parents=True)
                secret = vol["secret"]["secretName"]
                for item in vol["secret"].get("items", []):
                    (path / item["path"]).write_text(self.secret_value(secret, item["key"]))
                out[name] = (str(path), True)
            else:
                raise HarnessError(f"pod {pod.name}: volume {name} of a kind this harness does not run: {vol}")
        return out

    def resolve_env(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in container.get("env", []):
            name = item["name"]
            if "value" in item:
                env[name] = str(item["value"])
                continue
            ref = item.get("valueFrom", {})
            if "fieldRef" in ref:
                env[name] = self._field(pod, ref["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in ref:
                env[name] = self.secret_value(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
            else:
                raise HarnessError(f"pod {pod.name}: env {name} comes from {ref}, which this harness cannot resolve")
        return env

    def _field(self, pod: Pod, path: str) -> str:
        for prefix, source in (("metadata.labels", pod.labels), ("metadata.annotations", pod.annotations)):
            if path.startswith(prefix + "['"):
                key = path[len(prefix) + 2:-2]
                if key not in source:
                    raise HarnessError(f"pod {pod.name}: the downward API field {path} is not set on the pod "
                                       f"(have {sorted(source)})")
                return source[key]
        simple = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "status.podIP": pod.ip,
                  "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
                  "spec.nodeName": f"node-{pod.name}"}
        if path not in simple:
            raise HarnessError(f"pod {pod.name}: downward API field {path} not supported")
        return simple[path]

    def _container(self, pod: Pod, c: dict[str, Any], volumes: dict[str, tuple[str, bool]],
                   folder: Path) -> S.Container:
        argv = list(c.get("command") or IMAGE_ENTRYPOINT) + list(c.get("args", []))
        rendered = self.resolve_env(pod, c)
        clash = sorted(set(rendered) & set(self.boundary.env))
        if clash:
            raise HarnessError(f"pod {pod.name}: the boundary's env would override the rendered {clash}")
        venv_bin = str(Path(os.environ.get("VIRTUAL_ENV", "") or Path(os.sys.executable).parent.parent) / "bin")
        env = {**S.IMAGE_ENV, **S.NAME_MAPPING_ENV, "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", **rendered,
               **self.boundary.env}
        requests = c.get("resources", {}).get("limits", {})
        if TPU_RESOURCE in requests and pod.labels.get(K.NODE_TYPE) == "worker":
            # A Ray TPU worker: Ray Train's JAX backend runs jax.distributed.initialize itself, on the platform
            # JAX_PLATFORMS names (ray/train/v2/jax/config.py); JAX's own variables put it on CPU devices.
            env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(self.cpu_devices),
                        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"})
        elif TPU_RESOURCE in requests:
            env["TRAINER_CPU_DEVICES"] = str(self.cpu_devices)  # CPU devices in place of the pod's chips
        if TPU_RESOURCE in requests and os.environ.get("XLA_FLAGS"):
            env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]  # the test machine's CPU compile flags (tests/conftest.py)
        if TPU_RESOURCE in requests:  # CPU hosts read what process 0 compiled, as a slice's hosts do (conftest.py)
            env["PYTHONPATH"] = sharing_compiles(env.get("PYTHONPATH"))
        mounts: list[tuple[str, str, bool]] = []
        layer = folder / f"layer-{c['name']}"
        for sub in ("home", "tmp"):
            (layer / sub).mkdir(parents=True)
            os.chmod(layer / sub, 0o777)
        mounted = {m["mountPath"] for m in c.get("volumeMounts", [])}
        # The container's own writable layer where the image has folders: its home, /tmp (unless a volume is there).
        mounts.append((str(layer / "home"), S.IMAGE_WORKDIR, False))
        if "/tmp" not in mounted:
            mounts.append((str(layer / "tmp"), "/tmp", False))
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                raise HarnessError(f"pod {pod.name}: container {c['name']} mounts {m['name']}, which is no volume")
            src, ro = volumes[m["name"]]
            if m.get("subPath"):
                src = os.path.join(src, m["subPath"])
            mounts.append((src, m["mountPath"], ro or bool(m.get("readOnly"))))
        mounts += [(src, dst, False) for dst, src in self.mounts.items()]
        for _, dst, _ in mounts:  # the checkout and its venv stand in for the image's code: nothing may cover them
            hidden = [p for p in S.exposed() if Path(p) == Path(dst) or Path(dst) in Path(p).parents]
            if hidden:
                raise HarnessError(f"pod {pod.name}: container {c['name']} mounts {dst} over {hidden[0]}, which holds "
                                   f"the code it runs; run the harness from a checkout outside {dst}")
        sec = {**pod.spec.get("securityContext", {}), **c.get("securityContext", {})}
        uid = int(sec.get("runAsUser", S.IMAGE_UID))
        gid = int(sec.get("runAsGroup", S.IMAGE_UID))
        groups = sorted({gid, *([int(sec["fsGroup"])] if "fsGroup" in sec else []),
                         *map(int, sec.get("supplementalGroups", []))})
        return S.Container(name=c["name"], argv=argv, env=env, mounts=mounts,
                           read_only_root=bool(sec.get("readOnlyRootFilesystem")), uid=uid, gid=gid, groups=groups,
                           workdir=c.get("workingDir", S.IMAGE_WORKDIR), log=folder.parent / f"{pod.name}.log")

    def delete_pod(self, pod: Pod) -> None:
        """Graceful deletion: preStop, SIGTERM, SIGKILL after the grace period (checked in the loop)."""
        if pod.deleting is not None and pod.removing:
            return
        pod.deleting, pod.removing = time.monotonic(), True
        for c in pod.spec["containers"]:
            pre = c.get("lifecycle", {}).get("preStop", {})
            if "sleep" in pre:
                pod.deleting += float(pre["sleep"]["seconds"])  # SIGTERM after the hook
        self._event(f"delete pod {pod.name}")

    def _grace(self, pod: Pod) -> float:
        return float(pod.spec.get("terminationGracePeriodSeconds", 30))

    def log(self, pod_name: str) -> str:
        path = self.work / "pods" / f"{pod_name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ------------------------------------------------------------------ Jobs

    def _create_job(self, name: str, namespace: str, spec: dict[str, Any], labels: dict[str, str],
                    annotations: dict[str, str], hostname_prefix: str | None = None,
                    subdomain: str | None = None) -> Job:
        job = Job(name, namespace, spec, labels, annotations, hostname_prefix, subdomain)
        self.jobs[name] = job
        for index in range(min(int(spec.get("parallelism", 1)), job.completions)):
            self._job_pod(job, index)
        return job

    def _job_pod(self, job: Job, index: int) -> None:
        template = job.spec["template"]
        ann = dict(job.annotations)
        labels = dict(job.labels)
        if job.indexed:
            ann[COMPLETION_INDEX] = str(index)
            labels[COMPLETION_INDEX] = str(index)
        hostname = f"{job.hostname_prefix}-{index}" if job.hostname_prefix and job.indexed else None
        name = f"{job.name}-{index}" if job.indexed else f"{job.name}-{job.failed}"
        job.pods = [p for p in job.pods if p.name != name]
        job.pods.append(self._pod(name, job.namespace, template, f"Job/{job.name}", labels, ann, hostname,
                                  job.subdomain))

    def _pod_failure_action(self, job: Job, pod: Pod) -> tuple[str, str]:
        return pod_failure_verdict(job.spec.get("podFailurePolicy", {}), pod.exit_codes(), pod.namespace, pod.name)

    def _tick_job(self, job: Job) -> None:
        if job.status != "Active":
            return
        now = time.monotonic()
        finished = [p for p in job.pods if p.phase == "Running" and not any(c.running() for c in p.containers)]
        verdicts: list[tuple[Pod, str, str]] = []
        for pod in finished:
            codes = pod.exit_codes()
            if all(code == 0 for code in codes.values()):
                pod.phase = "Succeeded"
                job.succeeded.add(int(pod.annotations.get(COMPLETION_INDEX, 0)))
                continue
            pod.phase = "Failed"
            action, message = self._pod_failure_action(job, pod)
            self._event(f"pod {pod.name} failed {codes}: {action}")
            verdicts.append((pod, action, message))
        # syncJob: a FailJob verdict (getFailJobMessage) is acted on before the backoff limit is judged. It takes the
        # first matching pod in the lister's order, which nothing fixes: pods that failed together and match different
        # rules would give a Job failure that depends on chance, which a JobSet rule then reads.
        fail_job = [(pod, message) for pod, action, message in verdicts if action == "FailJob"]
        rules = {message.rsplit(" rule at index ", 1)[-1] for _, message in fail_job}
        if len(rules) > 1:
            raise HarnessError(f"job {job.name}: pods that failed together match different FailJob rules "
                               f"({[m for _, m in fail_job]}): the Job's failure would depend on which pod the Job "
                               "controller lists first")
        if fail_job:
            self._fail_job(job, "PodFailurePolicy", fail_job[0][1])
            return
        for pod, action, _ in verdicts:
            index = int(pod.annotations.get(COMPLETION_INDEX, 0))
            if action == "Ignore":
                job.waiting[index] = now
                continue
            job.failed += 1
            if job.failed > int(job.spec.get("backoffLimit", 6)):
                self._fail_job(job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
                return
            base, cap = JOB_BACKOFF_S
            job.waiting[index] = now + min(base * 2 ** (job.failed - 1), cap) * self.time_scale
        for index, when in list(job.waiting.items()):
            if now >= when:
                del job.waiting[index]
                self._job_pod(job, index)
        if len(job.succeeded) >= job.completions:
            job.status = "Complete"
            self._event(f"job {job.name} Complete")

    def _fail_job(self, job: Job, reason: str, message: str) -> None:
        job.status, job.reason, job.message = "Failed", reason, message
        job.failed_at = time.monotonic()
        self._event(f"job {job.name} Failed: {reason}: {message}")
        for pod in job.pods:
            if any(c.running() for c in pod.containers):
                self.delete_pod(pod)

    # ------------------------------------------------------------------ JobSets

    def _create_jobset(self, obj: dict[str, Any]) -> None:
        js = JobSet(obj["metadata"]["name"], obj["metadata"].get("namespace", "default"), obj)
        self.jobsets[js.name] = js
        self._jobset_jobs(js)

    def _jobset_jobs(self, js: JobSet) -> None:
        spec = js.obj["spec"]
        subdomain = spec.get("network", {}).get("subdomain") or js.name
        dns = spec.get("network", {}).get("enableDNSHostnames", True)
        global_index = 0
        js.jobs = []
        for rj in spec["replicatedJobs"]:
            for i in range(int(rj.get("replicas", 1))):
                name = f"{js.name}-{rj['name']}-{i}"
                meta = {JOBSET_NAME: js.name, REPLICATED_JOB: rj["name"], REPLICATED_JOB_REPLICAS: str(rj.get(
                    "replicas", 1)), JOB_INDEX: str(i), JOB_GLOBAL_INDEX: str(global_index),
                    RESTART_ATTEMPT: str(js.restarts)}
                global_index += 1
                job_spec = json.loads(json.dumps(rj["template"]["spec"]))
                js.jobs.append(self._create_job(name, js.namespace, job_spec, meta, dict(meta),
                                                name if dns else None, subdomain if dns else None))

    def _tick_jobset(self, js: JobSet) -> None:
        if js.status != "Active":
            return
        if js.recreating:
            if all(not c.running() for j in js.jobs for p in j.pods for c in p.containers):
                for j in js.jobs:
                    self.jobs.pop(j.name, None)
                js.recreating = False
                self._jobset_jobs(js)
                self._event(f"jobset {js.name} recreated (restart-attempt {js.restarts})")
            return
        for job in js.jobs:
            self._tick_job(job)
        failed = sorted((j for j in js.jobs if j.status == "Failed"), key=lambda j: j.failed_at)
        if failed:
            # findFirstFailedPolicyRuleAndJob: the rules in order, each against the failed Jobs by failure time; the
            # first match decides; none: RestartJobSet for the earliest failure.
            job, action = failed[0], "RestartJobSet"
            rules = js.obj["spec"].get("failurePolicy", {}).get("rules", [])
            for rule in rules:
                hit = next((j for j in failed if _rule_applies(rule, j)), None)
                if hit is not None:
                    job, action = hit, rule["action"]
                    break
            js.history.append(f"{job.name}: {job.reason} ({job.message}) -> {action}")
            self._event(f"jobset {js.name}: job {job.name} failed ({job.reason}) -> {action}")
            max_restarts = int(js.obj["spec"].get("failurePolicy", {}).get("maxRestarts", 0))
            # The JobSet's Failed condition names the Job, not its reason (pkg/constants: FailJobSetActionReason and
            # its message with the first failed job; ReachedMaxRestarts): `kubectl get jobs` shows the exit code.
            if action == "FailJobSet":
                self._fail_jobset(js, "FailJobSetFailurePolicyAction", "applying FailJobSet failure policy action "
                                  f"(first failed job: {job.name})")
            elif action == "RestartJobSet" and js.restarts_toward_max >= max_restarts:
                self._fail_jobset(js, "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
            elif action in ("RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"):
                js.restarts += 1
                js.restarts_toward_max += action == "RestartJobSet"
                js.recreating = True
                for j in js.jobs:
                    for pod in j.pods:
                        self.delete_pod(pod)
            else:
                raise HarnessError(f"JobSet {js.name}: failure policy action {action!r} not supported")
            return
        targets = js.obj["spec"].get("successPolicy", {}).get("targetReplicatedJobs") or []
        judged = [j for j in js.jobs if not targets or j.labels[REPLICATED_JOB] in targets]
        if judged and all(j.status == "Complete" for j in judged):
            js.status = "Completed"
            self._event(f"jobset {js.name} Completed")

    def _fail_jobset(self, js: JobSet, reason: str, message: str) -> None:
        js.status, js.reason, js.message = "Failed", reason, message
        self._event(f"jobset {js.name} Failed: {reason}: {message}")
        for j in js.jobs:
            for pod in j.pods:
                self.delete_pod(pod)

    # ------------------------------------------------------------------ RayJobs (KubeRay)

    def _create_rayjob(self, obj: dict[str, Any]) -> None:
        run = K.new_run(obj)
        self.rayjobs[run.name] = run
        self.generated.append(run.secret())
        owner = f"RayJob/{run.name}"
        name, template = K.head_pod(run)
        # The RayCluster's head Service and the RayJob's (BuildHeadServiceForRayJob) both select the head pod.
        for service in (f"{run.cluster}-head-svc", f"{run.name}-head-svc"):
            self.service_hosts[f"{service}.{run.namespace}"] = name
        pods = [(name, template), *K.worker_pods(run)]
        for pod_name, t in pods:
            meta = t.get("metadata", {})
            self._pod(pod_name, run.namespace, t, owner, dict(meta.get("labels", {})),
                      dict(meta.get("annotations", {})), t["spec"].get("hostname"), t["spec"].get("subdomain"))
            run.pods.append(pod_name)

    def ray_job_info(self, run: K.RayJobRun) -> dict[str, Any]:
        """GET /api/jobs/<submission id> on the head's dashboard with the cluster's token, as KubeRay's dashboard
        client asks it (utils/dashboardclient); {} while the dashboard does not answer."""
        head = self.pods.get(run.pods[0])
        if head is None:
            return {}
        request = urllib.request.Request(f"http://{head.ip}:{K.DASHBOARD_PORT}/api/jobs/{run.job_id}")
        request.add_header("x-ray-authorization", f"Bearer {run.token}")
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                return dict(json.loads(r.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def _tick_rayjob(self, run: K.RayJobRun) -> None:
        """rayjob_controller.go in SidecarMode: Running once every pod of the cluster is ready; a submitter that exits
        non-zero fails the RayJob (checkSidecarContainerStatus); once it exited 0, the Ray job's terminal status
        decides (FAILED: Failed; SUCCEEDED or STOPPED: Complete), asked of the dashboard until it answers
        (recordJobStatusCheckFailure gives up after DEFAULT_RAYJOB_STATUS_CHECK_TIMEOUT_SECONDS, 300 s).
        shutdownAfterJobFinishes with ttlSecondsAfterFinished 0 then deletes the cluster's pods."""
        if run.status in ("Complete", "Failed"):
            return
        pods = [self.pods.get(name) for name in run.pods]
        head = pods[0]
        if head is None:
            return
        if run.status == "Initializing" and all(p is not None and p.ready for p in pods):
            run.status = "Running"
            self._event(f"rayjob {run.name} Running (cluster {run.cluster})")
        submitter = next((c for c in head.containers if c.name == K.SUBMITTER), None)
        code = None if submitter is None else submitter.poll()
        if code is None:
            return
        now = time.monotonic()
        if code != 0:
            run.status, run.message = "Failed", f"the submitter container exited with code {code}"
        else:
            run.submitter_done = run.submitter_done or now
            if now < run.next_check:
                return
            run.next_check = now + 3.0  # the controller's requeue, not every tick of this loop
            info = self.ray_job_info(run)
            run.job_status, run.message = str(info.get("status", "")), str(info.get("message", ""))
            if run.job_status in ("SUCCEEDED", "STOPPED"):
                run.status = "Complete"
            elif run.job_status == "FAILED":
                run.status = "Failed"
            elif now - run.submitter_done > 300:
                run.status, run.message = "Failed", "the dashboard gave no terminal job status for 300 s"
            else:
                return
        self._event(f"rayjob {run.name} {run.status}: {run.job_status} {run.message}")
        if run.obj["spec"].get("shutdownAfterJobFinishes"):
            for pod_name in run.pods:
                if (pod := self.pods.get(pod_name)) is not None:
                    self.delete_pod(pod)

    # ------------------------------------------------------------------ Deployments and probes

    def _scale_deployment(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        labels = obj["spec"]["template"].get("metadata", {}).get("labels", {})
        for i in range(int(obj["spec"].get("replicas", 1))):
            self._pod(f"{name}-{i}", obj["metadata"].get("namespace", "default"), obj["spec"]["template"],
                      f"Deployment/{name}", dict(labels), {})

    def _port(self, pod: Pod, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for c in pod.spec["containers"]:
            for p in c.get("ports", []):
                if p.get("name") == port:
                    return int(p["containerPort"])
        raise HarnessError(f"pod {pod.name}: no container port named {port!r}")

    def _probe_ok(self, pod: Pod, probe: dict[str, Any]) -> bool:
        get = probe["httpGet"]
        url = f"http://{pod.ip}:{self._port(pod, get['port'])}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=float(probe.get("timeoutSeconds", 1))) as r:
                return 200 <= r.status < 400
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _tick_probes(self, pod: Pod) -> None:
        now = time.monotonic()
        c = pod.spec["containers"][0]
        kinds = ["startupProbe"] if "startupProbe" in c and not pod.started_probe_ok else ["livenessProbe",
                                                                                         "readinessProbe"]
        for kind in kinds:
            probe = c.get(kind)
            if probe is None:
                if kind == "readinessProbe":
                    pod.ready = True
                continue
            if now < pod.next_probe.get(kind, pod.started + float(probe.get("initialDelaySeconds", 0))):
                continue
            pod.next_probe[kind] = now + float(probe.get("periodSeconds", 10))
            ok = self._probe_ok(pod, probe)
            pod.probe_failures[kind] = 0 if ok else pod.probe_failures.get(kind, 0) + 1
            if kind == "startupProbe" and ok:
                pod.started_probe_ok = True
            elif kind == "readinessProbe":
                pod.ready = ok or (pod.ready and pod.probe_failures[kind] < int(probe.get("failureThreshold", 3)))
            elif not ok and pod.probe_failures[kind] >= int(probe.get("failureThreshold", 3)):
                self._event(f"pod {pod.name}: {kind} failed {pod.probe_failures[kind]} times: restart")
                pod.probe_failures[kind] = 0
                pod.deleting = now  # the kubelet kills the container with its grace period; it restarts in place

    def _tick_pod(self, pod: Pod) -> None:
        now = time.monotonic()
        if pod.deleting is not None and now >= pod.deleting:
            for c in pod.processes():
                if c.running():
                    if now - pod.deleting >= self._grace(pod):
                        c.signal(signal.SIGKILL)
                    elif not c.extra.get("sigterm"):
                        c.signal(signal.SIGTERM)
                        c.extra["sigterm"] = "1"
        if pod.init:
            self._tick_init(pod)
            return
        if not pod.restart_always:
            if pod.phase == "Running" and pod.deleting is None and any(c.running() for c in pod.containers):
                self._tick_probes(pod)
            return
        if pod.deleting is not None and pod.removing:
            if not any(c.running() for c in pod.containers):
                del self.pods[pod.name]
                self._event(f"pod {pod.name} gone")
                if pod.owner.startswith("Deployment/"):  # the ReplicaSet replaces it
                    obj = self.deployments[pod.owner.partition("/")[2]]
                    self._pod(f"{pod.name.rsplit('-r', 1)[0]}-r{next(self._rr)}", pod.namespace,
                              obj["spec"]["template"], pod.owner, dict(pod.labels), {})
            return
        if pod.restart_at is not None:
            if now >= pod.restart_at:
                pod.restart_at = None
                for c in pod.containers:
                    c.restarts += 1
                    c.extra.pop("sigterm", None)
                    c.start(pod.netns, self.work / "pods" / pod.name)
                pod.started, pod.ran_since, pod.ready, pod.started_probe_ok = now, now, False, False
                pod.next_probe.clear()
                self._event(f"restart container(s) of {pod.name}")
            return
        if any(c.poll() is not None for c in pod.containers):
            if any(c.running() for c in pod.containers):
                return  # the others are still stopping
            pod.ready, pod.deleting = False, None
            restarts = max(c.restarts for c in pod.containers)
            if now - pod.ran_since > 600:
                restarts = 0  # the kubelet resets the back-off after 10 minutes of running
            base, cap = CRASH_BACKOFF_S
            pod.restart_at = now + min(base * 2 ** restarts, cap) * self.time_scale
            self._event(f"pod {pod.name}: container exited {pod.exit_codes()}, restart in "
                        f"{pod.restart_at - now:.0f} s")
            return
        if pod.deleting is None:
            self._tick_probes(pod)

    # ------------------------------------------------------------------ Services

    def _serve(self, obj: dict[str, Any]) -> None:
        selector = obj["spec"].get("selector", {})
        for port in obj["spec"].get("ports", []):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            self._proxies.append(listener)
            self.services[f"{obj['metadata']['name']}:{port['port']}"] = listener.getsockname()[1]
            threading.Thread(target=self._accept, args=(listener, selector, port.get("targetPort", port["port"])),
                             daemon=True).start()

    def endpoints(self, selector: Mapping[str, str]) -> list[Pod]:
        with self._lock:
            return [p for p in self.pods.values() if p.ready and p.deleting is None
                    and all(p.labels.get(k) == v for k, v in selector.items())]

    def _accept(self, listener: socket.socket, selector: dict[str, str], target: Any) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            ready = self.endpoints(selector)
            if not ready:
                client.close()  # no endpoints: kube-proxy rejects the connection
                continue
            pod = ready[next(self._rr) % len(ready)]
            try:
                upstream = socket.create_connection((pod.ip, self._port(pod, target)), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def service_url(self, name: str, port: int) -> str:
        return f"http://127.0.0.1:{self.services[f'{name}:{port}']}"

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                try:
                    self._create_pending()
                    for js in list(self.jobsets.values()):
                        self._tick_jobset(js)
                    owned = {j.name for js in self.jobsets.values() for j in js.jobs}
                    for job in list(self.jobs.values()):
                        if job.name not in owned:
                            self._tick_job(job)
                    for run in list(self.rayjobs.values()):
                        self._tick_rayjob(run)
                    for pod in list(self.pods.values()):
                        self._tick_pod(pod)
                except Exception as e:  # a harness bug: visible in the events, and the scenario's wait fails
                    self._event(f"harness error: {e!r}")
                    self.error = e
            self._stop.wait(0.2)

    def wait(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        """Until check() holds; on timeout (or a harness error) fail with the events and the pods' log tails."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                raise HarnessError(f"harness error while waiting for {what}: {self.error!r}\n{self.report()}")
            with self._lock:
                if check():
                    return
            time.sleep(0.3)
        raise TimeoutError(f"{what}: not within {timeout:.0f} s\n{self.report()}")

    def report(self, tail: int = 1500) -> str:
        lines = ["events:", *self.events[-40:]]
        for name in sorted(self.pods):
            lines.append(f"--- {name} (log tail) ---")
            lines.append(self.log(name)[-tail:])
        return "\n".join(lines)

    # ------------------------------------------------------------------ what a scenario does to pods

    def exec(self, pod_name: str, argv: list[str], timeout: float = 120) -> Any:
        """`kubectl exec POD -- ARGV` into the pod's first container."""
        with self._lock:
            pod = self.pods[pod_name]
        return pod.containers[0].exec(pod.netns, self.work / "pods" / pod.name, argv, timeout)

    def kill(self, pod_name: str, sig: int) -> None:
        """A preemption (SIGTERM: the node's shutdown with the grace period), a crash (SIGKILL)."""
        with self._lock:
            pod = self.pods[pod_name]
            if sig == signal.SIGTERM:
                self.delete_pod(pod)
            else:
                for c in pod.containers:
                    c.signal(sig)
            self._event(f"scenario: signal {sig} to {pod_name}")

def _rule_applies(rule: dict[str, Any], job: Job) -> bool:
    return rule_applies(rule, job.reason, job.message, job.labels[REPLICATED_JOB])


# ---------------------------------------------------------------------- the judges, as pure functions


def pod_failure_verdict(policy: dict[str, Any], codes: Mapping[str, int | None], namespace: str,
                        pod: str) -> tuple[str, str]:
    """A Job's podFailurePolicy on a failed pod whose containers exited with `codes` (None: still running, or a pod
    lost with its node, which has no terminated state): (FailJob, the Job's failure message), (Ignore, "") or
    (Count, "") when no rule matches (k8s pkg/controller/job/pod_failure_policy.go matchPodFailurePolicy, its
    message word for word)."""
    for index, rule in enumerate(policy.get("rules", [])):
        on = rule.get("onExitCodes")
        if on is None:
            continue  # onPodConditions (DisruptionTarget): a node-level eviction, which the scenarios do not make
        names = [on["containerName"]] if on.get("containerName") else list(codes)
        for name in names:
            code = codes.get(name)
            if not code:  # 0 never matches (pod_failure_policy.go)
                continue
            if (code in on["values"]) == (on["operator"] == "In"):
                return rule["action"], (f"Container {name} for pod {namespace}/{pod} failed with exit code {code} "
                                        f"matching {rule['action']} rule at index {index}")
    return "Count", ""


def rule_applies(rule: dict[str, Any], reason: str, message: str, replicated_job: str) -> bool:
    """JobSet v0.12.0 failure_policy.go ruleIsApplicable: the failed Job's reason, its message against the patterns
    (RE2; Python's re.search agrees on these) and its replicated Job, each list empty meaning any."""
    reasons, patterns = rule.get("onJobFailureReasons") or [], rule.get("onJobFailureMessagePatterns") or []
    targets = rule.get("targetReplicatedJobs") or []
    return ((not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns))
            and (not targets or replicated_job in targets))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
