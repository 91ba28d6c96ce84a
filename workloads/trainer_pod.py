"""What every trainer-image pod on a TPU slice has, whichever launcher starts it and whatever it runs: the image's
user, the TPU request and node choice, the DRANET claim, the checkpoint bucket mount and the workload-identity service
account (workloads/jobset.py, workloads/rayjob.py and workloads/service.py build on this).

A `TpuJob` describes one such workload as its pods see it: the RL trainer (`trainer_job`) and the post-training
service's engine (workloads/service.py `engine_job`) each build one, and the same functions turn either into pods, so
the two cannot drift apart in how they land on the slice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envspec.config import EnvironmentSpec
from envspec.pod import CHECKPOINT_MOUNT, ENV_HF_TOKEN, USER_CODE_DIR
from envspec.sections.slices import SliceGroupSpec
from workloads import labels as L

# The `trainer` user of trainer/Dockerfile; above 10000, so it is no account of the host's (checkov CKV_K8S_40).
TRAINER_UID = 10001
# gcsfuse mounts a bucket for root unless told otherwise: the non-root trainer needs uid/gid to write checkpoints
# (gcs-fuse-csi-driver docs/troubleshooting.md). No file cache, so no file-cache:* options: gcsfuse refuses
# file-cache:enable-parallel-downloads without one (gcsfuse cfg/validate.go). Saves rename no directory (orbax's
# commit-file mode, trainer/rl/checkpoint.py); moving a damaged step aside is the one directory rename, which gcsfuse
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
    # The trainer config (with trainer.args) places sampling apart (placement.mode: split): its pods get no job mesh
    # (job_mesh). Read from the config by infra/base/pod_config.py placement_split: workloads/ loads no config.
    split: bool = False


@dataclass(frozen=True)
class TpuJob:
    """One workload on TPU slices of one group, as its pods see it; the environment adds the rest (queue, namespace,
    DRANET networks)."""

    name: str  # the JobSet's name, also its pods' DNS subdomain
    group: SliceGroupSpec
    service_account: str  # the Kubernetes account the pods run as (workload identity)
    priority: str  # Kueue WorkloadPriorityClass
    max_restarts: int  # whole-job restarts (preemption, node loss, a transient error) before it fails
    termination_grace_seconds: int  # SIGTERM to SIGKILL
    checkpoint_dir: str  # CHECKPOINT_DIR in the pods: the job's own directory on the bucket's mount
    slices: int = 1
    container: str = "trainer"  # the container's name (and the one podFailurePolicy reads exit codes of)
    command: tuple[str, ...] = ()  # empty: the image's ENTRYPOINT (`python -m trainer`, trainer/Dockerfile)
    args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()  # beyond the env contract (workloads/jobset.py job_env)
    # Further buckets mounted through GCS FUSE as the checkpoint bucket is: (volume name, bucket name, mount path).
    buckets: tuple[tuple[str, str, str], ...] = ()
    # Further volumes of the pod, each with its mount in the container: (volume, volumeMount).
    volumes: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ()
    # An always-on job (the service's engine): a preemption, a signal or a transient exit restarts it without limit;
    # a bug's exit code still fails it (workloads/jobset.py RESTART_UNLIMITED). A trainer run keeps max_restarts.
    restart_without_limit: bool = False


def trainer_group(spec: EnvironmentSpec) -> SliceGroupSpec:
    group = spec.trainer_group
    assert group is not None  # spec validation rejects a trainer without a slice group
    return group


def job_nics(spec: EnvironmentSpec, job: TpuJob, refs: TrainerRefs) -> int:
    """DRANET NICs each of the job's pods claims (0 without a claim template)."""
    return spec.dranet_networks_for(job.group) if refs.claim_template else 0


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
    return [{"name": ENV_HF_TOKEN, "valueFrom": {"secretKeyRef": {"name": refs.hf_secret, "key": HF_TOKEN_KEY}}}]


def checkpoint_dir(spec: EnvironmentSpec) -> str:
    return f"{CHECKPOINT_MOUNT}/{spec.trainer.name}"


def tpu_resources(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    return job_resources(trainer_group(spec), refs)


def job_resources(group: SliceGroupSpec, refs: TrainerRefs) -> dict[str, Any]:
    """A whole TPU host of the group (every chip), and the DRANET claim when there is one."""
    chips = group.shape.chips_per_host
    resources: dict[str, Any] = {"requests": {L.TPU_RESOURCE: chips}, "limits": {L.TPU_RESOURCE: chips}}
    if refs.claim_template:
        resources["claims"] = [{"name": "netdev"}]
    return resources


def volume_mounts() -> list[dict[str, Any]]:
    return [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}]


def volumes(refs: TrainerRefs, *, read_only: bool = False, host_network: bool = False) -> list[dict[str, Any]]:
    return [bucket_volume("checkpoints", refs.bucket, read_only=read_only, host_network=host_network),
            {"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def bucket_volume(name: str, bucket: str, *, read_only: bool = False, host_network: bool = False,
                  mount_options: str = CHECKPOINT_MOUNT_OPTIONS) -> dict[str, Any]:
    """A GCS FUSE CSI ephemeral volume of `bucket`, writable by the image's user (unless read_only)."""
    attributes = {"bucketName": bucket, "mountOptions": mount_options}
    if host_network:
        # On the host network the GKE metadata server cannot tell the pod's identity, so the gcsfuse sidecar gets the
        # pod's workload-identity token only when the volume opts in (gcs-fuse-csi-driver pkg/csi_driver/node.go
        # shouldPopulateIdentityProvider, docs/authentication.md); without it, it falls back to the nodes' account,
        # which holds no bucket role, and the mount and the pod never start.
        attributes["hostNetworkPodKSA"] = "true"
    csi: dict[str, Any] = {"driver": L.GCSFUSE_DRIVER, "volumeAttributes": attributes}
    if read_only:
        csi["readOnly"] = True
    return {"name": name, "csi": csi}


def pod_annotations() -> dict[str, str]:
    return {L.GCSFUSE_INJECT: "true", **GCSFUSE_SIDECAR}


def base_pod(spec: EnvironmentSpec, service_account: str, containers: list[dict[str, Any]],
             vols: list[dict[str, Any]], *, token: bool = False) -> dict[str, Any]:
    """The pod-level settings every trainer-image pod of the RL trainer shares, TPU or not."""
    return pod_base(service_account, spec.trainer.termination_grace_seconds, containers, vols, token=token)


def pod_security() -> dict[str, Any]:
    """The pod securityContext of every trainer-image pod. The image's user (trainer/Dockerfile); fsGroup makes the
    checkpoint mount group-writable for it. RuntimeDefault: the container runtime's default syscall filter, as GKE
    Autopilot applies to TPU pods too."""
    return {"runAsNonRoot": True, "runAsUser": TRAINER_UID, "runAsGroup": TRAINER_UID, "fsGroup": TRAINER_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def pod_base(service_account: str, grace_seconds: int, containers: list[dict[str, Any]], vols: list[dict[str, Any]],
             *, token: bool = False) -> dict[str, Any]:
    """The pod-level settings every trainer-image pod shares, TPU or not, whatever it runs."""
    return {
        "serviceAccountName": service_account,
        # The trainer never calls the Kubernetes API and its account holds no RBAC: Workload Identity tokens come from
        # the node's GKE metadata server and the gcsfuse CSI driver gets its own through the kubelet (tokenRequests).
        # Only a Ray head mounts one, for KubeRay's autoscaler sidecar.
        "automountServiceAccountToken": token,
        "restartPolicy": "Never",
        # Leaves time for the SIGTERM checkpoint to finish before the kubelet kills the pod.
        "terminationGracePeriodSeconds": grace_seconds,
        "securityContext": pod_security(),
        "containers": containers,
        "volumes": vols,
    }


def tpu_pod(spec: EnvironmentSpec, refs: TrainerRefs, container: dict[str, Any], *,
            host_network: bool = False) -> dict[str, Any]:
    """A pod on one TPU host of the trainer's slice group: node choice, tolerations, capacity and DRANET claim."""
    return job_pod(trainer_job(spec, refs), refs, container, host_network=host_network)


def job_pod(job: TpuJob, refs: TrainerRefs, container: dict[str, Any], *, host_network: bool = False) -> dict[str, Any]:
    """A pod on one TPU host of the job's slice group: node choice, tolerations, capacity and DRANET claim."""
    group = job.group
    vols = volumes(refs, host_network=host_network)
    vols += [bucket_volume(name, bucket, host_network=host_network) for name, bucket, _ in job.buckets]
    vols += [volume for volume, _ in job.volumes]
    pod = pod_base(job.service_account, job.termination_grace_seconds, [container], vols)
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
    t = spec.trainer
    if t.config is None:
        return []
    return ["--config", f"{USER_CODE_DIR}/{t.config}" if t.config_in_code else t.config]


def job_mesh(slices: int, split: bool) -> list[str]:
    """The mesh overrides a job of `slices` slices applies before the config's own arguments: one mesh over every
    slice (mesh.slices, fsdp -1), except for a config that places sampling apart (placement.mode: split), whose mesh
    and placement.sampler say how the job's chips divide (the pods run that layout as written, as `gke-tpu-rl fit
    --config` prices it: infra/offline/fit.py file_job)."""
    return [] if split else [f"mesh.slices={slices}", "mesh.fsdp=-1"]


def trainer_args(spec: EnvironmentSpec, split: bool) -> list[str]:
    """The trainer config (bundled, or in trainer.code), metrics next to the checkpoints in the bucket, and the job's
    mesh (job_mesh; `split`: the config with trainer.args has placement.mode split); the config's args come last so
    they can override any of it."""
    t = spec.trainer
    config = config_args(spec)
    mesh = [a for kv in job_mesh(t.slices, split) for a in ("--set", kv)]
    return [*config, "--run-dir", f"{checkpoint_dir(spec)}/run", *mesh, *t.args]


def trainer_job(spec: EnvironmentSpec, refs: TrainerRefs) -> TpuJob:
    """The RL trainer as a TpuJob: `python -m trainer` (the image's ENTRYPOINT) with trainer_args, on
    trainer.slices slices of its group, as refs.service_account."""
    t = spec.trainer
    return TpuJob(name=t.name, group=trainer_group(spec), service_account=refs.service_account, priority=t.priority,
                  max_restarts=t.max_restarts, termination_grace_seconds=t.termination_grace_seconds,
                  checkpoint_dir=checkpoint_dir(spec), slices=t.slices, container="trainer",
                  args=tuple(trainer_args(spec, refs.split)))
