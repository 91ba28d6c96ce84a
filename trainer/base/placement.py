"""Which devices train and which sample with placement.mode=split: one rule for the trainer (trainer/rl/rollouts.py
applies it to jax.devices()) and for the stack (infra/checks/placement.py applies it to the chips of an environment's
slices, before anything is registered), so the stack refuses exactly the splits the trainer would.

Pure Python (no JAX): a device is anything with `id`, `process_index` and, on TPU, `slice_index`; `job_devices`
makes such records for a job of slices x hosts x chips (one process per host, as the JobSet runs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer.base.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class DeviceSlot:
    """A device as the split sees it: its id, the process (host) holding it, its slice."""

    id: int
    process_index: int
    slice_index: int = 0


def job_devices(slices: int, hosts_per_slice: int, chips_per_host: int) -> list[DeviceSlot]:
    """The devices of a job over `slices` slices of `hosts_per_slice` hosts of `chips_per_host` chips, one process
    per host (process index slice-major, as the JobSet numbers its pods)."""
    per_slice = hosts_per_slice * chips_per_host
    return [DeviceSlot(s * per_slice + h * chips_per_host + c, s * hosts_per_slice + h, s)
            for s in range(slices) for h in range(hosts_per_slice) for c in range(chips_per_host)]


def split_devices(devices: Sequence[Any], first: int, second: int, first_slices: int = 1
                  ) -> tuple[list[Any], list[Any]]:
    """Two disjoint groups of `first` and `second` devices (placement.mode=split: the trainer's, the sampler's). By
    slice where the devices carry several slice indices (multislice: the first `first_slices` slices, then the next
    ones); else within each process where the groups split evenly over the processes (each process holds devices of
    both: its first ones for `first`), else in (process, id) order: the first devices, then the next ones."""
    devices = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id))
    by_slice: dict[int, list[Any]] = {}
    by_process: dict[int, list[Any]] = {}
    for d in devices:
        by_slice.setdefault(getattr(d, "slice_index", 0), []).append(d)
        by_process.setdefault(d.process_index, []).append(d)
    n_proc = len(by_process)
    if len(by_slice) > 1:
        slices = [by_slice[i] for i in sorted(by_slice)]
        a = [d for s in slices[:first_slices] for d in s]
        b = [d for s in slices[first_slices:] for d in s][:second]
    elif n_proc > 1 and first % n_proc == 0 and second % n_proc == 0:
        f, s = first // n_proc, second // n_proc
        a = [d for p in sorted(by_process) for d in by_process[p][:f]]
        b = [d for p in sorted(by_process) for d in by_process[p][f:f + s]]
    else:
        a, b = devices[:first], devices[first:first + second]
    if len(a) != first or len(b) != second:
        raise ValueError(f"cannot split {len(devices)} devices ({len(by_slice)} slice(s)) into groups of {first} and "
                         f"{second}: with several slices each group must take whole slices")
    return a, b


def split_groups(cfg: TrainConfig, devices: Sequence[Any], n_processes: int) -> tuple[list[Any], list[Any]]:
    """The trainer's and the sampler's devices of a resolved split config (resolve_mesh), in a job of `n_processes`
    processes. Raises ConfigError for a split the trainer cannot run there."""
    m, s = cfg.mesh, cfg.placement.sampler
    n_mesh, n_sampler = m.slices * m.fsdp * m.tensor, s.slices * s.fsdp * s.tensor
    try:
        mine, theirs = split_devices(devices, n_mesh, n_sampler, m.slices)
    except ValueError as err:
        raise ConfigError(f"mesh / placement.sampler: {err}") from None
    if n_processes > 1:
        check_multiprocess_split(mine, theirs, n_processes)
    return mine, theirs


def check_multiprocess_split(trainer: Sequence[Any], sampler: Sequence[Any], n_processes: int) -> None:
    """Refuse the splits of a job of several processes that cannot run (docs/async-rl.md, "Multi-process").

    Two run: within each process (every process holds devices of both groups, as many of each), and by process
    (slice or host: each process holds devices of one group only; the first processes train). The push and the
    rollouts' way back are a Bridge over both groups either way (trainer/model/transfer.py)."""
    per: dict[int, list[int]] = {}
    for group, devices in enumerate((trainer, sampler)):
        for d in devices:
            per.setdefault(d.process_index, [0, 0])[group] += 1
    within = all(a == b for a, b in per.values())
    by_process = all(a == 0 or b == 0 for a, b in per.values())
    why = ""
    if len(trainer) != len(sampler):
        # The Bridge pairs each trainer device with one sampler device; unequal groups need another transfer
        # (jax.experimental.transfer, or jax's DCN cross-host device_put: TFRT TPU runtime only in jax 0.10.2).
        why = f"mesh and placement.sampler of equal size (now {len(trainer)} and {len(sampler)} devices)"
    elif len(per) != n_processes:
        why = f"every process to hold devices of one group at least ({n_processes - len(per)} hold none)"
    elif not (within or by_process):
        why = ("each process to hold as many devices of both groups (a split within each host) or devices of one "
               f"group only (a split by slice or host); devices per process (trainer, sampler): {sorted(per.items())}")
    elif by_process and per.get(0, [0, 0])[0] == 0:
        # Process 0 writes the metrics and the run summary from the update's results.
        why = "process 0 to train (the first slices or hosts train)"
    elif by_process and sum(1 for a, _ in per.values() if a) < 2:
        # orbax 0.12.8 refuses to save an array held by one process of several ("Cannot serialize host local
        # jax.Array": serialization/jax_array_handlers.py, JaxArrayHandler.serialize), and the checkpoint holds
        # the trainer's arrays only.
        why = ("the trainer's devices on 2 processes at least: orbax refuses to checkpoint arrays held by one "
               "process of several (\"host local\")")
    if why:
        raise ConfigError(f"placement.mode=split in a job of {n_processes} processes needs {why}; or use "
                          "placement.mode=colocated (docs/async-rl.md, \"Multi-process\")")


# Why --ray refuses a split placement: each attempt gets its own count of slices, and a split by slice or host would
# change its groups (or become impossible) with it; no split has run under Ray Train. The trainer's Ray driver and the
# stack's check both say this.
RAY_SPLIT_REFUSED = ("placement.mode=split: not with --ray (an elastic run changes its slices between attempts, and "
                     "the split's groups with them); allowed with --ray: placement.mode=colocated (rl.lag works "
                     "colocated too); a split runs under the JobSet launcher")
