"""Process-group setup from the pod environment the stack's JobSet gives each host (and `launch.py` mimics).

With none of the variables set the trainer runs as a single process and never calls jax.distributed.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from envspec.pod import (
    ENV_COORDINATOR,
    ENV_HOST_INDEX,
    ENV_HOSTS_PER_SLICE,
    ENV_NUM_SLICES,
    ENV_SLICE_INDEX,
)
from trainer.base.config import ConfigError

# The pod's names (COORDINATOR_ADDRESS, ...) are the pod contract's (envspec/pod.py); these two are the trainer's own.
ENV_CPU_DEVICES = "TRAINER_CPU_DEVICES"  # set by the local launcher only
# Seconds every process waits for the whole process group to join at start-up (optional on the pods).
ENV_INIT_TIMEOUT = "TRAINER_INIT_TIMEOUT_SECONDS"
# jax's default is 300 s. After a preemption the lost host's pod waits for its node: GKE auto-repairs a node only
# after ~10 min NotReady, then re-creates it, and the pod still pulls its image. A wait that runs out costs one JobSet
# restart of maxRestarts, so err long: maxRestarts x 15 min of patience before the run fails.
DEFAULT_INIT_TIMEOUT_S = 900
# jax's own start-up deadline ends the process with a native abort (LOG(FATAL), SIGABRT) that Python cannot catch,
# so the watchdog in initialize_from_env fires first and jax's deadline stays only as a backstop this much later.
_JAX_BACKSTOP_S = 60

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
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S

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
    timeout = _int(env, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S)
    if timeout <= 0:
        raise ConfigError(f"environment variable {ENV_INIT_TIMEOUT}={env[ENV_INIT_TIMEOUT]!r} must be a positive "
                          "number of seconds")
    if not present:
        return ProcessInfo(None, 1, 0, 1, 0, cpu, timeout)
    info = ProcessInfo(
        coordinator=env[ENV_COORDINATOR],
        num_slices=_int(env, ENV_NUM_SLICES, 1),
        slice_index=_int(env, ENV_SLICE_INDEX, 0),
        hosts_per_slice=_int(env, ENV_HOSTS_PER_SLICE, 1),
        host_index=_int(env, ENV_HOST_INDEX, 0),
        cpu_devices=cpu,
        init_timeout_s=timeout,
    )
    if not (0 <= info.slice_index < info.num_slices and 0 <= info.host_index < info.hosts_per_slice):
        raise ConfigError(
            f"{ENV_SLICE_INDEX}={info.slice_index}/{ENV_NUM_SLICES}={info.num_slices} or "
            f"{ENV_HOST_INDEX}={info.host_index}/{ENV_HOSTS_PER_SLICE}={info.hosts_per_slice} out of range"
        )
    return info


def _exit_unless_cancelled(info: ProcessInfo, code: int) -> threading.Timer:
    def fire() -> None:
        print(f"error: the process group did not form within {info.init_timeout_s} s ({ENV_INIT_TIMEOUT}): "
              f"coordinator {info.coordinator} unreachable or a peer never joined (this is process "
              f"{info.process_id} of {info.num_processes}); exiting {code} to be restarted",
              file=sys.stderr, flush=True)
        os._exit(code)  # the main thread is blocked in native code: nothing else can end the wait

    timer = threading.Timer(info.init_timeout_s, fire)
    timer.name, timer.daemon = "jax-init-watchdog", True
    timer.start()
    return timer


def _visible_accelerator(env: Mapping[str, str]) -> bool:
    """Whether this host may have a TPU or GPU for JAX, judged without starting a backend: device nodes, the PCI
    scan jax itself uses, and the variables that ask for TPU. Errs towards True (then JAX chooses, as it always did)."""
    if any(env.get(n) for n in ("JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")):
        return True
    # TPU VMs and GKE TPU pods: /dev/accel* (v2-v4) or /dev/vfio/N (v5e and later); GPUs: /dev/nvidia*, /dev/kfd.
    if any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia*", "/dev/kfd", "/dev/dxg")):
        return True
    try:
        from jax._src import hardware_utils as hw

        return hw.num_available_tpu_chips_and_device_id()[0] > 0 or hw.has_visible_nvidia_gpu()
    except Exception:  # a jax without these helpers: cannot tell, so do not choose for it
        return True


def cpu_only_host(env: Mapping[str, str] | None = None) -> bool:
    """True when JAX would end up on CPU anyway but would first start libtpu (installed by jax[tpu] on any Linux
    x86_64 machine), which then prints start-up errors about a TPU that is not there: no platform chosen
    (JAX_PLATFORMS), libtpu installed, and no TPU or GPU visible."""
    import jax

    env = os.environ if env is None else env
    # jax's Config sets its options as attributes at run time: no declaration for mypy to read.
    if jax.config.jax_platforms or importlib.util.find_spec("libtpu") is None:  # type: ignore[attr-defined]
        return False
    return not _visible_accelerator(env)


def initialize_from_env(env: Mapping[str, str] | None = None, *, exit_on_timeout: int | None = None) -> ProcessInfo:
    """Configure JAX for this process; must run before anything touches a JAX backend.

    With `exit_on_timeout`, a process group that has not formed within the start-up timeout ends the process with
    that exit code and one line on stderr (the trainer's CLI: restart me); without it, jax's own deadline aborts it.
    """
    import jax

    info = process_info_from_env(env)
    if info.cpu_devices:
        # Local CPU simulation: N virtual devices per process, gloo for cross-process collectives.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", info.cpu_devices)
        if info.multi_process:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    elif not info.multi_process and cpu_only_host(env):
        # A plain run on a machine without accelerators (`gke-tpu-rl train`): CPU without trying libtpu first. A pod
        # of the JobSet (multi-process, no TRAINER_CPU_DEVICES) always leaves the choice to JAX.
        jax.config.update("jax_platforms", "cpu")
    if info.multi_process:
        watchdog = None if exit_on_timeout is None else _exit_unless_cancelled(info, exit_on_timeout)
        try:
            jax.distributed.initialize(
                coordinator_address=info.coordinator,
                num_processes=info.num_processes,
                process_id=info.process_id,
                initialization_timeout=info.init_timeout_s + (0 if watchdog is None else _JAX_BACKSTOP_S),
            )
        finally:
            if watchdog is not None:
                watchdog.cancel()
    return info
