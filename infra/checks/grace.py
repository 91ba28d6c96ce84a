"""How long the trainer's pods need between SIGTERM and SIGKILL: what trainer.terminationGraceSeconds must cover.

On SIGTERM (a `pulumi up` that replaces the job, Kueue preempting it, a node drain) the trainer finishes the step in
flight, waits for the async save still running, writes one last checkpoint and exits 143 (trainer/rl/checkpoint.py
StopFlag). Each host writes its own shards of the parameters and the optimizer state through the gcsfuse sidecar,
so the time is set by the bytes per host. A Spot VM's preemption is not covered by any grace period: GKE gives its
pods about 30 s, so there the periodic checkpoints (checkpoint.every) bound what is lost. Nor is the Ray path:
Ray stops its workers by killing them (trainer/run/ray_train.py), so a replaced RayJob resumes from its last periodic
checkpoint whatever the grace period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from envspec.config import NAMESPACE, ConfigError, EnvironmentSpec
from infra.base.pod_config import env_job

KEY = f"{NAMESPACE}:trainer.terminationGraceSeconds"
# Sustained write rate of one host to Cloud Storage through its gcsfuse sidecar, assumed. gcsfuse's own benchmarks
# (GoogleCloudPlatform/gcsfuse docs/benchmarks.md: n2-standard-96, 100 Gbps, 112 writer threads) reach 2.6-4.4 GiB/s
# for large files; a TPU host's sidecar runs on a 500m CPU request with far fewer writers, so this takes about a
# thirteenth of that. Measure a save on the real slice and raise the grace period if it is slower.
WRITE_MIB_S_PER_HOST = 200
# The step in flight when SIGTERM lands finishes before the save starts (an RL step of a 70B model is tens of
# seconds to minutes: `gke-tpu-rl fit` prints the estimate for the environment's slice).
STEP_ALLOWANCE_S = 120
# Parameter-sized copies in a checkpoint, per optimizer (trainer/rl/optim.py): the parameters, plus AdamW's two moments
# in their dtype; Adafactor keeps no first moment and factored second moments (rows + columns: not counted).
STATE_COPIES = {"adamw": 3, "adafactor": 1}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class GraceEstimate:
    model: str
    state_bytes: int  # parameters and optimizer state, all shards
    writers: int  # hosts that write distinct shards
    seconds: int  # the grace period a SIGTERM checkpoint needs

    @property
    def bytes_per_host(self) -> float:
        return self.state_bytes / self.writers

    def describe(self) -> str:
        return (f"{self.model}: {self.state_bytes / 1e9:.1f} GB of parameters and optimizer state, "
                f"{self.bytes_per_host / 1e9:.1f} GB written per host at an assumed {WRITE_MIB_S_PER_HOST} MiB/s, "
                f"twice (the save in flight, then the last one), plus {STEP_ALLOWANCE_S} s for the step in flight")


def estimate(spec: EnvironmentSpec) -> GraceEstimate | None:
    """The grace period the environment's JobSet trainer needs, from its config's model; None on the Ray path (no
    SIGTERM checkpoint) and when the model is not one this machine knows (a custom checkpoint not bundled here)."""
    from trainer.base.config import ConfigError as TrainerConfigError
    from trainer.fit.preflight import param_count, resolve_model

    if not spec.trainer.enabled or spec.trainer_group is None or spec.runs_on_ray:
        return None
    job = env_job(spec)
    try:
        cfg, where = resolve_model(job.cfg)
    except TrainerConfigError:
        return None
    model = cfg.model_cfg
    state = STATE_COPIES[cfg.optim.name] * param_count(model) * DTYPE_BYTES[model.param_dtype]
    hosts = spec.trainer_group.shape.hosts
    # Slices holding replicas of the state write one copy (orbax writes each shard once); sharded across slices,
    # every host of every slice writes its own.
    writers = hosts * (job.cfg.mesh.slices if job.cfg.mesh.fsdp_across_slices else 1)
    save_s = state / writers / (WRITE_MIB_S_PER_HOST * 2**20)
    return GraceEstimate(where.split(" (")[0], state, writers, math.ceil(2 * save_s + STEP_ALLOWANCE_S))


def check(spec: EnvironmentSpec) -> GraceEstimate | None:
    """Refuses a grace period shorter than the estimate, naming the key and the figures."""
    found = estimate(spec)
    have = spec.trainer.termination_grace_seconds
    if found is not None and have < found.seconds:
        raise ConfigError(f"invalid stack config for environment {spec.env!r}:\n  {KEY}: {have} s is too short to "
                          f"save a checkpoint on SIGTERM: about {found.seconds} s for {found.describe()}; set it to "
                          f"at least {found.seconds}")
    return found
