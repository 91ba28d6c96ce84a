"""The pod contract: every name, number and path that a trainer-image pod and the code that builds it share, defined
once. The builder (workloads/: the trainer JobSet, the Ray job, the staging Job, the service's engine and API) writes
them into the pod; the programs in the image (trainer/: `python -m trainer`, `python -m trainer.stage`,
`python -m trainer.service`) read them or answer with them. Both import this module; neither restates a value.

Standard library only, and nothing above the floor (tests/test_layers.py): the trainer image holds envspec/
(trainer/Dockerfile), the stack imports it without JAX or Pydantic.
"""

from __future__ import annotations

from typing import Final

# ---------------------------------------------------------------- environment variables

# The process group of a multi-host job (trainer/run/distributed.py reads them; workloads/jobset.py job_env writes them,
# trainer/run/launch.py mimics them for local processes). All or none: a partial set is refused.
ENV_COORDINATOR: Final = "COORDINATOR_ADDRESS"  # host:port of jax.distributed's coordinator (process 0)
ENV_NUM_SLICES: Final = "NUM_SLICES"
ENV_SLICE_INDEX: Final = "SLICE_INDEX"
ENV_HOSTS_PER_SLICE: Final = "HOSTS_PER_SLICE"
ENV_HOST_INDEX: Final = "HOST_INDEX"
# The job's own directory on the checkpoint bucket's mount (trainer/rl/train.py; the Ray job's workers too).
ENV_CHECKPOINT_DIR: Final = "CHECKPOINT_DIR"
# A Hugging Face token for gated repos (huggingface_hub reads it; trainer/stage.py passes it on), from a Secret.
ENV_HF_TOKEN: Final = "HF_TOKEN"

# The service's store: a Cloud SQL instance, reached through the Cloud SQL Python Connector as an IAM database user
# (trainer/service/store/connection.py cloudsql_settings reads them; workloads/service.py db_env and engine_job
# write them).
CLOUDSQL_INSTANCE_ENV: Final = "GKE_TPU_RL_CLOUDSQL_INSTANCE"  # PROJECT:REGION:INSTANCE
CLOUDSQL_USER_ENV: Final = "GKE_TPU_RL_CLOUDSQL_USER"
CLOUDSQL_DATABASE_ENV: Final = "GKE_TPU_RL_CLOUDSQL_DATABASE"
# A google-auth credential configuration (JSON) the connector logs in with, in place of Application Default
# Credentials: the engine's pods, which may run on the host network (workloads/service.py engine_credentials).
CLOUDSQL_CREDENTIALS_ENV: Final = "GKE_TPU_RL_CLOUDSQL_CREDENTIALS"

# ---------------------------------------------------------------- exit codes

# A bad config, flag or input: what a retry cannot fix. The trainer JobSet fails at once on it (it is no restart
# code); the staging Job's podFailurePolicy fails the Job on it instead of spending its retries (workloads/stage.py).
EXIT_CONFIG: Final = 2
# A runtime failure worth retrying (a lost peer, a DCN or libtpu timeout, the store or the bucket unavailable at
# start): restart me. 42 is the code xpk and MaxText use for it.
EXIT_TRANSIENT: Final = 42
# 128 + SIGINT: the service stopped by hand (trainer/service/cli.py).
EXIT_INTERRUPTED: Final = 130
# 128 + SIGTERM: a preempted pod "fails" so the JobSet restarts it and the run resumes from its last checkpoint.
EXIT_STOPPED: Final = 143
# Death by a signal, 128 + n (SIGTERM's own 143, SIGKILL 137, a libtpu abort 134): never the program's judgement.
SIGNAL_EXIT_CODES: Final = range(128, 256)
# What the JobSets restart on (workloads/jobset.py podFailurePolicy): every other exit code is a bug and fails them.
RESTART_EXIT_CODES: Final = (EXIT_TRANSIENT, *SIGNAL_EXIT_CODES)

# ---------------------------------------------------------------- paths and files

# Where every trainer-image pod on a TPU slice mounts the checkpoint bucket (GCS FUSE); each job's CHECKPOINT_DIR
# is a folder in it, and the staging Job writes what the trainer config's init.path and task.path read there.
CHECKPOINT_MOUNT: Final = "/checkpoints"
# Where the image holds the environment's trainer.code (trainer/Dockerfile's USER_CODE_DIR; a test checks they
# agree): a pod's `--config` names a file of it by this path (workloads/trainer_pod.py config_args).
USER_CODE_DIR: Final = "/opt/user-code"

# ---------------------------------------------------------------- what an exit code says (`gke-tpu-rl status`)

_SIGNALS: Final = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


def exit_code_meaning(code: int) -> str:
    """What a trainer-image container's exit code says, in the terms of the codes above."""
    if code == 0:
        return "finished"
    if code == EXIT_CONFIG:
        return "bad config, flag or input (a retry cannot fix it)"
    if code == EXIT_TRANSIENT:
        return "transient failure (a lost peer, a timeout, the bucket or store unavailable): restart me"
    if code == EXIT_STOPPED:
        return "SIGTERM (preemption, maintenance or a delete): the trainer saved a checkpoint and stopped"
    if code == EXIT_INTERRUPTED:
        return "SIGINT: stopped by hand"
    if code in SIGNAL_EXIT_CODES:
        name = _SIGNALS.get(code - 128, f"signal {code - 128}")
        return f"killed by {name}" + {9: " (out of memory, or still running when the grace period ended)",
                                      6: " (an abort, e.g. libtpu)"}.get(code - 128, "")
    return "an error of the program (a bug: the traceback is in the container's log)"
