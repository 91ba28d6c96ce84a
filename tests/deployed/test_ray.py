"""The Ray path as deployed: a user's copy of environments/Pulumi.dev.yaml whose only changes are what a team could set
itself (trainer.stage.model: a tiny model on the Hub; trainer.args: a batch and mesh for one CPU device per pod and a
few steps), rendered by the plan and run by the harness: the staging Job fills the bucket, then the RayJob's pods as
KubeRay 1.7 makes them (tests/deployed/kuberay.py): the head with its generated `ray start --head`, token auth and
the SidecarMode submitter, and one worker per v6e 2x2 slice with its generated `ray start` and what GKE's TPU
webhook and device plugin set, which Ray reads to advertise the slice.

What a user relies on: the submitter's `ray job submit` reaches the head through the cluster's token; the driver's
checks pass on the head; Ray Train reserves both slices and trains on them; the run's steps and checkpoints land in
the bucket; the RayJob completes and its cluster goes (shutdownAfterJobFinishes).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.deployed.conftest import trainer_on_cpu
from tests.deployed.test_trainer import TRAINER_ARGS, _checkpoints

STEPS = 3
ARGS = [*TRAINER_ARGS, "--set", f"steps={STEPS}"]  # the later --set wins


def test_the_ray_path_as_deployed(harness_lock: None, work: Path, tmp_path: Path) -> None:
    rendered, cluster = trainer_on_cpu("dev", work, tmp_path, ARGS)
    spec = rendered.result.spec
    name = spec.trainer.name
    ckpt = work / "cluster" / "buckets" / spec.bucket_name / name
    with cluster as c:
        c.wait("the staging Job completes", lambda: c.jobs.get(f"{name}-stage") is not None
               and c.jobs[f"{name}-stage"].status == "Complete", 300)
        c.wait("the RayJob's head is ready", lambda: name in c.rayjobs and c.rayjobs[name].status != "Initializing",
               300)
        run = c.rayjobs[name]
        c.wait("the RayJob finishes", lambda: run.status in ("Complete", "Failed"), 900)
        head = c.log(run.pods[0])
        assert run.status == "Complete", (run.job_status, run.message, c.report(4000))
        assert "ray: training finished" in head, head[-4000:]
        records = [json.loads(line) for line in (ckpt / "run" / "ray_steps.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(STEPS)), records
        assert all(r["world"] == 2 and r["slices"] == 2 for r in records), records  # both slices reserved
        assert _checkpoints(ckpt), sorted(p.name for p in ckpt.iterdir())
        # shutdownAfterJobFinishes with TTL 0: every pod of the cluster is being deleted.
        assert all(c.pods[p].deleting is not None for p in run.pods)
