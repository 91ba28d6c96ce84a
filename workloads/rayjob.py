"""The trainer as a Kueue-queued elastic RayJob (launcher: ray): KubeRay makes the RayCluster it embeds, a head on the
CPU system pool and one TPU worker group for the trainer's slice group (a replica is one slice, `numOfHosts` pods),
and runs `python -m trainer --ray ...` on the head, whose Ray Train JaxTrainer drives the loop on every TPU host.

Why a RayJob and not a RayCluster plus `ray job submit`: Kueue 0.19 admits a RayJob with an elastic worker range
(workload slices, `kueue.x-k8s.io/elastic-job`, beta and on by default since 0.18; site/content/en/docs/tasks/run/
rayjobs.md "How to enable autoscaling in RayJob"), with the same queue, quota and priority as the JobSet.
"""

from __future__ import annotations

import shlex
from typing import Any

from envspec.config import EnvironmentSpec
from envspec.machines import Requests, requests_of
from envspec.pod import ENV_CHECKPOINT_DIR
from workloads import labels as L
from workloads.trainer_pod import (
    CONTAINER_SECURITY,
    TrainerRefs,
    base_pod,
    checkpoint_dir,
    config_args,
    dranet_nics,
    hf_token_env,
    megascale_interfaces,
    pod_annotations,
    tpu_pod,
    tpu_resources,
    trainer_group,
    volume_mounts,
    volumes,
)

API = "ray.io/v1"
# The Ray in the trainer image (pyproject's `ray` extra; a test checks they agree). KubeRay picks its probes by it.
RAY_VERSION = "2.60.0"
ELASTIC_JOB = "kueue.x-k8s.io/elastic-job"
DASHBOARD_PORT = 8265
# The head runs Ray's control plane (GCS, dashboard), the autoscaler's view and the driver (`python -m trainer
# --ray`: config checks, then Ray Train's controller); no training. Requests = limits: Guaranteed QoS.
HEAD_RESOURCES = {"cpu": "2", "memory": "8Gi"}
# Containers KubeRay adds to the head, which Kueue counts with it: the autoscaler (kueue pkg/controller/jobs/
# raycluster/common.go defaultAutoscalerResources, set here explicitly so what is counted is what runs) and the
# SidecarMode job submitter (KubeRay common/job.go GetDefaultSubmitterContainer, kueue rayjob_controller.go
# defaultSubmitterResources).
AUTOSCALER_RESOURCES = {"cpu": "500m", "memory": "512Mi"}
SUBMITTER_REQUESTS = {"cpu": "500m", "memory": "200Mi"}
# How long a finished job's cluster (its TPU pods) stays before KubeRay deletes it. Kueue frees the quota when the
# job finishes, not when the pods go, so any wait here delays the next admitted workload on the same nodes. None is
# needed: the trainer's metrics and summary are in the bucket (--run-dir) and GKE ships every container's output
# to Cloud Logging, so nothing is read from a finished cluster.
TTL_AFTER_FINISHED_S = 0
# The Ray CPUs a TPU worker advertises. Ray's KubeRay autoscaler refuses a group whose CPU count it cannot find
# (rayStartParams num-cpus, the group's resources or the container's CPU: ray autoscaler/_private/kuberay/
# autoscaling_config.py _get_num_cpus), and it runs inside the head, so the head never gets Ready without it. Not a
# container request: Kueue would then need CPU quota on the TPU flavor. Ray Train's TPU workers ask for TPU chips
# only (ray/train/v2/api/config.py ScalingConfig), so this bounds nothing of the trainer's; it caps Ray's own CPU
# tasks on the host, which Ray would otherwise size to every core of the TPU VM.
TPU_WORKER_RAY_CPUS = 8
# On the head and worker pod templates: what the NetworkPolicy selects by (KubeRay's own pod labels carry the
# generated RayCluster's name, which is not known in advance).
JOB_LABEL = "gke-tpu-rl/rayjob"
# Ray's token authentication (KubeRay 1.7, Ray >= 2.52: ray-operator/controllers/ray/utils/validation.go): KubeRay
# makes a random token Secret per cluster, hands it to every Ray container, the autoscaler and the submitter as
# RAY_AUTH_TOKEN (common/pod.go SetContainerTokenAuthEnvVars), and its own dashboard client sends it
# (utils/dashboardclient/dashboard_httpclient.go, `x-ray-authorization: Bearer`). Ray then refuses job submissions
# without it, while the health endpoints the probes call stay open (tests/workloads/test_ray_upstream.py).
AUTH_OPTIONS = {"mode": "token"}


def head_quota() -> dict[str, str]:
    """CPU and memory Kueue counts for the head pod set: the head, the autoscaler and the submitter."""
    total = sum((requests_of(p) for p in (HEAD_RESOURCES, AUTOSCALER_RESOURCES, SUBMITTER_REQUESTS)), Requests(0, 0))
    cpu, memory = int(total.cpu_m), int(total.memory_mib)
    return {"cpu": f"{cpu // 1000}" if cpu % 1000 == 0 else f"{cpu}m", "memory": f"{memory}Mi"}


def entrypoint(spec: EnvironmentSpec) -> list[str]:
    """The driver's command: the same trainer and config as the JobSet's pods, with Ray Train's elastic range.
    trainer/run/ray_train.py sets mesh.slices from the workers each attempt gets."""
    t, shape = spec.trainer, trainer_group(spec).shape
    config = config_args(spec)
    return ["python", "-m", "trainer", "--ray", "--ray-slices", f"{spec.ray_min_slices}:{t.slices}",
            "--ray-tpu", f"{shape.generation.ray_accelerator}:{shape.topology}",
            "--ray-max-failures", str(t.max_failures),
            *config, "--run-dir", f"{checkpoint_dir(spec)}/run", "--set", "mesh.fsdp=-1", *t.args]


def _worker_env(spec: EnvironmentSpec, refs: TrainerRefs) -> list[dict[str, Any]]:
    # No coordinator or slice variables: Ray Train's JaxTrainer initializes jax.distributed and sets MEGASCALE_*
    # for the workers each attempt has (ray/train/v2/jax/config.py).
    env: list[dict[str, Any]] = [{"name": ENV_CHECKPOINT_DIR, "value": checkpoint_dir(spec)}]
    if spec.trainer.slices > 1 and (nics := dranet_nics(spec, refs)):
        env.append(megascale_interfaces(nics))
    return env + hf_token_env(refs)


def _head(spec: EnvironmentSpec, refs: TrainerRefs, head_account: str) -> dict[str, Any]:
    container = {
        "name": "ray-head",
        "image": refs.image,
        "env": hf_token_env(refs),
        "ports": [{"name": "gcs", "containerPort": 6379}, {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                  {"name": "client", "containerPort": 10001}],
        "resources": {"requests": dict(HEAD_RESOURCES), "limits": dict(HEAD_RESOURCES)},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": volume_mounts(),
    }
    # The driver reads the Hugging Face checkpoint's headers before it starts Ray, so the head mounts the bucket,
    # read-only: it writes nothing there (Ray Train's own run state stays on the head).
    pod = base_pod(spec, head_account, [container], volumes(refs, read_only=True), token=True)
    pod["nodeSelector"] = dict(L.SYSTEM_POOL)
    return {
        # num-cpus 0: no Ray task or training worker lands on the head.
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": _template(spec, pod),
    }


def _template(spec: EnvironmentSpec, pod: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"labels": {JOB_LABEL: spec.trainer.name}, "annotations": pod_annotations()}, "spec": pod}


def _worker_group(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    t, group = spec.trainer, trainer_group(spec)
    container = {
        "name": "ray-worker",
        "image": refs.image,
        "env": _worker_env(spec, refs),
        "resources": tpu_resources(spec, refs),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": volume_mounts(),
    }
    # On the pod network, as GKE's Ray TPU samples run: Ray's per-node ports would collide on a host network.
    pod = tpu_pod(spec, refs, container)
    return {
        "groupName": group.name,
        # One replica is one slice: KubeRay creates and scales its numOfHosts pods together.
        "replicas": t.slices,
        "minReplicas": spec.ray_min_slices,
        "maxReplicas": t.slices,
        "numOfHosts": group.shape.hosts,
        "rayStartParams": {"num-cpus": str(TPU_WORKER_RAY_CPUS)},
        "template": _template(spec, pod),
    }


def trainer_rayjob(spec: EnvironmentSpec, refs: TrainerRefs, head_account: str) -> dict[str, Any]:
    t = spec.trainer
    return {
        "apiVersion": API,
        "kind": "RayJob",
        "metadata": {
            "name": t.name,
            "namespace": spec.queues.namespace,
            "labels": {**L.MANAGED_BY, L.KUEUE_QUEUE: spec.queues.local_queue, L.KUEUE_PRIORITY: t.priority},
            # Kueue admits growth back to maxReplicas as a new workload slice instead of requeueing the job.
            "annotations": {ELASTIC_JOB: "true"},
        },
        "spec": {
            "entrypoint": shlex.join(entrypoint(spec)),
            # The submitter runs beside the head (no separate pod to place; Kueue counts it with the head).
            "submissionMode": "SidecarMode",
            # Kueue requires it: a finished job's cluster must not keep holding quota.
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            # Whole-cluster retries once Ray Train's own restarts (maxFailures) are spent, like the JobSet's.
            "backoffLimit": t.max_restarts,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "authOptions": dict(AUTH_OPTIONS),
                # Ray Train's elastic range asks the autoscaler for slices; Kueue allows it only on an elastic job.
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "version": "v2",
                    "resources": {"requests": dict(AUTOSCALER_RESOURCES), "limits": dict(AUTOSCALER_RESOURCES)},
                    "securityContext": CONTAINER_SECURITY,
                },
                "headGroupSpec": _head(spec, refs, head_account),
                "workerGroupSpecs": [_worker_group(spec, refs)],
            },
        },
    }


def network_policy(spec: EnvironmentSpec) -> dict[str, Any]:
    """Ray's node ports (GCS, object and node managers, workers, client) take unauthenticated traffic: only the job's
    own pods reach them. The dashboard port is open to the cluster: KubeRay's RayJob controller polls the job's
    status there (rayjob_controller.go, and fails the job after DEFAULT_RAYJOB_STATUS_CHECK_TIMEOUT_SECONDS of
    errors), and GKE's hosted operator does not call from a pod this policy could name. The dashboard's job API is
    guarded by Ray's token instead (AUTH_OPTIONS). Egress is left alone (the autoscaler calls the API server, pods
    pull from the registry and Hugging Face). GKE's Dataplane V2 enforces it; kubelet probes are exempt."""
    name = spec.trainer.name
    own = {"podSelector": {"matchLabels": {JOB_LABEL: name}}}
    dashboard = {"ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-ray", "namespace": spec.queues.namespace, "labels": dict(L.MANAGED_BY)},
        "spec": {**own, "policyTypes": ["Ingress"], "ingress": [{"from": [own]}, dashboard]},
    }
