"""The pods KubeRay 1.7 makes of a rendered RayJob, as its controllers build them, so that the harness
(tests/deployed/cluster.py) runs the Ray path as deployed: our rendered head and worker templates, with what KubeRay and
GKE add to them at admission.

From KubeRay v1.7.0 (ray-operator/controllers/ray/):
- rayjob_controller.go: the RayCluster is named `<rayjob>-<5 random>` (utils.GenerateRayClusterName), the submission
  id `<rayjob>-<5 random>` (GenerateRayJobId); SidecarMode appends the submitter container to the head pod
  (getSubmitterContainer, configureSubmitterContainer: `/bin/bash -ce --` and the joined BuildJobSubmitCommand, env
  PYTHONUNBUFFERED, RAY_DASHBOARD_ADDRESS, RAY_JOB_SUBMISSION_ID and the token) and sets the head's restartPolicy Never.
- common/job.go BuildJobSubmitCommand (SidecarMode, without the SidecarSubmitterRestart gate): wait for the
  dashboard's api/gcs_healthz on localhost, then `ray job submit --address http://127.0.0.1:<dashboard port>
  --submission-id <id> -- <entrypoint>`.
- common/pod.go BuildPod: the Ray container's command becomes `/bin/bash -c --` with `ulimit -n ...; ray start ...`
  (generateRayStartCommand from setMissingRayStartParams: worker `address`, `metrics-export-port`, `block`,
  `dashboard-agent-listen-port`; `num-cpus` and `memory` from the container's limits; google.com/tpu as the Ray
  resource TPU), the env of setContainerEnvVars, the /tmp/ray emptyDir shared with the autoscaler, the probes of
  initLivenessAndReadinessProbe (Ray >= 2.53: GET /api/healthz on the agent port); DefaultWorkerPodTemplate adds the
  wait-gcs-ready init container; configureTokenAuth / SetContainerTokenAuthEnvVars add RAY_AUTH_MODE and
  RAY_AUTH_TOKEN from the Secret KubeRay makes per cluster (key auth_token).

From GKE, for a pod that asks for google.com/tpu: the KubeRay TPU webhook of GKE's Ray add-on (mutatePod: TPU_WORKER_ID,
TPU_NAME = `<group>-<replica index>`, and for multi-host slices TPU_WORKER_HOSTNAMES, hostname and subdomain) and the
TPU device plugin's TPU_ACCELERATOR_TYPE and TPU_TOPOLOGY, which Ray reads to advertise the slice
(ray/_private/accelerators/tpu.py: TPU-<pod type>-head, the ray.io/tpu-* labels Ray Train reserves slices by).

Not emulated: the autoscaler container (it watches and patches the RayCluster through the API server), so the
worker groups start at `replicas` and nothing scales them; the RayJob's backoffLimit retries; KubeRay replacing a
failed worker pod; TPU_DEVICE_PLUGIN_ADDR (status.hostIP).
"""

from __future__ import annotations

import copy
import json
import math
import random
import secrets
from dataclasses import dataclass, field
from typing import Any

RAY_CLUSTER = "ray.io/cluster"
NODE_TYPE = "ray.io/node-type"
GROUP = "ray.io/group"
IDENTIFIER = "ray.io/identifier"
HEAD_GROUP = "headgroup"
HEAD_PORT = "6379"
DASHBOARD_PORT = 8265
AGENT_PORT = 52365
METRICS_PORT = 8080
TOKEN_KEY = "auth_token"
SUBMITTER = "ray-job-submitter"
ULIMIT = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}"
# utils.BasePythonHealthCommand, RayDashboardGCSHealthPath, RayDashboardGCSHealthCheckTimeoutSeconds.
GCS_HEALTH = ("python -c \"import urllib.request; r=urllib.request.urlopen('{url}', timeout=10); "
              "exit(0 if b'success' in r.read() else 1)\"")
# DefaultWorkerPodTemplate's init container script (whitespace aside).
WAIT_GCS = """
SECONDS=0
while true; do
  if (( SECONDS <= 120 )); then
    if ray health-check --address {address} > /dev/null 2>&1; then
      echo "GCS is ready."
      break
    fi
    echo "$SECONDS seconds elapsed: Waiting for GCS to be ready."
  else
    if ray health-check --address {address}; then
      echo "GCS is ready. Any error messages above can be safely ignored."
      break
    fi
    echo "$SECONDS seconds elapsed: Still waiting for GCS to be ready."
  fi
  sleep 5
done
"""
# pod.go customAcceleratorToRayResourceMap (the TPU entry).
ACCELERATORS = {"google.com/tpu": "TPU"}
TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"


def _suffix(rng: random.Random) -> str:
    # k8s.io/apimachinery rand.String's alphabet: no vowels, no 0, 1, 3 (no words, no look-alikes).
    return "".join(rng.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))


def bash(options: str = "") -> list[str]:
    """utils.GetContainerCommand."""
    return ["/bin/bash", f"-c{options}", "--"]


def _quantity(value: Any) -> float:
    """A Kubernetes quantity as a number (cores for CPU, bytes for memory)."""
    s = str(value)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * factor
    return float(s)


def params_flags(params: dict[str, str]) -> str:
    """pod.go convertParamMap: sorted keys; "true" is a bare switch, "false" is dropped (but for three options)."""
    out = ""
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard",
                                                              "include-log-monitor"):
            if value.lower() == "true":
                out += f" --{key} "
        else:
            out += f" --{key}={value} "
    return out


def ray_start(head: bool, params: dict[str, str], resources: dict[str, Any], fqdn: str) -> str:
    """setMissingRayStartParams, then generateRayStartCommand."""
    p = dict(params)
    if not head:
        p.setdefault("address", f"{fqdn}:{HEAD_PORT}")
    else:
        p.setdefault("dashboard-host", "0.0.0.0")
    p.setdefault("metrics-export-port", str(METRICS_PORT))
    p["block"] = "true"
    p.setdefault("dashboard-agent-listen-port", str(AGENT_PORT))
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    if "num-cpus" not in p:
        cpu = limits.get("cpu") or requests.get("cpu")
        if cpu:
            p["num-cpus"] = str(math.ceil(_quantity(cpu)))  # resource.Quantity.Value() rounds up
    if "memory" not in p and limits.get("memory"):
        p["memory"] = str(int(_quantity(limits["memory"])))
    res = json.loads(p["resources"].strip("'\"` ")) if "resources" in p else {}
    if not any(name in res for name in ACCELERATORS.values()):
        for key in sorted(limits):
            if key in ACCELERATORS and _quantity(limits[key]):
                amount = _quantity(limits[key])
                res[ACCELERATORS[key]] = int(amount) if amount.is_integer() else amount  # as Go's json writes it
                p["resources"] = "'" + json.dumps(res, separators=(",", ":")) + "'"
                break
    return ("ray start --head" if head else "ray start") + params_flags(p)


def token_env(cluster: str) -> list[dict[str, Any]]:
    return [{"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": cluster, "key": TOKEN_KEY}}}]


def _ray_env(head: bool, fqdn: str, start: str) -> list[dict[str, Any]]:
    """setContainerEnvVars."""
    env: list[dict[str, Any]] = []
    if not head:
        env += [{"name": "FQ_RAY_IP", "value": fqdn}, {"name": "RAY_IP", "value": fqdn.split(".")[0]}]
    env += [{"name": "RAY_CLUSTER_NAME", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{RAY_CLUSTER}']"}}},
            {"name": "RAY_CLUSTER_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "RAY_CLOUD_INSTANCE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "RAY_NODE_TYPE_NAME", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{GROUP}']"}}},
            {"name": "KUBERAY_GEN_RAY_START_CMD", "value": start},
            {"name": "RAY_PORT", "value": HEAD_PORT},
            {"name": "RAY_ADDRESS", "value": f"{'127.0.0.1' if head else fqdn}:{HEAD_PORT}"},
            {"name": "RAY_USAGE_STATS_KUBERAY_IN_USE", "value": "1"}]
    if head:
        env.append({"name": "RAY_USAGE_STATS_EXTRA_TAGS", "value": "kuberay_version=v1.7.0;kuberay_crd=RayJob"})
    return env + [{"name": "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "value": "1"}]


def _add_env(container: dict[str, Any], items: list[dict[str, Any]]) -> None:
    """Append what the container does not set itself (KubeRay's EnvVarExists checks)."""
    have = {e["name"] for e in container.get("env", [])}
    container["env"] = [*container.get("env", []), *(e for e in items if e["name"] not in have)]


def _probe(initial: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/api/healthz", "port": AGENT_PORT}, "initialDelaySeconds": initial,
            "timeoutSeconds": timeout, "periodSeconds": 5, "successThreshold": 1, "failureThreshold": failures}


def _ray_container(ray: dict[str, Any], start: str) -> None:
    """BuildPod's command (unless the user's own runs `ray start`) and the metrics port KubeRay adds if absent."""
    user = " ".join([*ray.get("command", []), *ray.get("args", [])])
    if "ray start" not in user:
        ray["command"] = bash()
        ray["args"] = [f"{user} && {ULIMIT}; {start}" if user else f"{ULIMIT}; {start}"]
    if not any(p.get("name") == "metrics" for p in ray.get("ports", [])):
        ray.setdefault("ports", []).append({"name": "metrics", "containerPort": METRICS_PORT})


def _labels(template: dict[str, Any], cluster: str, node_type: str, group: str) -> None:
    """labelPod: the template's labels and KubeRay's."""
    meta = template.setdefault("metadata", {})
    meta["labels"] = {**meta.get("labels", {}), RAY_CLUSTER: cluster, NODE_TYPE: node_type, GROUP: group,
                      IDENTIFIER: f"{cluster}-{node_type}", "ray.io/is-ray-node": "yes"}


def _token_auth(cluster: dict[str, Any]) -> bool:
    return bool(cluster.get("authOptions", {}).get("mode") == "token")


def _empty_dir(pod: dict[str, Any], container: dict[str, Any], name: str, path: str) -> None:
    """pod.go addEmptyDir: only where nothing is mounted at the path yet."""
    if any(m["mountPath"] == path for m in container.get("volumeMounts", [])):
        return
    container.setdefault("volumeMounts", []).append({"name": name, "mountPath": path})
    if not any(v["name"] == name for v in pod.get("volumes", [])):
        pod.setdefault("volumes", []).append({"name": name, "emptyDir": {}})


@dataclass
class RayJobRun:
    """One RayJob as the RayJob controller tracks it (status.rayClusterName, status.jobId, the deployment status)."""

    name: str
    namespace: str
    obj: dict[str, Any]
    cluster: str
    job_id: str
    token: str
    status: str = "Initializing"  # Initializing, Running, Complete, Failed
    submitter_done: float | None = None  # when the submitter container exited 0 (then the job's status decides)
    next_check: float = 0.0  # the next time the controller asks the dashboard
    job_status: str = ""  # the Ray job's, as the dashboard reports it
    message: str = ""
    pods: list[str] = field(default_factory=list)

    @property
    def fqdn(self) -> str:
        return f"{self.cluster}-head-svc.{self.namespace}.svc.cluster.local"

    def secret(self) -> dict[str, Any]:
        """The token Secret KubeRay makes for the cluster."""
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": self.cluster, "namespace": self.namespace},
                "stringData": {TOKEN_KEY: self.token}}


def new_run(obj: dict[str, Any], seed: int = 0) -> RayJobRun:
    rng = random.Random(f"{obj['metadata']['name']}/{seed}")
    name = obj["metadata"]["name"]
    return RayJobRun(name=name, namespace=obj["metadata"].get("namespace", "default"), obj=obj,
                     cluster=f"{name}-{_suffix(rng)}", job_id=f"{name}-{_suffix(rng)}",
                     token=secrets.token_hex(16))


def submit_command(run: RayJobRun) -> str:
    """BuildJobSubmitCommand for SidecarMode, joined with spaces as configureSubmitterContainer joins it."""
    head = run.obj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    port = next((p["containerPort"] for p in head.get("ports", []) if p.get("name") == "dashboard"), DASHBOARD_PORT)
    address = f"http://127.0.0.1:{port}"
    spec = run.obj["spec"]
    wait = ["until", GCS_HEALTH.format(url=f"http://localhost:{port}/api/gcs_healthz"), ">/dev/null", "2>&1", ";",
            "do", "echo", json.dumps(f"Waiting for Ray Dashboard GCS to become healthy at {address} ..."), ";",
            "sleep", "2", ";", "done", ";"]
    cmd = [*wait, "ray", "job", "submit", "--address", address]
    if spec.get("runtimeEnvYAML"):
        raise NotImplementedError("runtimeEnvYAML")  # nothing we render sets it
    if spec.get("metadata"):
        cmd += ["--metadata-json", json.dumps(json.dumps(spec["metadata"], separators=(",", ":")))]
    cmd += ["--submission-id", run.job_id]
    for key, flag in (("entrypointNumCpus", "--entrypoint-num-cpus"), ("entrypointNumGpus", "--entrypoint-num-gpus")):
        if spec.get(key):
            cmd += [flag, f"{float(spec[key]):f}"]
    if spec.get("entrypointResources"):
        cmd += ["--entrypoint-resources", json.dumps(spec["entrypointResources"])]
    return " ".join([*cmd, "--", spec["entrypoint"].strip(), ";"])


def head_pod(run: RayJobRun) -> tuple[str, dict[str, Any]]:
    """The head pod: our template, KubeRay's command, env, volumes, probes and the submitter sidecar."""
    spec = run.obj["spec"]
    cluster = spec["rayClusterSpec"]
    group = cluster["headGroupSpec"]
    template = copy.deepcopy(group["template"])
    pod = template["spec"]
    ray = pod["containers"][0]
    params = dict(group.get("rayStartParams", {}))
    if cluster.get("enableInTreeAutoscaling"):
        # DefaultHeadPodTemplate: the autoscaler container (not run here) replaces Ray's monitor; the driver and Ray
        # inherit which autoscaler serves their resource requests.
        params["no-monitor"] = "true"
        v2 = cluster.get("autoscalerOptions", {}).get("version") == "v2"
        _add_env(ray, [{"name": "RAY_enable_autoscaler_v2", "value": "true" if v2 else "false"}])
        _empty_dir(pod, ray, "ray-logs", "/tmp/ray")  # shared with the autoscaler
    _empty_dir(pod, ray, "shared-mem", "/dev/shm")
    start = ray_start(True, params, ray.get("resources", {}), run.fqdn)
    _ray_container(ray, start)
    _add_env(ray, _ray_env(True, run.fqdn, start))
    ray.setdefault("livenessProbe", _probe(30, 5, 120))
    ray.setdefault("readinessProbe", _probe(10, 5, 10))
    if _token_auth(cluster):
        _add_env(ray, token_env(run.cluster))
    if spec.get("submissionMode") == "SidecarMode":
        submitter = {"name": SUBMITTER, "image": ray["image"], "command": bash("e"), "args": [submit_command(run)],
                     # status.dashboardURL is still empty when the RayCluster (and so this container) is built.
                     "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                             {"name": "RAY_DASHBOARD_ADDRESS", "value": ""},
                             {"name": "RAY_JOB_SUBMISSION_ID", "value": run.job_id}],
                     "resources": {"limits": {"cpu": "1", "memory": "1Gi"},
                                   "requests": {"cpu": "500m", "memory": "200Mi"}}}
        if _token_auth(cluster):
            _add_env(submitter, token_env(run.cluster))
        pod["containers"].append(submitter)
        pod["restartPolicy"] = "Never"
    _labels(template, run.cluster, "head", HEAD_GROUP)
    return f"{run.cluster}-head-{_suffix(random.Random(run.cluster))}", template


def _tpu_type(node_selector: dict[str, str]) -> str:
    """TPU_ACCELERATOR_TYPE as GKE sets it (v6e-4 for tpu-v6e-slice 2x2), by Ray's own mapping."""
    from ray._private.accelerators.tpu import infer_tpu_pod_type_from_topology

    generation = node_selector[TPU_ACCELERATOR].removeprefix("tpu-").removesuffix("-slice")
    generation = {"v5-lite-podslice": "v5litepod", "v5-lite-device": "v5litepod"}.get(generation, generation)
    return str(infer_tpu_pod_type_from_topology(node_selector[TPU_TOPOLOGY], generation))


def worker_pods(run: RayJobRun) -> list[tuple[str, dict[str, Any]]]:
    """Every worker group's pods: `replicas` replicas of `numOfHosts` pods each (no autoscaler here)."""
    cluster = run.obj["spec"]["rayClusterSpec"]
    out = []
    rng = random.Random(f"{run.cluster}/workers")
    for group in cluster.get("workerGroupSpecs", []):
        hosts = int(group.get("numOfHosts", 1))
        for replica in range(int(group.get("replicas", 0))):
            for host in range(hosts):
                template = copy.deepcopy(group["template"])
                pod = template["spec"]
                ray = pod["containers"][0]
                wait = {"name": "wait-gcs-ready", "image": ray["image"], "command": bash(), "args": [WAIT_GCS.format(
                    address=f"{run.fqdn}:{HEAD_PORT}")],
                    "securityContext": copy.deepcopy(ray.get("securityContext", {})),
                    "env": copy.deepcopy(ray.get("env", [])), "volumeMounts": copy.deepcopy(ray.get("volumeMounts",
                                                                                                     [])),
                    "resources": {"limits": {"cpu": "200m", "memory": "256Mi"},
                                  "requests": {"cpu": "200m", "memory": "256Mi"}}}
                _add_env(wait, [{"name": "FQ_RAY_IP", "value": run.fqdn},
                                {"name": "RAY_IP", "value": run.fqdn.split(".")[0]}])
                _empty_dir(pod, ray, "shared-mem", "/dev/shm")
                start = ray_start(False, group.get("rayStartParams", {}), ray.get("resources", {}), run.fqdn)
                _ray_container(ray, start)
                _add_env(ray, _ray_env(False, run.fqdn, start))
                ray.setdefault("livenessProbe", _probe(30, 2, 120))
                ray.setdefault("readinessProbe", _probe(10, 2, 10))
                if cluster.get("enableInTreeAutoscaling") and cluster.get("autoscalerOptions", {}).get(
                        "version") == "v2":
                    pod["restartPolicy"] = "Never"
                if _token_auth(cluster):
                    _add_env(ray, token_env(run.cluster))
                    _add_env(wait, token_env(run.cluster))
                pod["initContainers"] = [*pod.get("initContainers", []), wait]
                if "google.com/tpu" in ray.get("resources", {}).get("limits", {}):
                    gke = [{"name": "TPU_WORKER_ID", "value": str(host)},
                           {"name": "TPU_NAME", "value": f"{group['groupName']}-{replica}"},
                           {"name": "TPU_ACCELERATOR_TYPE", "value": _tpu_type(pod["nodeSelector"])},
                           {"name": "TPU_TOPOLOGY", "value": pod["nodeSelector"][TPU_TOPOLOGY]}]
                    if hosts > 1:
                        service = f"{run.cluster}-headless-worker-svc"
                        gke.append({"name": "TPU_WORKER_HOSTNAMES", "value": ",".join(
                            f"{group['groupName']}-{replica}-{h}.{service}" for h in range(hosts))})
                        pod["hostname"], pod["subdomain"] = f"{group['groupName']}-{replica}-{host}", service
                    _add_env(ray, gke)
                _labels(template, run.cluster, "worker", group["groupName"])
                out.append((f"{run.cluster}-{group['groupName']}-worker-{_suffix(rng)}", template))
    return out
