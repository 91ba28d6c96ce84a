"""Compute Engine machine types and what GKE leaves of them to pods: the catalog the stack config validates
`cluster.systemPool.machineType` against, and GKE's allocatable per node (infra/checks/system_pool.py packs pods
onto it)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# ---------------------------------------------------------------- quantities


@dataclass(frozen=True)
class Requests:
    """CPU in millicores and memory in MiB (floats: GKE's reservations are fractions of GiB)."""

    cpu_m: float
    memory_mib: float

    def __add__(self, other: Requests) -> Requests:
        return Requests(self.cpu_m + other.cpu_m, self.memory_mib + other.memory_mib)

    def __sub__(self, other: Requests) -> Requests:
        return Requests(self.cpu_m - other.cpu_m, self.memory_mib - other.memory_mib)

    def fits_in(self, free: Requests) -> bool:
        eps = 1e-6  # the tiered reservations are sums of float shares
        return self.cpu_m <= free.cpu_m + eps and self.memory_mib <= free.memory_mib + eps

    @property
    def vcpu(self) -> str:
        return f"{round(self.cpu_m / 1000, 3):g}"

    @property
    def gib(self) -> str:
        return f"{self.memory_mib / 1024:.2f}"

    def __str__(self) -> str:
        return f"{self.vcpu} vCPU / {self.gib} GiB"


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
_MEMORY_UNITS = {"": 1 / 2**20, "k": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20, "Ki": 1 / 1024, "Mi": 1.0,
                 "Gi": 1024.0, "Ti": 1024.0**2}


def _parse(q: str, units: Mapping[str, float], what: str) -> float:
    m = _QUANTITY.match(str(q))
    if not m or m.group(2) not in units:
        raise ValueError(f"{q!r} is not a Kubernetes {what} quantity this check reads ({', '.join(units)})")
    return float(m.group(1)) * units[m.group(2)]


def cpu_millicores(q: str) -> float:
    return _parse(q, {"": 1000.0, "m": 1.0}, "CPU")


def memory_mib(q: str) -> float:
    return _parse(q, _MEMORY_UNITS, "memory")


def requests_of(resources: Mapping[str, str]) -> Requests:
    return Requests(cpu_millicores(resources["cpu"]), memory_mib(resources["memory"]))


# ---------------------------------------------------------------- machines

# Compute Engine's predefined general-purpose machine types, <family>-<kind>-<vCPUs>: memory per vCPU in GiB (Compute
# Engine's "GB" of machine memory are GiB: e2-standard-4 reports memoryMb 16384) and the vCPU counts offered, from
# https://cloud.google.com/compute/docs/general-purpose-machines. Left out: shared-core types (e2-micro/small/medium,
# for which GKE reserves a flat 1060m of CPU, not the formula below) and the series not restated here yet (C4, C3D,
# T2D, ...): add a series with its sizes and memory per vCPU from that page.
_E2 = (2, 4, 8, 16, 32)
_N2 = (2, 4, 8, 16, 32, 48, 64, 80, 96, 128)
_N2D = (2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 224)
_N4 = (2, 4, 8, 16, 32, 48, 64, 80)
_C3 = (4, 8, 22, 44, 88, 176)
_N1 = (2, 4, 8, 16, 32, 64, 96)
MACHINE_FAMILIES: dict[str, dict[str, tuple[float, tuple[int, ...]]]] = {
    "e2": {"standard": (4, _E2), "highmem": (8, _E2[:-1]), "highcpu": (1, _E2)},
    "n2": {"standard": (4, _N2), "highmem": (8, _N2), "highcpu": (1, _N2[:-1])},
    "n2d": {"standard": (4, _N2D), "highmem": (8, _N2D[:-2]), "highcpu": (1, _N2D)},
    "n4": {"standard": (4, _N4), "highmem": (8, _N4), "highcpu": (2, _N4)},
    "c3": {"standard": (4, _C3), "highmem": (8, _C3), "highcpu": (2, _C3)},
    "n1": {"standard": (3.75, (1, *_N1)), "highmem": (6.5, _N1), "highcpu": (0.9, _N1)},
}
_MACHINE = re.compile(r"^([a-z][a-z0-9]*)-([a-z]+)-([0-9]+)$")


@dataclass(frozen=True)
class Machine:
    name: str
    family: str
    kind: str
    vcpus: int
    memory_gib: float


def _allowed() -> str:
    return (f"<family>-<standard|highmem|highcpu>-<vCPUs> for families {', '.join(sorted(MACHINE_FAMILIES))} "
            "(e.g. e2-standard-8)")


def machine(name: str) -> Machine:
    """The machine type's vCPUs and memory, or a ValueError naming what is allowed (sections/cluster.py SystemPoolSpec
    calls it)."""
    m = _MACHINE.match(name)
    if not m or m.group(1) not in MACHINE_FAMILIES or m.group(2) not in MACHINE_FAMILIES[m.group(1)]:
        raise ValueError(f"{name!r} is not a machine type the system-pool check knows; allowed: {_allowed()}; "
                         "not shared-core types (e2-micro, e2-small, e2-medium: GKE reserves a flat 1060m of their "
                         "CPU)")
    family, kind, vcpus = m.group(1), m.group(2), int(m.group(3))
    per_vcpu, sizes = MACHINE_FAMILIES[family][kind]
    if vcpus not in sizes:
        raise ValueError(f"{name!r}: {family}-{kind} comes with {', '.join(map(str, sizes))} vCPUs; allowed: "
                         + ", ".join(f"{family}-{kind}-{n}" for n in sizes))
    return Machine(name, family, kind, vcpus, per_vcpu * vcpus)


# ---------------------------------------------------------------- GKE's allocatable

# GKE's reservations for Standard nodes (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes,
# "Memory and CPU reservations"): CPU 6% of the first core, 1% of the next, 0.5% of the next 2, 0.25% of every core
# above 4; memory 255 MiB on machines under 1 GiB, else 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8,
# 6% of the next 112 and 2% above 128 GiB; plus a 100 MiB eviction threshold.
CPU_TIERS = ((1, 0.06), (1, 0.01), (2, 0.005), (None, 0.0025))  # (cores in the tier, share reserved)
MEMORY_TIERS_GIB = ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (None, 0.02))
SMALL_MACHINE_RESERVED_MIB = 255
EVICTION_THRESHOLD_MIB = 100
# The kubelet's memory capacity is what the kernel reports (MemTotal), below the machine's nominal memory. Estimated
# from that page's own example node (4 vCPU, allocatable cpu 3920m and memory 13498416Ki, so a 16 GiB machine): the
# formula gives that allocatable for a capacity 3% below 16 GiB. An estimate, not a documented figure.
KERNEL_MEMORY_SHARE = 0.03


def _tiered(amount: float, tiers: Iterable[tuple[float | None, float]]) -> float:
    reserved, left = 0.0, amount
    for size, share in tiers:
        part = left if size is None else min(left, size)
        reserved += part * share
        left -= part
        if left <= 0:
            break
    return reserved


def reserved_cpu_m(vcpus: float) -> float:
    return _tiered(vcpus, CPU_TIERS) * 1000


def reserved_memory_mib(capacity_mib: float) -> float:
    """GKE's memory reservation for a node of this capacity, without the eviction threshold."""
    if capacity_mib < 1024:
        return SMALL_MACHINE_RESERVED_MIB
    return _tiered(capacity_mib / 1024, MEMORY_TIERS_GIB) * 1024


def allocatable(m: Machine) -> Requests:
    """What the scheduler may place on one node of this machine type."""
    capacity = m.memory_gib * 1024 * (1 - KERNEL_MEMORY_SHARE)
    return Requests(m.vcpus * 1000 - reserved_cpu_m(m.vcpus),
                    capacity - reserved_memory_mib(capacity) - EVICTION_THRESHOLD_MIB)
