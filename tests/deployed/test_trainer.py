"""The staging trainer as deployed: a user's copy of environments/Pulumi.staging.yaml whose only changes are what a
team could set itself (trainer.stage.model: a tiny model on the Hub; trainer.args: a batch and mesh for one CPU device
per pod), rendered by the plan and run by the harness (tests/deployed/cluster.py): the staging Job fetches the model
and GSM8K into the bucket, then the JobSet's 2 slices x 4 hosts start with their rendered commands, env (the
coordinator's JobSet DNS name, the slice and host indexes from the downward API) and the bucket at /checkpoints.

What a user relies on: the job trains across its 8 pods and checkpoints into the bucket; a preemption (SIGTERM to one
pod) and a crash (SIGKILL) restart the whole JobSet, which resumes from the last checkpoint; a bug (here: the staged
dataset gone, the trainer's config error, exit 2) fails the JobSet with the reason visible, not a restart loop.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.deployed.conftest import trainer_on_cpu

# What a team sets to try the 70B staging config on CPUs (one device per pod: 2 slices x fsdp 4).
TRAINER_ARGS = [a for kv in ("mesh.tensor=1", "compute.param_dtype=float32", "compute.dtype=float32",
                             "compute.train_micro_batch_size=8", "compute.grad_accum_dtype=float32", "rl.group_size=2",
                             "rl.prompts_per_step=4", "sampling.max_prompt_len=128", "sampling.max_new_tokens=8",
                             "sampling.tensor=1", "sampling.max_num_sequences=8", "steps=1000", "checkpoint.every=1",
                             "checkpoint.keep=2") for a in ("--set", kv)]


def _steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def _checkpoints(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def test_the_trainer_as_deployed(harness_lock: None, work: Path, tmp_path: Path) -> None:
    rendered, cluster = trainer_on_cpu("staging", work, tmp_path, TRAINER_ARGS)
    spec = rendered.result.spec
    name = spec.trainer.name
    bucket = work / "cluster" / "buckets" / spec.bucket_name
    ckpt = bucket / name  # CHECKPOINT_DIR=/checkpoints/<trainer> (workloads/trainer_pod.py)
    metrics = ckpt / "run" / "metrics.jsonl"
    with cluster as c:
        c.wait("the staging Job completes", lambda: c.jobs.get(f"{name}-stage") is not None
               and c.jobs[f"{name}-stage"].status == "Complete", 300)
        c.wait("two checkpointed steps", lambda: len(_checkpoints(ckpt)) >= 1 and len(_steps(metrics)) >= 2, 600)
        js = c.jobsets[name]
        assert len([p for j in js.jobs for p in j.pods]) == 8

        # A preemption: SIGTERM to one host of the second slice. Every pod restarts; the run resumes.
        for sig, attempt in ((signal.SIGTERM, 1), (signal.SIGKILL, 2)):
            done = len(_steps(metrics))
            c.kill(f"{name}-slice-1-2", sig)
            c.wait(f"the JobSet restarts after signal {sig}", lambda a=attempt: js.restarts == a and not js.recreating,
                   300)
            c.wait("it trains again", lambda d=done: len(_steps(metrics)) > d + 1, 600)
            log = c.log(f"{name}-slice-0-0")
            assert log.count("resuming from checkpoint step") >= attempt, log[-3000:]
            assert min(_steps(metrics)[done:]) > 0, "started over instead of resuming"
            assert js.status == "Active" and js.restarts_toward_max == attempt, js.history

        # Process 0 kept the compiled programs beside the checkpoints (checkpoint.compile_cache) for the restarts.
        assert list((ckpt / "_jax-compile-cache").iterdir())

        # A bug: the dataset the config reads is gone; the next start exits 2, which fails the JobSet at once.
        (bucket / "data" / "gsm8k" / "train.jsonl").unlink()
        c.kill(f"{name}-slice-0-1", signal.SIGTERM)
        c.wait("the JobSet fails", lambda: js.status == "Failed", 600)
        assert js.reason == "FailJobSetFailurePolicyAction", (js.reason, js.message)
        failed = c.jobs[js.message.rsplit("first failed job: ", 1)[-1].rstrip(")")]
        assert failed.reason == "PodFailurePolicy" and "failed with exit code 2 matching FailJob rule" in failed.message
        assert js.restarts == 3 and js.restarts_toward_max == 3, js.history
        # Every pod is being deleted (SIGTERM, SIGKILL after the grace period): none is left to run on.
        assert all(p.deleting is not None or not any(cont.running() for cont in p.containers)
                   for j in js.jobs for p in j.pods)



# Asynchronous RL as a team sets it (docs/async-rl.md, "In the stack"): one 4-host slice of the staging group, each
# host's chips split between sampling and the update (a split by slice or host runs too, in
# test_split_by_process_equals_one_process), lag 1. A split config names its mesh (the pods set none), so mesh.slices=1
# here. The stack counts it against 16 chips (mesh 1x8x1 + sampler 1x8x1); here 2 CPU devices per pod: 1 samples, 1
# trains.
SPLIT_ARGS = [a for kv in ("mesh.slices=1", "mesh.tensor=1", "compute.param_dtype=float32", "compute.dtype=float32",
                           "compute.train_micro_batch_size=8", "compute.grad_accum_dtype=float32", "rl.group_size=2",
                           "rl.prompts_per_step=4", "sampling.max_prompt_len=128", "sampling.max_new_tokens=8",
                           "sampling.tensor=null", "sampling.max_num_sequences=8", "steps=4", "checkpoint.every=1",
                           "checkpoint.keep=2", "placement.mode=split", "placement.sampler.fsdp=-1", "rl.lag=1")
              for a in ("--set", kv)]


@pytest.mark.long  # 3-5 min on 2 cores: `make deployed` and `make test-long` run it, `make test` does not
def test_split_placement_with_lag_as_deployed(harness_lock: None, work: Path, tmp_path: Path) -> None:
    rendered, cluster = trainer_on_cpu("staging", work, tmp_path, SPLIT_ARGS, cpu_devices=2,
                                      # One slice's 4 hosts write the 70B config's checkpoint: a longer grace period.
                                      trainer={"slices": 1, "terminationGraceSeconds": 900})
    spec = rendered.result.spec
    name = spec.trainer.name
    ckpt = work / "cluster" / "buckets" / spec.bucket_name / name
    metrics = ckpt / "run" / "metrics.jsonl"
    with cluster as c:
        c.wait("the staging Job completes", lambda: c.jobs.get(f"{name}-stage") is not None
               and c.jobs[f"{name}-stage"].status == "Complete", 300)
        # A save that finished (its commit marker): a kill during the first save would start over, not resume.
        c.wait("a checkpointed step", lambda: any((ckpt / str(s) / "commit_success.txt").is_file()
                                                  for s in _checkpoints(ckpt)), 600)
        js = c.jobsets[name]
        assert len([p for j in js.jobs for p in j.pods]) == 4
        done = len(_steps(metrics))
        c.kill(f"{name}-slice-0-2", signal.SIGKILL)  # a crash: the JobSet restarts and resumes, rollouts queued
        c.wait("the JobSet completes", lambda: js.status == "Completed", 900)
        # One restart: the kill's. (A second one, after the resume, was gloo's "Received data size doesn't match
        # expected size": the processes' agreements crossed the sampling's collectives, docs/async-rl.md.)
        assert js.restarts == 1, js.history
        assert "resuming from checkpoint step" in c.log(f"{name}-slice-0-0")
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        assert min(r["step"] for r in records[done:]) > 0, "started over instead of resuming"
        last = records[-1]
        assert last["step"] == 3 and last["lag"] == 1 and last["policy_version"] == 2, last
        assert all(r["push_bytes"] > 0 for r in records), [r["push_bytes"] for r in records]
