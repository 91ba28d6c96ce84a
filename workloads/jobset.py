"""The trainer JobSet: one replicated Job per slice group, one pod per TPU host.

`tpu_jobset` builds it for any TpuJob (workloads/trainer_pod.py): the RL trainer's (`trainer_jobset`) and the
post-training service's engine (workloads/service.py) share every line of it but their command, args and extra env.
"""

from __future__ import annotations

from typing import Any

from envspec.config import REPLICATED_JOB, EnvironmentSpec
from envspec.pod import (
    ENV_CHECKPOINT_DIR,
    ENV_COORDINATOR,
    ENV_HOST_INDEX,
    ENV_HOSTS_PER_SLICE,
    ENV_NUM_SLICES,
    ENV_SLICE_INDEX,
    EXIT_TRANSIENT,
    RESTART_EXIT_CODES,
)
from workloads import labels as L
from workloads.trainer_pod import (
    CONTAINER_SECURITY,
    HF_TOKEN_KEY,
    TRAINER_UID,
    TpuJob,
    TrainerRefs,
    hf_token_env,
    job_nics,
    job_pod,
    job_resources,
    megascale_interfaces,
    pod_annotations,
    trainer_args,
    trainer_job,
    volume_mounts,
)

__all__ = ["HF_TOKEN_KEY", "RESTART_EXIT_CODES", "TRAINER_UID", "TrainerRefs", "trainer_jobset", "tpu_jobset",
           "pod_env", "job_env", "trainer_args"]

COORDINATOR_PORT = 8476  # jax.distributed coordinator on process 0
MEGASCALE_PORT = 8080  # libtpu's multislice (DCN) port
# Exit codes the JobSet restarts on (RESTART_EXIT_CODES, the pod contract's, envspec/pod.py): the trainer's
# transient-failure code EXIT_TRANSIENT, and death by a signal (128 + n: SIGTERM on preemption is the trainer's own
# 143, SIGKILL 137, a libtpu abort 134). Pods lost with their node fail without an exit code, so they count against
# backoffLimit 0 and restart the JobSet too.

# The JobSet's failurePolicy rules, judged by JobSet v0.12.0 pkg/controllers/failure_policy.go: executeFailurePolicy
# takes the first rule, in order, that matches any failed Job (findFirstFailedPolicyRuleAndJob; ruleIsApplicable
# compares onJobFailureReasons with the reason of the Job's Failed condition) and, when none does, the default
# RestartJobSet, which counts toward maxRestarts (restartJobSetActionApplier fails the JobSet once
# status.restartsCountTowardsMax reaches it; nothing ever resets that count). The Job controller (batch/v1) gives
# our Jobs one of two reasons: PodFailurePolicy when a pod's exit code hit the FailJob rule of tpu_jobset's
# podFailurePolicy (a bug), BackoffLimitExceeded when a pod failed any other way with backoffLimit 0 (a restart exit
# code, a signal, or no exit code at all: a pod lost with its node matches no onExitCodes rule). No deadline and no
# per-index backoff are set, so DeadlineExceeded, FailedIndexes and MaxFailedIndexesExceeded do not occur.
FAIL_ON_BUG = {"name": "failOnBug", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
# After FAIL_ON_BUG, so a bug in any Job still fails the JobSet first. RestartJobSetAndIgnoreMaxRestarts
# (restartJobSetAndIgnoreMaxRestartsActionApplier) bumps status.restarts only, never restartsCountTowardsMax: an
# always-on job survives any number of preemptions.
RESTART_UNLIMITED = {"name": "restartOnPreemption", "action": "RestartJobSetAndIgnoreMaxRestarts",
                     "onJobFailureReasons": ["BackoffLimitExceeded"]}
# An always-on job's own "restart me" (42: its database, its process group or its bucket unavailable at start) is
# counted, so a permanent misconfiguration (a missing IAM binding, a wrong instance) ends in a Failed JobSet after
# maxRestarts instead of holding the slice in a restart loop for ever. The Job's podFailurePolicy sends 42 to a
# FailJob rule of its own, first (index 0), whose Job failure message the Job controller writes as "Container C for
# pod NS/P failed with exit code 42 matching FailJob rule at index 0" (k8s pkg/controller/job/pod_failure_policy.go
# matchPodFailurePolicy); JobSet (>= v0.10, onJobFailureMessagePatterns, RE2) matches that message before failOnBug.
TRANSIENT_RULE_INDEX = 0
RESTART_ON_TRANSIENT = {"name": "restartOnTransient", "action": "RestartJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [f"matching FailJob rule at index {TRANSIENT_RULE_INDEX}$"]}


def pod_failure_rules(job: TpuJob) -> list[dict[str, Any]]:
    """The Jobs' podFailurePolicy: a bug's exit code fails the Job (reason PodFailurePolicy); for an always-on job,
    42 first, as a FailJob of its own (RESTART_ON_TRANSIENT counts it)."""
    bug = {"action": "FailJob", "onExitCodes": {"containerName": job.container, "operator": "NotIn",
                                                "values": list(RESTART_EXIT_CODES)}}
    if not job.restart_without_limit:
        return [bug]
    transient = {"action": "FailJob", "onExitCodes": {"containerName": job.container, "operator": "In",
                                                      "values": [EXIT_TRANSIENT]}}
    return [transient, bug]


def failure_rules(job: TpuJob) -> list[dict[str, Any]]:
    if not job.restart_without_limit:
        return [dict(FAIL_ON_BUG)]
    return [dict(RESTART_ON_TRANSIENT), dict(FAIL_ON_BUG), dict(RESTART_UNLIMITED)]


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def coordinator_host(jobset: str) -> str:
    # Pod DNS under JobSet: <jobset>-<replicatedjob>-<jobIndex>-<podIndex>.<subdomain>; subdomain = jobset name.
    return f"{jobset}-{REPLICATED_JOB}-0-0.{jobset}"


def job_env(spec: EnvironmentSpec, job: TpuJob, refs: TrainerRefs) -> list[dict[str, Any]]:
    """The env contract the trainer and the engine read (envspec/pod.py; trainer/run/distributed.py reads it) plus
    libtpu's multislice variables, then the job's own extras."""
    host = coordinator_host(job.name)
    slice_index = _field(f"metadata.annotations['{L.JOBSET_JOB_INDEX}']")
    env: list[dict[str, Any]] = [
        {"name": ENV_COORDINATOR, "value": f"{host}:{COORDINATOR_PORT}"},
        {"name": ENV_NUM_SLICES, "value": str(job.slices)},
        {"name": ENV_SLICE_INDEX, **slice_index},
        {"name": ENV_HOSTS_PER_SLICE, "value": str(job.group.shape.hosts)},
        {"name": ENV_HOST_INDEX, **_field(f"metadata.annotations['{L.JOB_COMPLETION_INDEX}']")},
        {"name": ENV_CHECKPOINT_DIR, "value": job.checkpoint_dir},
        {"name": "JOBSET_NAME", **_field(f"metadata.labels['{L.JOBSET_NAME}']")},
    ]
    if job.slices > 1:
        env += [
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": host},
            {"name": "MEGASCALE_NUM_SLICES", "value": str(job.slices)},
            {"name": "MEGASCALE_SLICE_ID", **slice_index},
            {"name": "MEGASCALE_PORT", "value": str(MEGASCALE_PORT)},
        ]
        if nics := job_nics(spec, job, refs):
            env.append(megascale_interfaces(nics))
    return env + list(job.env) + hf_token_env(refs)


def pod_env(spec: EnvironmentSpec, refs: TrainerRefs) -> list[dict[str, Any]]:
    """The trainer pods' env (job_env of the trainer)."""
    return job_env(spec, trainer_job(spec, refs), refs)


def _container(spec: EnvironmentSpec, job: TpuJob, refs: TrainerRefs) -> dict[str, Any]:
    container: dict[str, Any] = {"name": job.container, "image": refs.image}
    if job.command:
        container["command"] = list(job.command)
    container.update({
        "args": list(job.args),
        "env": job_env(spec, job, refs),
        "ports": [
            {"name": "coordinator", "containerPort": COORDINATOR_PORT},
            {"name": "megascale", "containerPort": MEGASCALE_PORT},
        ],
        "resources": job_resources(job.group, refs),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": (volume_mounts() + [{"name": name, "mountPath": path} for name, _, path in job.buckets]
                         + [mount for _, mount in job.volumes]),
    })
    return container


def host_network(job: TpuJob, refs: TrainerRefs) -> bool:
    # Without DRANET, TPU hosts reach each other (ICI setup, DCN between slices) over the node's own NICs, as xpk's
    # workloads and GKE's multislice JobSet walkthrough run them.
    return not refs.claim_template and (job.group.shape.multi_host or job.slices > 1)


def _pod_spec(spec: EnvironmentSpec, job: TpuJob, refs: TrainerRefs) -> dict[str, Any]:
    return job_pod(job, refs, _container(spec, job, refs), host_network=host_network(job, refs))


def tpu_jobset(spec: EnvironmentSpec, job: TpuJob, refs: TrainerRefs) -> dict[str, Any]:
    """The JobSet of a TPU job: `job.slices` slices of its group, one pod per host, queued in the environment's
    LocalQueue at the job's priority."""
    hosts = job.group.shape.hosts
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": job.name,
            "namespace": spec.queues.namespace,
            "labels": {**L.MANAGED_BY, L.KUEUE_QUEUE: spec.queues.local_queue, L.KUEUE_PRIORITY: job.priority},
            # One slice per node pool: JobSet places each replicated Job on its own pool.
            "annotations": {L.JOBSET_EXCLUSIVE: L.NODEPOOL},
        },
        "spec": {
            # A pod that exits with a bug's code fails its Job by podFailurePolicy, and failOnBug fails the JobSet
            # at once; anything else (preemption, node loss, a transient runtime error) restarts it from the last
            # checkpoint, up to maxRestarts (xpk's split: its workload template and get_restart_exit_codes), or
            # without limit for an always-on job. Immutable by CEL (the CRD's failurePolicy: self == oldSelf): a
            # change replaces the JobSet (infra/components/trainer_job.py, infra/components/service.py
            # replace_on_changes).
            "failurePolicy": {"maxRestarts": job.max_restarts, "restartStrategy": "Recreate",
                              "rules": failure_rules(job)},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": job.name},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": job.slices,
                    "template": {
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "podFailurePolicy": {"rules": pod_failure_rules(job)},
                            "template": {
                                "metadata": {"annotations": pod_annotations()},
                                "spec": _pod_spec(spec, job, refs),
                            },
                        }
                    },
                }
            ],
        },
    }


def trainer_jobset(spec: EnvironmentSpec, refs: TrainerRefs) -> dict[str, Any]:
    return tpu_jobset(spec, trainer_job(spec, refs), refs)
