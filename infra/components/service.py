"""Service: the Tinker-compatible post-training service on the cluster (workloads/service.py renders its objects): the
API's and the engine's service accounts, the API's Deployment (with its read-only mount of the engine's storage dir on
the checkpoint bucket), disruption budget, Services and NetworkPolicies, the engine's DRANET claim and Hugging Face
token secret, the base model's staging Job and the engine's JobSet.

The API is a Deployment: a change rolls it in place (pulumi-kubernetes applies the new spec; the Deployment
controller replaces its pods one at a time, maxUnavailable 0). The engine JobSet follows TrainerJob's day-two rules
(infra/components/trainer_job.py): any change replaces it, the old one deleted first. With service.suspend there is no
engine and no staging Job; everything else stays, and the API keeps queueing requests in the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from envspec.config import EnvironmentSpec
from infra.base.engine_config import engine_facts
from infra.components.k8s import apply, resource_name
from infra.components.trainer_job import REPLACE_ON_CHANGES, delete_timeout_s, hf_token_secret
from workloads import dra, service, stage

# How long `pulumi up` waits for the base model's staging Job: trainer.stage.timeoutMinutes' default, which covers a
# 70B model (about 140 GB); the bundled service config's Qwen3-8B is about 16 GB.
STAGE_TIMEOUT_MINUTES = 180


def check(spec: EnvironmentSpec) -> None:
    """Before any resource exists: the engine's config loads with the arguments its pods get (service.args
    included), so a typo there fails `pulumi up` and `plan` instead of crash-looping the engine, and its storage dir
    is on the checkpoint bucket, where the API pods' mount reads it. Raises ConfigError."""
    if spec.service is not None:
        service.api_storage_dir(spec, engine_facts(spec))


@dataclass(frozen=True)
class ServiceArgs:
    spec: EnvironmentSpec
    image: pulumi.Input[str]  # the built image by digest, or trainer.image
    hf_token: pulumi.Output[str] | None  # for the staging Job (gated repos)
    instance: pulumi.Input[str]  # the Cloud SQL instance connection name PROJECT:REGION:INSTANCE
    database: str
    users: Mapping[str, pulumi.Input[str]]  # "api" / "engine" -> IAM database user
    accounts: Mapping[str, pulumi.Input[str]]  # "api" / "engine" -> Google service account e-mail


def _apply(obj: dict[str, Any], opts: pulumi.ResourceOptions) -> pulumi.CustomResource:
    """infra/components/k8s.py apply, plus the two kinds it does not type: a core/v1 Service (the untyped path would
    register `kubernetes:v1:Service`, no type pulumi-kubernetes knows) and a ServiceAccount's automount setting."""
    name = resource_name(obj)
    if obj["kind"] == "Service":
        return k8s.core.v1.Service(name, metadata=obj["metadata"], spec=obj["spec"], opts=opts)
    if obj["kind"] == "ServiceAccount":
        return k8s.core.v1.ServiceAccount(name, metadata=obj["metadata"], opts=opts,
                                          automount_service_account_token=obj.get("automountServiceAccountToken"))
    return apply(obj, opts)


def _given_deps(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """The component's own depends_on, as a list. The SDK does not pass a component's depends_on on to its children
    (pulumi runtime/_depends_on.py resolves each resource's own; rpc.py _add_dependency expands a component named in
    depends_on to its children, not the other way round), so every object here names them itself: the namespace,
    the node pools, the bucket and the database's accounts, grants and users must exist before a pod can start."""
    deps = opts.depends_on if opts is not None else None
    if deps is None:
        return []
    return [d for d in (deps if isinstance(deps, list | tuple) else [deps]) if isinstance(d, pulumi.Resource)]


class Service(pulumi.ComponentResource):
    def __init__(self, name: str, args: ServiceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:Service", name, None, opts)
        spec = args.spec
        svc = spec.service
        if svc is None:
            raise ValueError(f"environment {spec.env!r} has no service section")
        ns, engine = spec.queues.namespace, spec.service_engine_name
        given = _given_deps(opts)
        child = pulumi.ResourceOptions(parent=self, depends_on=list(given))
        group = spec.service_group
        nics = spec.dranet_networks_for(group) if group is not None else 0
        runs = not svc.suspend
        claim = f"{engine}-netdev" if runs and nics else None
        hf_secret = f"{engine}-hf-token" if runs and svc.stage_model and args.hf_token is not None else None
        refs = service.ServiceRefs(image=args.image, bucket=spec.bucket_name, instance=args.instance,
                                   database=args.database, users=args.users, accounts=args.accounts,
                                   engine=engine_facts(spec), hf_secret=hf_secret, claim_template=claim)

        accounts = [_apply(obj, child) for obj in service.service_accounts(spec, refs)]
        after_accounts = pulumi.ResourceOptions(parent=self, depends_on=[*given, *accounts])
        # The API: a changed Deployment is applied in place and rolled by its controller; pulumi-kubernetes waits for
        # the rollout (its Deployment awaiter) before the update is done.
        self.api = _apply(service.api_deployment(spec, refs), after_accounts)
        if (pdb := service.api_disruption_budget(spec)) is not None:
            _apply(pdb, child)
        for obj in [*service.api_services(spec), *service.network_policies(spec)]:
            _apply(obj, child)

        self.engine: pulumi.CustomResource | None = None
        if runs:
            deps: list[pulumi.Resource] = [*given, *accounts]
            if hf_secret is not None and args.hf_token is not None:  # hf_secret is set only with a token
                deps.append(apply(hf_token_secret(hf_secret, ns, args.hf_token), child))
            if claim is not None:
                deps.append(apply(dra.netdev_claim_template(claim, ns, nics), child))
            if (job := service.stage_model_job(spec, refs)) is not None:
                # Created, and completed, before the engine: `pulumi up` waits on the Job (pulumi-kubernetes awaits a
                # batch/v1 Job's Complete condition, provider/pkg/await/job.go) up to the create timeout. A Job's pod
                # template is immutable: a changed one is replaced, the old one deleted first (same name).
                deps.append(apply(job, pulumi.ResourceOptions(
                    parent=self, depends_on=list(deps), replace_on_changes=list(stage.REPLACE_ON_CHANGES),
                    delete_before_replace=True,
                    custom_timeouts=pulumi.CustomTimeouts(create=f"{STAGE_TIMEOUT_MINUTES}m"))))
            # Day two, as TrainerJob's (infra/components/trainer_job.py): the JobSet webhook refuses any change to
            # spec.replicatedJobs of an existing JobSet (jobset pkg/webhooks/jobset_webhook.go ValidateUpdate), and
            # pulumi-kubernetes would send each change as an in-place apply PATCH (dry-run in preview), so a changed
            # engine is replaced instead: deleted first, so the new one keeps the name. The delete is foreground by
            # default (provider/pkg/await/await.go Deletion), so Pulumi waits for the old pods to take SIGTERM and
            # exit before it creates the new engine: the timeout covers their grace period.
            self.engine = apply(service.engine_jobset(spec, refs), pulumi.ResourceOptions(
                parent=self, depends_on=deps, replace_on_changes=list(REPLACE_ON_CHANGES), delete_before_replace=True,
                custom_timeouts=pulumi.CustomTimeouts(delete=f"{delete_timeout_s(svc.termination_grace_seconds)}s")))
        self.api_address = service.api_address(spec)
        self.port_forward = service.port_forward_hint(spec)
        self.register_outputs({"api": self.api_address, "engine": None if svc.suspend else engine})
