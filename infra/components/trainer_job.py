"""TrainerJob: the trainer's service account, its Hugging Face token secret, DRANET claim, and the JobSet or (launcher:
ray) the RayJob with its head's own service account."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi

from envspec.config import NAMESPACE, ConfigError, EnvironmentSpec
from envspec.sections.trainer import StageSpec
from infra.base.pod_config import env_job, hub_splits, placement_split
from infra.components.k8s import apply
from workloads import core, dra, jobset, rayjob, stage, trainer_pod
from workloads.labels import MANAGED_BY

# Any change to what the stack renders for the training job replaces it (see TrainerJob).
REPLACE_ON_CHANGES = ("spec", "metadata")
# Beyond the pods' grace period: the API server and controllers deleting the Jobs and pods in order.
DELETE_MARGIN_S = 300


def stage_targets(spec: EnvironmentSpec) -> stage.StageTargets | None:
    """Where trainer.stage puts the model and the dataset file, and where the splits of the dataset the trainer
    config's task names (task.hub) go: the trainer config's own init.path and task.path (as the pods get it), which
    must lie on the bucket's mount. None when there is nothing to stage. Raises ConfigError."""
    s = spec.trainer.stage
    hub = hub_splits(spec)
    if not spec.trainer.enabled or (s is None and hub is None):
        return None
    cfg = env_job(spec).cfg
    mount = trainer_pod.CHECKPOINT_MOUNT + "/"
    model_dir = dataset_file = None
    if s is not None and s.model is not None:
        model_dir = cfg.init.path if cfg.init.from_ == "hf" else None
        if not model_dir or not model_dir.startswith(mount):
            raise ConfigError(f"{NAMESPACE}:trainer.stage.model: the trainer config must read a Hugging Face "
                              f"checkpoint from the bucket (init: {{from: hf, path: {mount}...}}); it has init.from "
                              f"{cfg.init.from_!r}, init.path {cfg.init.path!r}")
    if s is not None and s.dataset is not None:
        if hub is not None:
            raise ConfigError(f"{NAMESPACE}:trainer.stage.dataset: the trainer config's task names its own dataset "
                              f"(task.hub {hub.repo!r}), which the staging Job fetches into task.path; leave "
                              "trainer.stage.dataset and datasetFile out")
        dataset_file = getattr(cfg.task, "path", None)
        if not dataset_file or not str(dataset_file).startswith(mount):
            raise ConfigError(f"{NAMESPACE}:trainer.stage.dataset: the trainer config's task must read its data from "
                              f"the bucket (task.path under {mount}); it has {dataset_file!r}")
    splits = None
    if hub is not None:
        if not hub.path.startswith(mount):
            raise ConfigError(f"trainer config task.path: the dataset task names task.hub {hub.repo!r}, which the "
                              f"staging Job puts on the bucket, so task.path must be a folder under {mount}; it has "
                              f"{hub.path!r}")
        splits = stage.HubSplits(hub.repo, hub.config, hub.revision, hub.path)
    return stage.StageTargets(model_dir, dataset_file, splits)


def delete_timeout_s(grace_seconds: int) -> int:
    """How long `pulumi up` waits for a replaced job (the trainer's; the service's engine, infra/components/service.py)
    to be gone: its pods' grace period (the trainer's SIGTERM checkpoint), then the margin."""
    return grace_seconds + DELETE_MARGIN_S


def hf_token_secret(name: str, namespace: str, token: pulumi.Input[str]) -> dict[str, Any]:
    """The Secret a job's pods read the Hugging Face token from (workloads/trainer_pod.py HF_TOKEN_KEY), for the
    trainer and the service's staging Job alike; the token stays a secret in the state."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)},
            "stringData": {trainer_pod.HF_TOKEN_KEY: pulumi.Output.secret(token)}}


@dataclass(frozen=True)
class TrainerJobArgs:
    spec: EnvironmentSpec
    image: pulumi.Input[str]  # the built image by digest, or trainer.image
    hf_token: pulumi.Output[str] | None


class TrainerJob(pulumi.ComponentResource):
    def __init__(self, name: str, args: TrainerJobArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:TrainerJob", name, None, opts)
        spec, t = args.spec, args.spec.trainer
        ns = spec.queues.namespace
        child = pulumi.ResourceOptions(parent=self)
        deps = [apply(core.service_account(t.service_account, ns), child)]
        hf_secret = None
        if args.hf_token is not None:
            hf_secret = f"{t.name}-hf-token"
            deps.append(apply(hf_token_secret(hf_secret, ns, args.hf_token), child))
        claim = None
        nics = spec.dranet_networks_for(spec.trainer_group) if spec.trainer_group else 0
        if nics:
            claim = f"{t.name}-netdev"
            deps.append(apply(dra.netdev_claim_template(claim, ns, nics), child))
        refs = trainer_pod.TrainerRefs(image=args.image, bucket=spec.bucket_name,
                                       service_account=t.service_account, hf_secret=hf_secret, claim_template=claim,
                                       split=placement_split(spec))
        if (targets := stage_targets(spec)) is not None:
            # Created, and completed, before the trainer: `pulumi up` waits on the Job (pulumi-kubernetes awaits a
            # batch/v1 Job's Complete condition) up to trainer.stage.timeoutMinutes (its default without a stage).
            s = spec.trainer.stage
            timeout = s.timeout_minutes if s is not None else StageSpec.model_fields["timeout_minutes"].default
            deps.append(apply(stage.stage_job(spec, refs, targets), pulumi.ResourceOptions(
                parent=self, depends_on=list(deps), replace_on_changes=list(stage.REPLACE_ON_CHANGES),
                delete_before_replace=True, custom_timeouts=pulumi.CustomTimeouts(create=f"{timeout}m"))))
        if t.launcher == "ray":
            head = spec.ray_head_service_account
            deps.append(apply(core.service_account(head, ns), child))
            deps.append(apply(rayjob.network_policy(spec), child))
            obj = rayjob.trainer_rayjob(spec, refs, head)
        else:
            obj = jobset.trainer_jobset(spec, refs)
        # Day two: the JobSet webhook refuses any change to spec.replicatedJobs of an existing JobSet (jobset
        # pkg/webhooks/jobset_webhook.go ValidateUpdate), and KubeRay never reruns a finished RayJob while Kueue
        # suspends and re-admits a running one whose pods changed. pulumi-kubernetes would send each change as an
        # in-place apply PATCH (dry-run in preview), so a changed job is replaced instead: deleted first, so the new
        # one keeps the name and with it the checkpoint directory it resumes from. The delete is foreground by
        # default (provider/pkg/await/await.go Deletion), so Pulumi waits for the old pods to take SIGTERM, save and
        # exit before it creates the new job: the timeout covers their grace period.
        self.workload = apply(obj, pulumi.ResourceOptions(
            parent=self, depends_on=deps, replace_on_changes=list(REPLACE_ON_CHANGES), delete_before_replace=True,
            custom_timeouts=pulumi.CustomTimeouts(delete=f"{delete_timeout_s(t.termination_grace_seconds)}s")))
        self.register_outputs({t.launcher: t.name})
