"""What every trainer pod has, whichever launcher starts it: the image's user, the TPU request and node choice, the
DRANET claim, the checkpoint bucket mount and the workload-identity service account (workloads/jobset.py and
workloads/rayjob.py build on this)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config import EnvironmentSpec, SliceGroupSpec
from workloads import labels as L

CHECKPOINT_MOUNT = "/checkpoints"
# The `trainer` user of trainer/Dockerfile; above 10000, so it is no account of the host's (checkov CKV_K8S_40).
TRAINER_UID = 10001
# gcsfuse mounts a bucket for root unless told otherwise: the non-root trainer needs uid/gid to write checkpoints
# (gcs-fuse-csi-driver docs/troubleshooting.md). No file cache, so no file-cache:* options: gcsfuse refuses
# file-cache:enable-parallel-downloads without one (gcsfuse cfg/validate.go). Saves rename no directory (orbax's
# commit-file mode, trainer/checkpoint.py); moving a damaged step aside is the one directory rename, which gcsfuse
# refuses on a flat bucket above rename-dir-limit objects (default 0; raised only for some TPU machine types by
# recent GKE), so it is set here, the same on every machine type.
RENAME_DIR_LIMIT = 200000
CHECKPOINT_MOUNT_OPTIONS = (f"implicit-dirs,uid={TRAINER_UID},gid={TRAINER_UID},file-mode=664,dir-mode=775,"
                            f"rename-dir-limit={RENAME_DIR_LIMIT}")
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
# What the trainer container may do: nothing beyond its own files (ports above 1024, TPU chips come from the device
# plugin), so no capabilities and no privilege escalation.
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@dataclass(frozen=True)
class TrainerRefs:
    """Names of objects the trainer's pods point at, created elsewhere in the stack."""

    image: Any  # a name, or under Pulumi the Output[str] of the stack's image build (resolved before it is sent)
    bucket: str
    service_account: str
    hf_secret: str | None = None
    claim_template: str | None = None


def trainer_group(spec: EnvironmentSpec) -> SliceGroupSpec:
    group = spec.trainer_group
    assert group is not None  # spec validation rejects a trainer without a slice group
    return group


def dranet_nics(spec: EnvironmentSpec, refs: TrainerRefs) -> int:
    """DRANET NICs each trainer pod claims (0 without a claim template)."""
    return spec.dranet_networks_for(trainer_group(spec)) if refs.claim_template else 0


def megascale_interfaces(nics: int) -> dict[str, Any]:
    # libtpu sends DCN (megascale gRPC) traffic over the interfaces whose names match these prefixes; the claimed
    # DRANET NICs appear in the pod as eth1..ethN beside the pod network's eth0 (GKE's DRANET doc;
    # kubernetes-engine-samples ai-ml/gke-ray/raytrain/maxtext/ray-cluster.tpu-multi-slice.yaml sets this).
    return {"name": "LIBTPU_INIT_ARGS", "value": "--megascale_grpc_interface_prefixes="
            + ",".join([*(f"eth{i}" for i in range(1, nics + 1)), "lo"])}


def hf_token_env(refs: TrainerRefs) -> list[dict[str, Any]]:
    if not refs.hf_secret:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": refs.hf_secret, "key": HF_TOKEN_KEY}}}]


def checkpoint_dir(spec: EnvironmentSpec) -> str:
    return f"{CHECKPOINT_MOUNT}/{spec.trainer.name}"


def tpu_resources(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    chips = trainer_group(spec).shape.chips_per_host
    resources: dict[str, Any] = {"requests": {L.TPU_RESOURCE: chips}, "limits": {L.TPU_RESOURCE: chips}}
    if refs.claim_template:
        resources["claims"] = [{"name": "netdev"}]
    return resources


def volume_mounts() -> list[dict[str, Any]]:
    return [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}]


def volumes(refs: TrainerRefs, *, read_only: bool = False, host_network: bool = False) -> list[dict[str, Any]]:
    attributes = {"bucketName": refs.bucket, "mountOptions": CHECKPOINT_MOUNT_OPTIONS}
    if host_network:
        # On the host network the GKE metadata server cannot tell the pod's identity, so the gcsfuse sidecar gets the
        # pod's workload-identity token only when the volume opts in (gcs-fuse-csi-driver pkg/csi_driver/node.go
        # shouldPopulateIdentityProvider, docs/authentication.md); without it, it falls back to the nodes' account,
        # which holds no bucket role, and the mount and the pod never start.
        attributes["hostNetworkPodKSA"] = "true"
    csi: dict[str, Any] = {"driver": L.GCSFUSE_DRIVER, "volumeAttributes": attributes}
    if read_only:
        csi["readOnly"] = True
    return [{"name": "checkpoints", "csi": csi}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def pod_annotations() -> dict[str, str]:
    return {L.GCSFUSE_INJECT: "true", **GCSFUSE_SIDECAR}


def base_pod(spec: EnvironmentSpec, service_account: str, containers: list[dict[str, Any]],
             vols: list[dict[str, Any]], *, token: bool = False) -> dict[str, Any]:
    """The pod-level settings every trainer-image pod shares, TPU or not."""
    return {
        "serviceAccountName": service_account,
        # The trainer never calls the Kubernetes API and its account holds no RBAC: Workload Identity tokens come from
        # the node's GKE metadata server and the gcsfuse CSI driver gets its own through the kubelet (tokenRequests).
        # Only a Ray head mounts one, for KubeRay's autoscaler sidecar.
        "automountServiceAccountToken": token,
        "restartPolicy": "Never",
        # Leaves time for the SIGTERM checkpoint to finish before the kubelet kills the pod.
        "terminationGracePeriodSeconds": spec.trainer.termination_grace_seconds,
        # The image's user (trainer/Dockerfile); fsGroup makes the checkpoint mount group-writable for it.
        # RuntimeDefault: the container runtime's default syscall filter, as GKE Autopilot applies to TPU pods too.
        "securityContext": {"runAsNonRoot": True, "runAsUser": TRAINER_UID, "runAsGroup": TRAINER_UID,
                            "fsGroup": TRAINER_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": containers,
        "volumes": vols,
    }


def tpu_pod(spec: EnvironmentSpec, refs: TrainerRefs, container: dict[str, Any], *,
            host_network: bool = False) -> dict[str, Any]:
    """A pod on one TPU host of the trainer's slice group: node choice, tolerations, capacity and DRANET claim."""
    group = trainer_group(spec)
    pod = base_pod(spec, refs.service_account, [container], volumes(refs, host_network=host_network))
    if host_network:
        pod["hostNetwork"] = True
        # Keeps cluster DNS (the JobSet's pod names) resolvable from the host network.
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    pod["nodeSelector"] = {L.TPU_ACCELERATOR: group.shape.accelerator, L.TPU_TOPOLOGY: group.shape.topology}
    pod["tolerations"] = [{"key": L.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if group.capacity == "spot":
        pod["tolerations"].append({"key": L.SPOT, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    if group.capacity == "flex-start":
        # Without the toleration the pods never land on the nodes queued provisioning creates for them.
        pod["nodeSelector"][L.QUEUED] = "true"
        pod["tolerations"].append({"key": L.QUEUED, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    if refs.claim_template:
        pod["resourceClaims"] = [{"name": "netdev", "resourceClaimTemplateName": refs.claim_template}]
    return pod


def config_args(spec: EnvironmentSpec) -> list[str]:
    """`--config` as the pod reads it: a bundled config by name, or a file of trainer.code where the image holds
    that folder."""
    from trainer.user_code import USER_CODE_DIR

    t = spec.trainer
    if t.config is None:
        return []
    return ["--config", f"{USER_CODE_DIR}/{t.config}" if t.config_in_code else t.config]
