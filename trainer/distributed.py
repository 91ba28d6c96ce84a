"""Process-group setup from the pod environment the stack's JobSet gives each host (and `launch.py` mimics).

With none of the variables set the trainer runs as a single process and never calls jax.distributed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.config import ConfigError

ENV_COORDINATOR = "COORDINATOR_ADDRESS"
ENV_NUM_SLICES = "NUM_SLICES"
ENV_SLICE_INDEX = "SLICE_INDEX"
ENV_HOSTS_PER_SLICE = "HOSTS_PER_SLICE"
ENV_HOST_INDEX = "HOST_INDEX"
ENV_CHECKPOINT_DIR = "CHECKPOINT_DIR"
ENV_HF_TOKEN = "HF_TOKEN"
ENV_CPU_DEVICES = "TRAINER_CPU_DEVICES"  # set by the local launcher only

# Required on every pod; an infra test checks the JobSet sets exactly these.
POD_ENV_VARS: tuple[str, ...] = (
    ENV_COORDINATOR,
    ENV_NUM_SLICES,
    ENV_SLICE_INDEX,
    ENV_HOSTS_PER_SLICE,
    ENV_HOST_INDEX,
)
# Consumed by libtpu for multislice; the trainer only passes them through.
MEGASCALE_ENV_VARS: tuple[str, ...] = (
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "MEGASCALE_PORT",
)


@dataclass(frozen=True)
class ProcessInfo:
    coordinator: str | None
    num_slices: int
    slice_index: int
    hosts_per_slice: int
    host_index: int
    cpu_devices: int | None

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def process_id(self) -> int:
        return self.slice_index * self.hosts_per_slice + self.host_index

    @property
    def multi_process(self) -> bool:
        return self.coordinator is not None


def cpu_slice_env(coordinator: str, num_slices: int, slice_index: int, cpu_devices: int) -> dict[str, str]:
    """The contract for one process that is a whole one-host slice with `cpu_devices` CPU devices: the local
    launcher's children and the Ray path's CPU workers."""
    return {ENV_COORDINATOR: coordinator, ENV_NUM_SLICES: str(num_slices), ENV_SLICE_INDEX: str(slice_index),
            ENV_HOSTS_PER_SLICE: "1", ENV_HOST_INDEX: "0", ENV_CPU_DEVICES: str(cpu_devices)}


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def process_info_from_env(env: Mapping[str, str] | None = None) -> ProcessInfo:
    env = os.environ if env is None else env
    present = [n for n in POD_ENV_VARS if env.get(n)]
    if present and len(present) != len(POD_ENV_VARS):
        missing = [n for n in POD_ENV_VARS if n not in present]
        raise ConfigError(f"partial distributed environment: {present} set but {missing} missing")
    cpu = _int(env, ENV_CPU_DEVICES, 0) or None
    if not present:
        return ProcessInfo(None, 1, 0, 1, 0, cpu)
    info = ProcessInfo(
        coordinator=env[ENV_COORDINATOR],
        num_slices=_int(env, ENV_NUM_SLICES, 1),
        slice_index=_int(env, ENV_SLICE_INDEX, 0),
        hosts_per_slice=_int(env, ENV_HOSTS_PER_SLICE, 1),
        host_index=_int(env, ENV_HOST_INDEX, 0),
        cpu_devices=cpu,
    )
    if not (0 <= info.slice_index < info.num_slices and 0 <= info.host_index < info.hosts_per_slice):
        raise ConfigError(
            f"{ENV_SLICE_INDEX}={info.slice_index}/{ENV_NUM_SLICES}={info.num_slices} or "
            f"{ENV_HOST_INDEX}={info.host_index}/{ENV_HOSTS_PER_SLICE}={info.hosts_per_slice} out of range"
        )
    return info


def initialize_from_env(env: Mapping[str, str] | None = None) -> ProcessInfo:
    """Configure JAX for this process; must run before anything touches a JAX backend."""
    import jax

    info = process_info_from_env(env)
    if info.cpu_devices:
        # Local CPU simulation: N virtual devices per process, gloo for cross-process collectives.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", info.cpu_devices)
        if info.multi_process:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if info.multi_process:
        jax.distributed.initialize(
            coordinator_address=info.coordinator,
            num_processes=info.num_processes,
            process_id=info.process_id,
        )
    return info
