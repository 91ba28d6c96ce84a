"""The staging Job: `python -m trainer.stage` in the trainer image, on the CPU system pool, with the bucket mounted
read-write, fetches the Hugging Face model and dataset file the trainer config reads (trainer.stage) before the
trainer exists. Idempotent: the command skips what its marker says is staged, without a call to the Hub.

Its life: `pulumi up` creates it and waits for it to complete (pulumi-kubernetes' batch/v1 Job awaiter,
provider/pkg/await/job.go: Complete, or Failed fails the update), and the trainer depends on it; a changed source
replaces it, as a Job's pod template is immutable. Kueue leaves it alone: it carries no queue-name label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config import EnvironmentSpec
from workloads import labels as L
from workloads.trainer_pod import (
    CHECKPOINT_MOUNT,
    CONTAINER_SECURITY,
    TrainerRefs,
    base_pod,
    hf_token_env,
    pod_annotations,
    volumes,
)

# Downloads are network- and file-bound: a core for the client and memory for its buffers (the gcsfuse sidecar,
# with its own requests, does the writes to the bucket).
STAGE_RESOURCES = {"cpu": "1", "memory": "4Gi"}
# trainer/stage.py's exit code for what a retry cannot fix (a wrong repo, a refused token, a bad checkpoint): the Job
# fails at once instead of spending its retries; 42 (transient) and deaths by signal are retried.
EXIT_CONFIG = 2
SCRATCH = "/tmp"
BACKOFF_LIMIT = 4


@dataclass(frozen=True)
class StageTargets:
    """Where the trainer config reads what the Job stages (its init.path and task.path), on the bucket's mount."""

    model_dir: str | None
    dataset_file: str | None


def job_name(spec: EnvironmentSpec) -> str:
    return f"{spec.trainer.name}-stage"


def command(spec: EnvironmentSpec, targets: StageTargets) -> list[str]:
    stage = spec.trainer.stage
    assert stage is not None  # callers build the Job only when trainer.stage is set
    cmd = ["python", "-m", "trainer.stage"]
    if stage.model is not None:
        cmd += ["--model", stage.model, *(["--revision", stage.revision] if stage.revision else []),
                "--model-to", str(targets.model_dir)]
    if stage.dataset is not None:
        cmd += ["--dataset", stage.dataset, "--dataset-file", str(stage.dataset_file),
                "--dataset-to", str(targets.dataset_file)]
    return cmd


def stage_job(spec: EnvironmentSpec, refs: TrainerRefs, targets: StageTargets) -> dict[str, Any]:
    container = {
        "name": "stage",
        "image": refs.image,
        "command": command(spec, targets),
        # huggingface_hub's own cache and locks go to the scratch volume: the image stays read-only.
        "env": [{"name": "HF_HOME", "value": f"{SCRATCH}/hf-home"}, *hf_token_env(refs)],
        "resources": {"requests": dict(STAGE_RESOURCES), "limits": dict(STAGE_RESOURCES)},
        "securityContext": {**CONTAINER_SECURITY, "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
                         {"name": "scratch", "mountPath": SCRATCH}],
    }
    # The trainer's own account: the one grant on the bucket (roles/storage.objectUser) is what staging needs.
    vols = [v for v in volumes(refs) if v["name"] == "checkpoints"] + [{"name": "scratch", "emptyDir": {}}]
    pod = base_pod(spec, refs.service_account, [container], vols)
    pod["nodeSelector"] = dict(L.SYSTEM_POOL)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(spec), "namespace": spec.queues.namespace, "labels": dict(L.MANAGED_BY)},
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "stage", "operator": "In", "values": [EXIT_CONFIG]}}]},
            "template": {"metadata": {"annotations": pod_annotations()}, "spec": pod},
        },
    }
