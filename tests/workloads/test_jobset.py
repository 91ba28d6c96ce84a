"""The JobSet hands each TPU host the environment the trainer reads (trainer/run/distributed.py), and nothing is left
to chance: every host of every slice resolves to a distinct process id that covers 0..N-1."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from envspec.config import parse_spec
from tests.deployed.cluster import pod_failure_verdict, rule_applies
from tests.infra.test_config import _raw
from trainer.base.config import bundled_configs
from trainer.run import distributed
from workloads import jobset


def _spec(env: str):  # noqa: ANN202
    """The environment's spec, its trainer on a JobSet; dev (on Ray as shipped) as the one single-host slice it
    was before, the JobSet path's single-slice case."""
    raw = copy.deepcopy(_raw(env))
    if env == "dev":
        raw["trainer"] = {k: v for k, v in raw["trainer"].items() if k not in ("launcher", "minSlices", "slices")}
    return parse_spec(raw, env, bundled_configs())


def _resolve(env_list: list[dict[str, Any]], annotations: dict[str, str], labels: dict[str, str]) -> dict[str, str]:
    """What the kubelet's downward API would put in the container's environment."""
    out: dict[str, str] = {}
    for e in env_list:
        if "value" in e:
            out[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"].get("fieldRef")
        if ref is None:
            continue  # secrets are not part of the process contract
        kind, key = re.fullmatch(r"metadata\.(annotations|labels)\['(.+)'\]", ref["fieldPath"]).groups()
        out[e["name"]] = (annotations if kind == "annotations" else labels)[key]
    return out


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_every_host_gets_a_distinct_process(env: str) -> None:
    spec = _spec(env)
    refs = jobset.TrainerRefs(image="img", bucket="b", service_account="trainer")
    obj = jobset.trainer_jobset(spec, refs)
    [rj] = obj["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    [container] = job["template"]["spec"]["containers"]
    names = {e["name"] for e in container["env"]}
    assert set(distributed.POD_ENV_VARS) <= names
    if rj["replicas"] > 1:
        assert set(distributed.MEGASCALE_ENV_VARS) <= names
    seen = set()
    for slice_index in range(rj["replicas"]):
        for host in range(job["completions"]):
            pod_env = _resolve(container["env"],
                               {"jobset.sigs.k8s.io/job-index": str(slice_index),
                                "batch.kubernetes.io/job-completion-index": str(host)},
                               {"jobset.sigs.k8s.io/jobset-name": obj["metadata"]["name"]})
            info = distributed.process_info_from_env(pod_env)
            assert info.multi_process
            assert info.num_processes == rj["replicas"] * job["completions"]
            seen.add(info.process_id)
    assert seen == set(range(rj["replicas"] * job["completions"]))


def test_coordinator_is_the_first_pod_of_the_first_slice() -> None:
    spec = _spec("prod")
    obj = jobset.trainer_jobset(spec, jobset.TrainerRefs(image="img", bucket="b", service_account="trainer"))
    [container] = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    name, rj = obj["metadata"]["name"], obj["spec"]["replicatedJobs"][0]["name"]
    subdomain = obj["spec"]["network"]["subdomain"]
    assert env["COORDINATOR_ADDRESS"] == f"{name}-{rj}-0-0.{subdomain}:{jobset.COORDINATOR_PORT}"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{name}-{rj}-0-0.{subdomain}"
    assert env["HOSTS_PER_SLICE"] == "16" and env["NUM_SLICES"] == "4"


def test_single_slice_gets_no_megascale_env() -> None:
    obj = jobset.trainer_jobset(_spec("dev"), jobset.TrainerRefs(image="i", bucket="b", service_account="t"))
    [container] = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert not [e for e in container["env"] if e["name"].startswith("MEGASCALE_")]
    # Spot nodes carry a taint the pods must tolerate.
    tolerations = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in tolerations


def test_trainer_args_span_the_slices_and_keep_user_overrides_last() -> None:
    from trainer.base.config import load_config
    from trainer.run.cli import build_parser

    spec = _spec("staging")
    args = jobset.trainer_args(spec, split=False)
    assert args[:4] == ["--config", "llama3-70b-grpo-2xv6e-4x4.yaml", "--run-dir", "/checkpoints/grpo-stg/run"]
    pod = build_parser().parse_args(args)  # the trainer's own parser, as in the container
    cfg = load_config(pod.config, pod.overrides)  # a bare name: the config bundled in the image's package
    assert (cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, -1, 4)
    assert cfg.init.path == "/checkpoints/models/Llama-3.1-70B"
    dev = jobset.trainer_args(_spec("dev"), split=False)
    assert dev[-len(_spec("dev").trainer.args):] == list(_spec("dev").trainer.args)
    no_config = _spec("dev").model_copy(update={"trainer": _spec("dev").trainer.model_copy(update={"config": None})})
    assert "--config" not in jobset.trainer_args(no_config, split=False)  # the image's embedded demo config
    # A config that places sampling apart names how the chips divide (mesh, placement.sampler): no job mesh.
    assert args[4:8] == ["--set", "mesh.slices=2", "--set", "mesh.fsdp=-1"]
    assert jobset.trainer_args(spec, split=True) == args[:4] + args[8:]


@pytest.mark.parametrize(("group", "tolerated"), [("v5p-prod", set()), ("v6e-burst", {"cloud.google.com/gke-queued"})])
def test_flex_start_trainer_tolerates_the_queued_provisioning_taint(group: str, tolerated: set[str]) -> None:
    raw = copy.deepcopy(_raw("prod"))
    raw["trainer"] = {**raw["trainer"], "sliceGroup": group, "slices": 1}
    spec = parse_spec(raw, "prod", bundled_configs())
    pod = jobset.trainer_jobset(spec, jobset.TrainerRefs(image="img", bucket="b", service_account="trainer"))[
        "spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    queued = {t["key"] for t in pod["tolerations"] if t["key"] == "cloud.google.com/gke-queued"}
    assert queued == tolerated
    if tolerated:
        assert {"key": "cloud.google.com/gke-queued", "operator": "Equal", "value": "true",
                "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"]["cloud.google.com/gke-queued"] == "true"


def test_checkpoint_mount_is_writable_by_the_image_user_and_gcsfuse_accepts_it() -> None:
    pod_template = jobset.trainer_jobset(_spec("staging"), jobset.TrainerRefs(
        image="img", bucket="b", service_account="trainer"))["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]
    pod = pod_template["spec"]
    # The uid the image runs as (trainer/Dockerfile) is the one the pod runs as and the mount belongs to.
    dockerfile = (Path(__file__).resolve().parents[2] / "trainer" / "Dockerfile").read_text()
    uid = int(re.search(r"^ARG TRAINER_UID=(\d+)$", dockerfile, re.M).group(1))
    assert re.search(r"^USER \$\{TRAINER_UID\}:\$\{TRAINER_UID\}$", dockerfile, re.M)
    ctx = pod["securityContext"]
    assert ctx["runAsUser"] == ctx["runAsGroup"] == ctx["fsGroup"] == uid and ctx["runAsNonRoot"] is True
    [volume] = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
    options = volume["csi"]["volumeAttributes"]["mountOptions"].split(",")
    assert f"uid={uid}" in options and f"gid={uid}" in options
    # gcsfuse refuses file-cache options without a file cache (max-size-mb); we configure none.
    assert not any(o.startswith("file-cache:") for o in options)
    annotations = pod_template["metadata"]["annotations"]
    assert annotations["gke-gcsfuse/volumes"] == "true"
    for resource in ("cpu", "memory", "ephemeral-storage"):
        assert f"gke-gcsfuse/{resource}-limit" in annotations and f"gke-gcsfuse/{resource}-request" in annotations


@pytest.mark.parametrize(("env", "host_network"), [("dev", False), ("staging", False), ("prod", True)])
def test_multi_host_pods_without_dranet_use_the_host_network(env: str, host_network: bool) -> None:
    # dev: one single-host slice; staging: DRANET claims give the pods their own NICs; prod's v5p: no DRANET.
    spec = _spec(env)
    claim = "netdev" if spec.dranet_networks_for(spec.trainer_group) else None
    pod = jobset.trainer_jobset(spec, jobset.TrainerRefs(image="img", bucket="b", service_account="trainer",
                                                         claim_template=claim))[
        "spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod.get("hostNetwork", False) is host_network
    assert ("dnsPolicy" in pod) is host_network
    if host_network:
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet" and "resourceClaims" not in pod
    # On the host network the gcsfuse sidecar gets the pod's own identity only by this opt-in (gcs-fuse-csi-driver
    # pkg/csi_driver/node.go shouldPopulateIdentityProvider: opted in and pod.Spec.HostNetwork); otherwise it
    # falls back to the nodes' account, which has no bucket role.
    [volume] = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
    assert (volume["csi"]["volumeAttributes"].get("hostNetworkPodKSA") == "true") is host_network
    # With DRANET, libtpu's DCN traffic between slices is pointed at the claimed NICs (eth1.. in the pod).
    env_vars = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    expected = {"staging": "--megascale_grpc_interface_prefixes=eth1,eth2,lo"}.get(env)
    assert env_vars.get("LIBTPU_INIT_ARGS") == expected


def test_bugs_fail_the_jobset_and_everything_else_restarts_it() -> None:
    obj = jobset.trainer_jobset(_spec("staging"), jobset.TrainerRefs(image="img", bucket="b", service_account="t"))
    policy = obj["spec"]["failurePolicy"]
    assert policy["rules"] == [
        {"name": "failOnBug", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
    assert policy["maxRestarts"] == 3  # the trainer's is finite (trainer.maxRestarts): no unlimited rule
    job = obj["spec"]["replicatedJobs"][0]["template"]["spec"]
    [rule] = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "NotIn"
    assert rule["onExitCodes"]["containerName"] == job["template"]["spec"]["containers"][0]["name"]
    assert rule["onExitCodes"]["values"] == list(jobset.RESTART_EXIT_CODES)
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"


# ---------------------------------------------------------------- what the controllers do with a failure


def _job_failure(job: dict[str, Any], exit_code: int | None) -> tuple[str, str]:
    """The reason and message of a Job's Failed condition when one of its pods fails (the batch/v1 Job controller, as
    the as-deployed harness judges it: tests/deployed/cluster.py pod_failure_verdict): a FailJob podFailurePolicy
    rule gives PodFailurePolicy; otherwise the pod counts toward backoffLimit, and at 0 the Job fails with
    BackoffLimitExceeded. A pod lost with its node (None) has no terminated state to match."""
    container = job["template"]["spec"]["containers"][0]["name"]
    action, message = pod_failure_verdict(job["podFailurePolicy"], {container: exit_code}, "rl", "p-0")
    if action == "FailJob":
        return "PodFailurePolicy", message
    assert job["backoffLimit"] == 0
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _run(obj: dict[str, Any], failures: list[list[int | None]]) -> tuple[str, int, int]:
    """JobSet v0.12.0's executeFailurePolicy (pkg/controllers/failure_policy.go) on each round of failed Jobs in turn:
    the first rule, in order, that applies to any failed Job (findFirstFailedPolicyRuleAndJob, ruleIsApplicable as
    tests/deployed/cluster.py rule_applies), else the default RestartJobSet; RestartJobSet fails the JobSet once
    restartsCountTowardsMax reaches maxRestarts and counts; RestartJobSetAndIgnoreMaxRestarts counts into restarts
    only. Returns (state, restarts, restartsCountTowardsMax)."""
    policy = obj["spec"]["failurePolicy"]
    rj = obj["spec"]["replicatedJobs"][0]
    job = rj["template"]["spec"]
    restarts = counted = 0
    for exit_codes in failures:
        failed = [_job_failure(job, code) for code in exit_codes]
        rule = next((r for r in policy["rules"] if any(rule_applies(r, reason, message, rj["name"])
                                                        for reason, message in failed)), None)
        action = rule["action"] if rule else "RestartJobSet"
        if action == "FailJobSet":
            return "Failed", restarts, counted
        if action == "RestartJobSet":
            if counted >= policy["maxRestarts"]:
                return "Failed", restarts, counted  # ReachedMaxRestarts
            counted += 1
        else:
            assert action == "RestartJobSetAndIgnoreMaxRestarts"
        restarts += 1
    return "Running", restarts, counted


PREEMPTED, KILLED, TRANSIENT, NODE_LOST, BUG = 143, 137, 42, None, 1


def test_the_trainer_restarts_up_to_max_restarts_and_fails_on_a_bug() -> None:
    obj = jobset.trainer_jobset(_spec("staging"), jobset.TrainerRefs(image="img", bucket="b", service_account="t"))
    assert obj["spec"]["failurePolicy"]["maxRestarts"] == 3
    assert _run(obj, [[PREEMPTED], [NODE_LOST], [TRANSIENT]]) == ("Running", 3, 3)
    assert _run(obj, [[PREEMPTED], [NODE_LOST], [TRANSIENT], [KILLED]]) == ("Failed", 3, 3)
    assert _run(obj, [[PREEMPTED], [BUG]]) == ("Failed", 1, 1)


def test_an_always_on_job_restarts_on_preemption_without_limit_and_still_fails_on_a_bug() -> None:
    """Review 2026-11-28 #8: the service's engine (restart_without_limit) survives any number of Spot preemptions,
    node losses, signals and transient exits, none of which counts toward maxRestarts; a bug's exit code fails it,
    also when another Job was preempted in the same round (failOnBug comes first)."""
    from dataclasses import replace

    spec = _spec("staging")
    refs = jobset.TrainerRefs(image="img", bucket="b", service_account="t")
    job = replace(jobset.trainer_job(spec, refs), restart_without_limit=True)
    obj = jobset.tpu_jobset(spec, job, refs)
    assert obj["spec"]["failurePolicy"]["rules"] == [jobset.RESTART_ON_TRANSIENT, jobset.FAIL_ON_BUG,
                                                     jobset.RESTART_UNLIMITED]
    assert _run(obj, [[PREEMPTED], [NODE_LOST], [KILLED]] * 333) == ("Running", 999, 0)
    assert _run(obj, [[PREEMPTED]] * 500 + [[BUG]]) == ("Failed", 500, 0)
    assert _run(obj, [[PREEMPTED, BUG]]) == ("Failed", 0, 0)


def test_an_always_on_jobs_own_restart_code_is_counted() -> None:
    """Review F2 (2026-11-28 fresh-eyes review of #3 with #8): 42 is the engine's "restart me" when its database, its
    process group or its bucket is unavailable at start; a permanent misconfiguration exits 42 every time, so 42 is
    counted (restartOnTransient, before failOnBug: its own FailJob rule at index 0 and the Job controller's failure
    message) and the JobSet fails after maxRestarts instead of holding its slice for ever; preemptions in between
    still count nothing."""
    from dataclasses import replace

    spec = _spec("staging")
    refs = jobset.TrainerRefs(image="img", bucket="b", service_account="t")
    job = replace(jobset.trainer_job(spec, refs), restart_without_limit=True)
    obj = jobset.tpu_jobset(spec, job, refs)
    limit = obj["spec"]["failurePolicy"]["maxRestarts"]
    assert _run(obj, [[TRANSIENT], [PREEMPTED]] * limit) == ("Running", 2 * limit, limit)
    assert _run(obj, [[TRANSIENT]] * (limit + 1)) == ("Failed", limit, limit)
    assert _run(obj, [[TRANSIENT], [BUG]]) == ("Failed", 1, 1)
    # The trainer keeps its split: 42 is a counted restart by the default rule, no message pattern needed.
    trainer = jobset.trainer_jobset(spec, refs)
    assert len(trainer["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]) == 1
