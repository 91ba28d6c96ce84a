"""The trainer JobSet: one replicated Job per slice group, one pod per TPU host."""

from __future__ import annotations

from typing import Any

from infra.config import REPLICATED_JOB, EnvironmentSpec
from workloads import labels as L
from workloads.trainer_pod import (
    CONTAINER_SECURITY,
    HF_TOKEN_KEY,
    TRAINER_UID,
    TrainerRefs,
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
)

__all__ = ["HF_TOKEN_KEY", "TRAINER_UID", "TrainerRefs", "trainer_jobset", "pod_env", "trainer_args"]

COORDINATOR_PORT = 8476  # jax.distributed coordinator on process 0
MEGASCALE_PORT = 8080  # libtpu's multislice (DCN) port
# Exit codes the JobSet restarts on: the trainer's transient-failure code, and death by a signal (128 + n: SIGTERM
# on preemption is the trainer's own 143, SIGKILL 137, a libtpu abort 134). Pods lost with their node fail without
# an exit code, so they count against backoffLimit 0 and restart the JobSet too. trainer/cli.py owns the codes.
RESTART_EXIT_CODES = (42, *range(128, 256))


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def coordinator_host(jobset: str) -> str:
    # Pod DNS under JobSet: <jobset>-<replicatedjob>-<jobIndex>-<podIndex>.<subdomain>; subdomain = jobset name.
    return f"{jobset}-{REPLICATED_JOB}-0-0.{jobset}"


def pod_env(spec: EnvironmentSpec, refs: TrainerRefs) -> list[dict[str, Any]]:
    """The env contract the trainer reads (trainer/distributed.py) plus libtpu's multislice variables."""
    t, group = spec.trainer, trainer_group(spec)
    host = coordinator_host(t.name)
    slice_index = _field(f"metadata.annotations['{L.JOBSET_JOB_INDEX}']")
    env: list[dict[str, Any]] = [
        {"name": "COORDINATOR_ADDRESS", "value": f"{host}:{COORDINATOR_PORT}"},
        {"name": "NUM_SLICES", "value": str(t.slices)},
        {"name": "SLICE_INDEX", **slice_index},
        {"name": "HOSTS_PER_SLICE", "value": str(group.shape.hosts)},
        {"name": "HOST_INDEX", **_field(f"metadata.annotations['{L.JOB_COMPLETION_INDEX}']")},
        {"name": "CHECKPOINT_DIR", "value": checkpoint_dir(spec)},
        {"name": "JOBSET_NAME", **_field(f"metadata.labels['{L.JOBSET_NAME}']")},
    ]
    if t.slices > 1:
        env += [
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": host},
            {"name": "MEGASCALE_NUM_SLICES", "value": str(t.slices)},
            {"name": "MEGASCALE_SLICE_ID", **slice_index},
            {"name": "MEGASCALE_PORT", "value": str(MEGASCALE_PORT)},
        ]
        if nics := dranet_nics(spec, refs):
            env.append(megascale_interfaces(nics))
    return env + hf_token_env(refs)


def trainer_args(spec: EnvironmentSpec) -> list[str]:
    """The trainer config (bundled, or in trainer.code), metrics next to the checkpoints in the bucket, and a mesh that
    spans every slice; the config's args come last so they can override any of it."""
    t = spec.trainer
    config = config_args(spec)
    return [*config, "--run-dir", f"{checkpoint_dir(spec)}/run", "--set", f"mesh.slices={t.slices}",
            "--set", "mesh.fsdp=-1", *t.args]


def _container(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    return {
        "name": "trainer",
        "image": refs.image,
        "args": trainer_args(spec),
        "env": pod_env(spec, refs),
        "ports": [
            {"name": "coordinator", "containerPort": COORDINATOR_PORT},
            {"name": "megascale", "containerPort": MEGASCALE_PORT},
        ],
        "resources": tpu_resources(spec, refs),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": volume_mounts(),
    }


def _pod_spec(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    group = trainer_group(spec)
    # Without DRANET, TPU hosts reach each other (ICI setup, DCN between slices) over the node's own NICs, as xpk's
    # workloads and GKE's multislice JobSet walkthrough run them.
    host_network = not refs.claim_template and (group.shape.multi_host or spec.trainer.slices > 1)
    return tpu_pod(spec, refs, _container(spec, refs), host_network=host_network)


def trainer_jobset(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    t, group = spec.trainer, trainer_group(spec)
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
                                "metadata": {"annotations": pod_annotations()},
                                "spec": _pod_spec(spec, refs),
                            },
                        }
                    },
                }
            ],
        },
    }
