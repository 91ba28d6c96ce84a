"""The staging Job: `python -m trainer.stage` in the trainer image, on the CPU system pool, with the bucket mounted
read-write, fetches Hugging Face files into the bucket before the workload that reads them exists: the model and
dataset file the trainer config reads (trainer.stage, `stage_job`) and the splits its dataset task names (task.hub),
or the post-training service's base model
(service.stageModel, workloads/service.py). `fetch_job` builds either from a `Fetch` (what, and where to). Idempotent:
the command skips what its marker says is staged, without a call to the Hub.

Its life: `pulumi up` creates it and waits for it to complete (pulumi-kubernetes' batch/v1 Job awaiter,
provider/pkg/await/job.go: Complete, or Failed fails the update), and the workload depends on it; a changed source
replaces it, as a Job's pod template is immutable. Kueue leaves it alone: it carries no queue-name label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envspec.config import EnvironmentSpec
from envspec.pod import CHECKPOINT_MOUNT, EXIT_CONFIG
from workloads import labels as L
from workloads.trainer_pod import (
    CONTAINER_SECURITY,
    TrainerRefs,
    hf_token_env,
    pod_annotations,
    pod_base,
    volumes,
)

# Downloads are network- and file-bound: a core for the client and memory for its buffers (the gcsfuse sidecar,
# with its own requests, does the writes to the bucket).
STAGE_RESOURCES = {"cpu": "1", "memory": "4Gi"}
# trainer/stage.py exits EXIT_CONFIG (envspec/pod.py) for what a retry cannot fix (a wrong repo, a refused token, a bad
# checkpoint): the Job fails at once instead of spending its retries; 42 (transient) and deaths by signal are retried.
SCRATCH = "/tmp"
BACKOFF_LIMIT = 4
# Its callers' replace_on_changes: explicit, so both backends replace the Job. pulumi-kubernetes would replace it
# anyway (a Job's spec.template is immutable), but terraform-provider-kubernetes' kubernetes_manifest replaces only
# on apiVersion, kind, name or namespace (v2.38.0 manifest/provider/plan.go) and would PATCH the template, which the
# API server refuses; the synth turns this option into a replace_triggered_by (infra/terraform/document.py
# _manifest_entry).
REPLACE_ON_CHANGES = ("spec",)


@dataclass(frozen=True)
class HubSplits:
    """The splits of a Hugging Face dataset the trainer config's dataset task names (task.hub, hub_config,
    hub_revision), and the folder on the bucket's mount it reads them from (task.path)."""

    repo: str
    config: str | None
    revision: str | None
    to: str


@dataclass(frozen=True)
class StageTargets:
    """Where the trainer config reads what the Job stages (its init.path and task.path), on the bucket's mount."""

    model_dir: str | None
    dataset_file: str | None
    splits: HubSplits | None = None


@dataclass(frozen=True)
class Fetch:
    """What a staging Job fetches from the Hugging Face Hub, and where on the bucket's mount it puts it."""

    model: str | None = None  # ORG/NAME
    revision: str | None = None
    model_to: str | None = None  # a directory
    dataset: str | None = None  # ORG/NAME
    dataset_file: str | None = None  # the file's path in the dataset repo
    dataset_to: str | None = None  # a file
    splits: HubSplits | None = None  # a dataset's splits, into a folder


def job_name(spec: EnvironmentSpec) -> str:
    return f"{spec.trainer.name}-stage"


def trainer_fetch(spec: EnvironmentSpec, targets: StageTargets) -> Fetch:
    """trainer.stage, and the dataset the trainer config's task names (task.hub), into the trainer config's own
    init.path and task.path."""
    stage = spec.trainer.stage
    if stage is None:  # the trainer config's dataset task alone asks for staging
        return Fetch(splits=targets.splits)
    return Fetch(model=stage.model, revision=stage.revision, model_to=targets.model_dir, dataset=stage.dataset,
                 dataset_file=stage.dataset_file, dataset_to=targets.dataset_file, splits=targets.splits)


def fetch_command(fetch: Fetch) -> list[str]:
    cmd = ["python", "-m", "trainer.stage"]
    if fetch.model is not None:
        cmd += ["--model", fetch.model, *(["--revision", fetch.revision] if fetch.revision else []),
                "--model-to", str(fetch.model_to)]
    if fetch.dataset is not None:
        cmd += ["--dataset", fetch.dataset, "--dataset-file", str(fetch.dataset_file),
                "--dataset-to", str(fetch.dataset_to)]
    if (h := fetch.splits) is not None:
        cmd += ["--hub-dataset", h.repo, *(["--hub-config", h.config] if h.config else []),
                *(["--hub-revision", h.revision] if h.revision else []), "--splits-to", h.to]
    return cmd


def command(spec: EnvironmentSpec, targets: StageTargets) -> list[str]:
    return fetch_command(trainer_fetch(spec, targets))


def stage_job(spec: EnvironmentSpec, refs: TrainerRefs, targets: StageTargets) -> dict[str, Any]:
    """The trainer's staging Job (trainer.stage), as the trainer's own account."""
    return fetch_job(job_name(spec), spec.queues.namespace, refs, trainer_fetch(spec, targets),
                     spec.trainer.termination_grace_seconds)


def fetch_job(name: str, namespace: str, refs: TrainerRefs, fetch: Fetch, grace_seconds: int) -> dict[str, Any]:
    """A staging Job named `name` that fetches `fetch` as refs.service_account, which must be able to write the
    bucket (roles/storage.objectUser through workload identity)."""
    container = {
        "name": "stage",
        "image": refs.image,
        "command": fetch_command(fetch),
        # huggingface_hub's own cache and locks go to the scratch volume: the image stays read-only.
        "env": [{"name": "HF_HOME", "value": f"{SCRATCH}/hf-home"}, *hf_token_env(refs)],
        "resources": {"requests": dict(STAGE_RESOURCES), "limits": dict(STAGE_RESOURCES)},
        "securityContext": {**CONTAINER_SECURITY, "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
                         {"name": "scratch", "mountPath": SCRATCH}],
    }
    # The workload's own account (the trainer's, the engine's): its one grant on the bucket
    # (roles/storage.objectUser) is what staging needs.
    vols = [v for v in volumes(refs) if v["name"] == "checkpoints"] + [{"name": "scratch", "emptyDir": {}}]
    pod = pod_base(refs.service_account, grace_seconds, [container], vols)
    pod["nodeSelector"] = dict(L.SYSTEM_POOL)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(L.MANAGED_BY)},
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "stage", "operator": "In", "values": [EXIT_CONFIG]}}]},
            "template": {"metadata": {"annotations": pod_annotations()}, "spec": pod},
        },
    }
