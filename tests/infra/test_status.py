"""`gke-tpu-rl status ENV` against the stand-in API server (tests/test_docs_commands.py) serving the staging plan's
objects, what the controllers make of them, and the status fields the controllers would set: names and values as
the upstream API types spell them (JobSet v0.12.0 jobset_types.go and pkg/constants; Kueue v0.19.2
workload_types.go and its scheduler's messages; core/v1 Pod)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import cli
from infra.offline.plan import kubernetes_objects
from tests.infra.conftest import run_stack, stack_config
from tests.test_docs_commands import FakeAPIServer, controller_objects

ENV = "staging"  # the JobSet launcher, 2 slices x 4 hosts


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kubernetes_objects(run_stack(ENV, stack_config(ENV)))


def served(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    objects = json.loads(json.dumps(rendered))
    return objects + controller_objects(objects)


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [obj] = [o for o in objects if o["kind"] == kind]
    return obj


def status(objects: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
           monkeypatch: pytest.MonkeyPatch, env: str = ENV) -> tuple[int, str, str, FakeAPIServer]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    for key in [k for k in os.environ if "proxy" in k.lower() or k.startswith("KUBE")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    server = FakeAPIServer(objects)
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "other",
        "clusters": [{"name": "stg", "cluster": {"server": server.url}}],
        "users": [{"name": "stg", "user": {}}],
        "contexts": [{"name": "stg", "context": {"cluster": "stg", "user": "stg"}},
                     {"name": "other", "context": {"cluster": "missing", "user": "stg"}}]}))
    capsys.readouterr()
    try:
        code = cli.main(["status", env, "--context", "stg", "--kubeconfig", str(config)])
    finally:
        server.close()
    out = capsys.readouterr()
    return code, out.out, out.err, server


def test_running_after_preemptions(rendered: list[dict[str, Any]], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    objects = served(rendered)
    js = one(objects, "JobSet")
    js["status"] = {"restarts": 3, "restartsCountTowardsMax": 1, "replicatedJobsStatus": [
        {"name": "slice", "ready": 2, "succeeded": 0, "failed": 0, "active": 2, "suspended": 0}]}
    code, out, err, server = status(objects, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    # One request, in the environment's namespace, for the four kinds.
    paths = sorted(p for m, p, _ in server.requests if "/namespaces/" in p)
    assert paths == ["/api/v1/namespaces/rl/events", "/api/v1/namespaces/rl/pods",
                     "/apis/jobset.x-k8s.io/v1alpha2/namespaces/rl/jobsets",
                     "/apis/kueue.x-k8s.io/v1beta2/namespaces/rl/workloads"]
    lines = out.splitlines()
    assert lines[0] == "status: staging  (namespace rl, context stg)"
    assert lines[1] == "JobSet grpo-stg (trainer): active; restarts 3, 1 of maxRestarts 3 counted"
    assert lines[2] == ("  Kueue: admitted by cluster queue tpu-cluster-queue, flavor v6e-4x4; pods ready "
                        "[jobset-grpo-stg-5b1e3]")
    assert lines[3] == "  pods: 8 Running (the JobSet runs 8)"
    # The staging Job of trainer.stage is no JobSet and holds no Workload: not on the screen.
    assert len(lines) == 4, out


def test_pending_on_quota(rendered: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Suspended by Kueue: no pods; the Workload's QuotaReserved=False carries the flavor assigner's message."""
    objects = [o for o in served(rendered) if o["kind"] != "Pod" or "jobset.sigs.k8s.io/jobset-name" not in
               o["metadata"].get("labels", {})]
    js = one(objects, "JobSet")
    js["spec"]["suspend"] = True
    js["status"] = {"restarts": 0, "conditions": [{"type": "Suspended", "status": "True", "reason": "SuspendedJobs",
                                                    "message": "jobset is suspended"}]}
    wl = one(objects, "Workload")
    wl["status"] = {"conditions": [{
        "type": "QuotaReserved", "status": "False", "reason": "WaitingForQuota",
        "message": "couldn't assign flavors to pod set slice: insufficient unused quota for google.com/tpu in "
                   "flavor v6e-4x4, 32 more needed"}]}
    code, out, err, _ = status(objects, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "JobSet grpo-stg (trainer): SUSPENDED (Kueue has not admitted it); restarts 0, 0 of maxRestarts 3" in out
    assert ("  Kueue: PENDING: WaitingForQuota: couldn't assign flavors to pod set slice: insufficient unused quota "
            "for google.com/tpu in flavor v6e-4x4, 32 more needed [jobset-grpo-stg-5b1e3]") in out
    assert "  pods: none (the JobSet runs 8)" in out


def test_unschedulable_pods_and_exit_codes(rendered: list[dict[str, Any]], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    objects = served(rendered)
    js = one(objects, "JobSet")
    js["status"] = {"restarts": 3, "restartsCountTowardsMax": 3, "conditions": [
        {"type": "RestartingJobSet", "status": "True", "reason": "DefaultFailurePolicy",
         "message": "applying RestartJobSet failure policy action (first failed job: grpo-stg-slice-1)"}]}
    pods = sorted((o for o in objects if o["kind"] == "Pod" and o["metadata"]["name"].startswith("grpo-stg-slice")),
                  key=lambda p: p["metadata"]["name"])
    for pod in pods[:2]:  # not scheduled: the scheduler's PodScheduled condition
        pod["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/6 nodes are available: 4 Insufficient google.com/tpu."}]}
    pods[2]["status"] = {"phase": "Pending"}  # only an event says why
    objects.append({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e1", "namespace": "rl"},
                    "involvedObject": {"kind": "Pod", "name": pods[2]["metadata"]["name"], "namespace": "rl"},
                    "type": "Warning", "reason": "FailedMount", "message": "MountVolume.SetUp failed for volume "
                    "\"checkpoints\"", "lastTimestamp": "2026-01-01T00:01:00Z"})
    pods[3]["status"] = {"phase": "Failed", "conditions": [{
        "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
        "message": "Pod was terminated in response to imminent node shutdown."}], "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}]}
    pods[4]["status"] = {"phase": "Failed", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}
    code, out, err, _ = status(objects, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert ("RESTARTING: DefaultFailurePolicy: applying RestartJobSet failure policy action (first "
            "failed job: grpo-stg-slice-1); restarts 3, 3 of maxRestarts 3 counted (the next counted failure fails "
            "the JobSet)") in out
    assert "  pods: 2 Failed, 3 Pending, 3 Running (the JobSet runs 8)" in out
    assert "  pending (2 pods): Unschedulable: 0/6 nodes are available: 4 Insufficient google.com/tpu." in out
    assert "  pending (1 pod): FailedMount: MountVolume.SetUp failed for volume \"checkpoints\"" in out
    p3, p4 = pods[3]["metadata"]["name"], pods[4]["metadata"]["name"]
    assert (f"  last exit: {p3} trainer: exit 143 [Error]: SIGTERM (preemption, maintenance or a delete): the "
            "trainer saved a checkpoint and stopped -> the JobSet restarts") in out
    assert (f"  disrupted: {p3}: TerminationByKubelet: Pod was terminated in response to imminent node "
            "shutdown.") in out
    assert (f"  last exit: {p4} trainer: exit 1 [Error]: an error of the program (a bug: the traceback is in the "
            "container's log) -> the JobSet fails (no restart)") in out


def test_a_missing_jobset_and_an_unreachable_cluster(rendered: list[dict[str, Any]], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    objects = [o for o in served(rendered) if o["kind"] not in ("JobSet", "Workload")]
    code, out, err, _ = status(objects, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "JobSet grpo-stg (trainer): NOT FOUND (not created yet by `pulumi up`, or deleted)" in out
    # The kubeconfig's current context points at no cluster: kubectl's own error, and what sets kubectl up.
    config = tmp_path / "kubeconfig"
    code = cli.main(["status", ENV, "--kubeconfig", str(config)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_UNREACHABLE and "error: `kubectl get jobsets.jobset.x-k8s.io," in err
    assert "hint: gcloud container clusters get-credentials" in err
    assert cli.main(["status", "nosuchenv"]) == cli.EXIT_CONFIG


def test_restarts_left_as_jobset_counts_them() -> None:
    """JobSet v0.12.0 restartJobSetActionApplier fails the JobSet once restartsCountTowardsMax >= maxRestarts."""
    from infra.offline.status import jobset_line

    def line(counted: int, max_restarts: int) -> str:
        return jobset_line({"spec": {"failurePolicy": {"maxRestarts": max_restarts}},
                            "status": {"restarts": counted + 5, "restartsCountTowardsMax": counted}})[1]

    assert line(1, 3) == "restarts 6, 1 of maxRestarts 3 counted"
    assert line(2, 3) == "restarts 7, 2 of maxRestarts 3 counted (one restart left)"
    assert line(3, 3).endswith("(the next counted failure fails the JobSet)")
    assert line(0, 0).endswith("(the next counted failure fails the JobSet)")  # maxRestarts 0: no restart at all


def test_a_ray_environment_shows_its_rayjobs_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """dev runs the trainer as a RayJob: no JobSet is expected, and Kueue's verdict on the RayJob is on the screen."""
    objects = served(kubernetes_objects(run_stack("dev", stack_config("dev"))))
    code, out, err, _ = status(objects, tmp_path, capsys, monkeypatch, env="dev")
    assert code == 0, err
    assert out.splitlines()[1:] == ["RayJob grpo-dev: Kueue: admitted by cluster queue tpu-cluster-queue, flavor "
                                    "v6e-2x2; pods ready [rayjob-grpo-dev-5b1e3]"], out
