"""The trainer JobSet: one replicated Job per slice group, one pod per TPU host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config import REPLICATED_JOB, EnvironmentSpec, SliceGroupSpec
from workloads import labels as L

COORDINATOR_PORT = 8476  # jax.distributed coordinator on process 0
MEGASCALE_PORT = 8080  # libtpu's multislice (DCN) port
CHECKPOINT_MOUNT = "/checkpoints"
# Exit codes the JobSet restarts on: the trainer's transient-failure code, and death by a signal (128 + n: SIGTERM
# on preemption is the trainer's own 143, SIGKILL 137, a libtpu abort 134). Pods lost with their node fail without
# an exit code, so they count against backoffLimit 0 and restart the JobSet too. trainer/cli.py owns the codes.
RESTART_EXIT_CODES = (42, *range(128, 256))
# The `trainer` user of trainer/Dockerfile; above 10000, so it is no account of the host's (checkov CKV_K8S_40).
TRAINER_UID = 10001
# gcsfuse mounts a bucket for root unless told otherwise: the non-root trainer needs uid/gid to write checkpoints
# (gcs-fuse-csi-driver docs/troubleshooting.md). No file cache, so no file-cache:* options: gcsfuse refuses
# file-cache:enable-parallel-downloads without one (gcsfuse cfg/validate.go).
CHECKPOINT_MOUNT_OPTIONS = f"implicit-dirs,uid={TRAINER_UID},gid={TRAINER_UID},file-mode=664,dir-mode=775"
# The sidecar's defaults (256 MiB of memory) are too small to stream multi-GB checkpoints: "0" lifts a limit
# (gcs-fuse-csi-driver pkg/webhook annotations; Google's TPU and GPU samples do the same), the requests reserve
# enough for it to be scheduled beside the trainer.
GCSFUSE_SIDECAR = {
    "gke-gcsfuse/cpu-limit": "0",
    "gke-gcsfuse/memory-limit": "0",
    "gke-gcsfuse/ephemeral-storage-limit": "0",
    "gke-gcsfuse/cpu-request": "500m",
    "gke-gcsfuse/memory-request": "1Gi",
    "gke-gcsfuse/ephemeral-storage-request": "5Gi",
}
HF_TOKEN_KEY = "token"


@dataclass(frozen=True)
class TrainerRefs:
    """Names of objects the JobSet points at, created elsewhere in the stack."""

    image: Any  # a name, or under Pulumi the Output[str] of the stack's image build (resolved before it is sent)
    bucket: str
    service_account: str
    hf_secret: str | None = None
    claim_template: str | None = None


def _group(spec: EnvironmentSpec) -> SliceGroupSpec:
    group = spec.trainer_group
    assert group is not None  # spec validation rejects a trainer without a slice group
    return group


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def coordinator_host(jobset: str) -> str:
    # Pod DNS under JobSet: <jobset>-<replicatedjob>-<jobIndex>-<podIndex>.<subdomain>; subdomain = jobset name.
    return f"{jobset}-{REPLICATED_JOB}-0-0.{jobset}"


def pod_env(spec: EnvironmentSpec, refs: TrainerRefs) -> list[dict[str, Any]]:
    """The env contract the trainer reads (trainer/distributed.py) plus libtpu's multislice variables."""
    t, group = spec.trainer, _group(spec)
    host = coordinator_host(t.name)
    slice_index = _field(f"metadata.annotations['{L.JOBSET_JOB_INDEX}']")
    env: list[dict[str, Any]] = [
        {"name": "COORDINATOR_ADDRESS", "value": f"{host}:{COORDINATOR_PORT}"},
        {"name": "NUM_SLICES", "value": str(t.slices)},
        {"name": "SLICE_INDEX", **slice_index},
        {"name": "HOSTS_PER_SLICE", "value": str(group.shape.hosts)},
        {"name": "HOST_INDEX", **_field(f"metadata.annotations['{L.JOB_COMPLETION_INDEX}']")},
        {"name": "CHECKPOINT_DIR", "value": f"{CHECKPOINT_MOUNT}/{t.name}"},
        {"name": "JOBSET_NAME", **_field(f"metadata.labels['{L.JOBSET_NAME}']")},
    ]
    if t.slices > 1:
        env += [
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": host},
            {"name": "MEGASCALE_NUM_SLICES", "value": str(t.slices)},
            {"name": "MEGASCALE_SLICE_ID", **slice_index},
            {"name": "MEGASCALE_PORT", "value": str(MEGASCALE_PORT)},
        ]
        nics = spec.dranet_networks_for(group) if refs.claim_template else 0
        if nics:
            # libtpu sends DCN (megascale gRPC) traffic over the interfaces whose names match these prefixes; the
            # claimed DRANET NICs appear in the pod as eth1..ethN beside the pod network's eth0 (GKE's DRANET doc;
            # kubernetes-engine-samples ai-ml/gke-ray/raytrain/maxtext/ray-cluster.tpu-multi-slice.yaml sets this).
            env.append({"name": "LIBTPU_INIT_ARGS", "value": "--megascale_grpc_interface_prefixes="
                        + ",".join([*(f"eth{i}" for i in range(1, nics + 1)), "lo"])})
    if refs.hf_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": refs.hf_secret, "key": HF_TOKEN_KEY}}})
    return env


def trainer_args(spec: EnvironmentSpec) -> list[str]:
    """The trainer config (a bundled file name), metrics next to the checkpoints in the bucket, and a mesh that
    spans every slice; the config's args come last so they can override any of it."""
    t = spec.trainer
    config = ["--config", t.config] if t.config else []
    return [*config, "--run-dir", f"{CHECKPOINT_MOUNT}/{t.name}/run", "--set", f"mesh.slices={t.slices}",
            "--set", "mesh.fsdp=-1", *t.args]


def _container(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    group = _group(spec)
    chips = group.shape.chips_per_host
    resources: dict[str, Any] = {"requests": {L.TPU_RESOURCE: chips}, "limits": {L.TPU_RESOURCE: chips}}
    if refs.claim_template:
        resources["claims"] = [{"name": "netdev"}]
    return {
        "name": "trainer",
        "image": refs.image,
        "args": trainer_args(spec),
        "env": pod_env(spec, refs),
        "ports": [
            {"name": "coordinator", "containerPort": COORDINATOR_PORT},
            {"name": "megascale", "containerPort": MEGASCALE_PORT},
        ],
        "resources": resources,
        # No capabilities: the non-root trainer needs none (ports above 1024, TPU chips come from the device plugin).
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [
            {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _pod_spec(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    group = _group(spec)
    pod: dict[str, Any] = {
        "serviceAccountName": refs.service_account,
        # The trainer never calls the Kubernetes API and its account holds no RBAC: Workload Identity tokens come from
        # the node's GKE metadata server and the gcsfuse CSI driver gets its own through the kubelet (tokenRequests).
        "automountServiceAccountToken": False,
        "restartPolicy": "Never",
        # Leaves time for the SIGTERM checkpoint to finish before the kubelet kills the pod.
        "terminationGracePeriodSeconds": spec.trainer.termination_grace_seconds,
        # The image's user (trainer/Dockerfile); fsGroup makes the checkpoint mount group-writable for it.
        # RuntimeDefault: the container runtime's default syscall filter, as GKE Autopilot applies to TPU pods too.
        "securityContext": {"runAsNonRoot": True, "runAsUser": TRAINER_UID, "runAsGroup": TRAINER_UID,
                            "fsGroup": TRAINER_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "nodeSelector": {L.TPU_ACCELERATOR: group.shape.accelerator, L.TPU_TOPOLOGY: group.shape.topology},
        "tolerations": [{"key": L.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [_container(spec, refs)],
        "volumes": [
            {
                "name": "checkpoints",
                "csi": {
                    "driver": L.GCSFUSE_DRIVER,
                    "volumeAttributes": {
                        "bucketName": refs.bucket,
                        "mountOptions": CHECKPOINT_MOUNT_OPTIONS,
                    },
                },
            },
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if group.capacity == "spot":
        pod["tolerations"].append({"key": L.SPOT, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    if group.capacity == "flex-start":
        # Without the toleration the pods never land on the nodes queued provisioning creates for them.
        pod["nodeSelector"][L.QUEUED] = "true"
        pod["tolerations"].append({"key": L.QUEUED, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    if refs.claim_template:
        pod["resourceClaims"] = [{"name": "netdev", "resourceClaimTemplateName": refs.claim_template}]
    elif group.shape.multi_host or spec.trainer.slices > 1:
        # Without DRANET, TPU hosts reach each other (ICI setup, DCN between slices) over the node's own NICs, as
        # xpk's workloads and GKE's multislice JobSet walkthrough run them; ClusterFirstWithHostNet keeps the
        # JobSet's pod DNS names resolvable from the host network.
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    return pod


def trainer_jobset(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    t, group = spec.trainer, _group(spec)
    hosts = group.shape.hosts
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": t.name,
            "namespace": spec.queues.namespace,
            "labels": {**L.MANAGED_BY, L.KUEUE_QUEUE: spec.queues.local_queue, L.KUEUE_PRIORITY: t.priority},
            # One slice per node pool: JobSet places each replicated Job on its own pool.
            "annotations": {L.JOBSET_EXCLUSIVE: L.NODEPOOL},
        },
        "spec": {
            # A pod that exits with a bug's code fails its Job by podFailurePolicy, and this rule fails the JobSet
            # at once; anything else (preemption, node loss, a transient runtime error) restarts it from the last
            # checkpoint, up to maxRestarts (xpk's split: its workload template and get_restart_exit_codes).
            "failurePolicy": {"maxRestarts": t.max_restarts, "restartStrategy": "Recreate", "rules": [
                {"name": "failOnBug", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": t.name},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": t.slices,
                    "template": {
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                                "containerName": "trainer", "operator": "NotIn", "values": list(RESTART_EXIT_CODES)}}]},
                            "template": {
                                "metadata": {"annotations": {L.GCSFUSE_INJECT: "true", **GCSFUSE_SIDECAR}},
                                "spec": _pod_spec(spec, refs),
                            },
                        }
                    },
                }
            ],
        },
    }
