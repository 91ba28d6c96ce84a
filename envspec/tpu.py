"""The one TPU catalog: every topology fact the stack, the plan and the workloads use comes from here."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TpuGeneration:
    name: str  # the config value users write
    accelerator: str  # GKE node label cloud.google.com/gke-tpu-accelerator
    topologies: tuple[str, ...]  # the topologies GKE offers, smallest first
    multi_host_machine: str  # machine type of each host in a multi-host slice
    single_host_machines: dict[str, str]  # topology -> machine type where the slice fits one VM
    tensorcores_per_chip: int
    peak_bf16_tflops_per_chip: float
    hbm_gib_per_chip: int
    hbm_gbps_per_chip: float  # HBM bandwidth, GB/s (Cloud TPU docs' per-chip figure)
    ray_accelerator: str  # Ray's accelerator type for ScalingConfig (ray.util.accelerators GOOGLE_TPU_*)
    # Data-center network (DCN: between slices) bandwidth per chip, Gbit/s, from Cloud TPU's system architecture pages
    # (https://cloud.google.com/tpu/docs/<generation>): v5p gives it per chip; v5e and v6e give each 8-chip host's
    # NICs and the Pod's DCN bandwidth, which agree (v5e: 2 x 100 Gbps per host, 6.4 Tbps per 256-chip Pod: 25; v6e:
    # 4 x 200 Gbps, 25.6 Tbps: 100). None: the docs give no figure (v4, tpu7x).
    dcn_gbps_per_chip: float | None = None
    # Ironwood (tpu7x) places multi-host slices with a workload policy instead of tpu_topology.
    uses_workload_policy: bool = False
    # Physical NICs GKE managed DRANET can hand to pods on a multi-host VM; 0 = not a managed-DRANET machine
    # (Cluster Toolkit modules/compute/gke-node-pool: ct6e yes, ct5p no).
    dranet_nics: int = 0
    # Boot disk type where the machine needs one other than GKE's default (pd-balanced).
    boot_disk_type: str | None = None
    # Cloud TPU's name for the generation in accelerator types (v5litepod-16) where it is not `name`.
    accelerator_type_name: str | None = None

    def accelerator_type(self, chips: int) -> str:
        """Cloud TPU's accelerator type of a slice of `chips` chips (TPU_ACCELERATOR_TYPE, which libtpu reads): the
        generation's name and the slice's TensorCores, e.g. v5p-8 for 4 chips, v6e-16 for 16."""
        return f"{self.accelerator_type_name or self.name}-{chips * self.tensorcores_per_chip}"


_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration(
            name="v4",
            ray_accelerator="TPU-V4",
            accelerator="tpu-v4-podslice",
            topologies=("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
                        "8x8x12", "8x8x16", "8x16x16", "12x16x16", "16x16x16"),
            multi_host_machine="ct4p-hightpu-4t",
            single_host_machines={"2x2x1": "ct4p-hightpu-4t"},
            tensorcores_per_chip=2,
            peak_bf16_tflops_per_chip=275.0,
            hbm_gib_per_chip=32,
            hbm_gbps_per_chip=1200.0,
        ),
        TpuGeneration(
            name="v5e",
            ray_accelerator="TPU-V5LITEPOD",
            accelerator="tpu-v5-lite-podslice",
            topologies=_2D,
            multi_host_machine="ct5lp-hightpu-4t",
            single_host_machines={"1x1": "ct5lp-hightpu-1t", "2x2": "ct5lp-hightpu-4t", "2x4": "ct5lp-hightpu-8t"},
            tensorcores_per_chip=1,
            accelerator_type_name="v5litepod",
            peak_bf16_tflops_per_chip=197.0,
            hbm_gib_per_chip=16,
            hbm_gbps_per_chip=819.0,
            dcn_gbps_per_chip=25.0,
        ),
        TpuGeneration(
            name="v5p",
            ray_accelerator="TPU-V5P",
            accelerator="tpu-v5p-slice",
            topologies=("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
                        "8x8x16", "8x16x16", "16x16x16", "16x16x24"),
            multi_host_machine="ct5p-hightpu-4t",
            single_host_machines={"2x2x1": "ct5p-hightpu-4t"},
            tensorcores_per_chip=2,
            peak_bf16_tflops_per_chip=459.0,
            hbm_gib_per_chip=95,
            hbm_gbps_per_chip=2765.0,
            dcn_gbps_per_chip=50.0,
        ),
        TpuGeneration(
            name="v6e",
            ray_accelerator="TPU-V6E",
            accelerator="tpu-v6e-slice",
            topologies=_2D,
            multi_host_machine="ct6e-standard-4t",
            single_host_machines={"1x1": "ct6e-standard-1t", "2x2": "ct6e-standard-4t", "2x4": "ct6e-standard-8t"},
            tensorcores_per_chip=1,
            peak_bf16_tflops_per_chip=918.0,
            hbm_gib_per_chip=32,
            dranet_nics=2,  # a ct6e host has 2 physical NICs
            hbm_gbps_per_chip=1638.0,
            dcn_gbps_per_chip=100.0,
        ),
        TpuGeneration(
            name="tpu7x",
            ray_accelerator="TPU-V7X",
            accelerator="tpu7x",
            topologies=("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
                        "8x8x16", "8x16x16"),
            multi_host_machine="tpu7x-standard-4t",
            single_host_machines={"2x2x1": "tpu7x-standard-4t"},
            tensorcores_per_chip=2,
            peak_bf16_tflops_per_chip=2307.0,
            hbm_gib_per_chip=192,
            hbm_gbps_per_chip=7380.0,
            uses_workload_policy=True,
            # Cluster Toolkit's examples/gke-tpu-7x blueprint gives Ironwood pools Hyperdisk Balanced boot disks.
            boot_disk_type="hyperdisk-balanced",
            # DRANET left off: xpk marks tpu7x-standard-4t without accelerator network profile support, and its NIC
            # count is not confirmed here.
        ),
    )
}

# Aliases users commonly write; the canonical name is what we store.
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "trillium": "v6e", "ironwood": "tpu7x", "v7x": "tpu7x"}


def chips_per_vm(machine_type: str) -> int:
    # GKE TPU machine types end in "-<chips>t".
    return int(machine_type.rsplit("-", 1)[1].rstrip("t"))


@dataclass(frozen=True)
class SliceShape:
    """One slice of one generation and topology, with everything derived from the catalog."""

    generation: TpuGeneration
    topology: str

    @property
    def chips(self) -> int:
        return math.prod(int(d) for d in self.topology.split("x"))

    @property
    def machine_type(self) -> str:
        return self.generation.single_host_machines.get(self.topology, self.generation.multi_host_machine)

    @property
    def chips_per_host(self) -> int:
        return chips_per_vm(self.machine_type)

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def accelerator(self) -> str:
        return self.generation.accelerator

    @property
    def peak_bf16_tflops(self) -> float:
        return self.chips * self.generation.peak_bf16_tflops_per_chip

    @property
    def hbm_gib(self) -> int:
        return self.chips * self.generation.hbm_gib_per_chip

    @property
    def key(self) -> str:
        """A DNS-safe name for the shape, e.g. `v6e-4x4`."""
        return f"{self.generation.name}-{self.topology}"


def canonical_type(name: str) -> str:
    """Returns the catalog name for a TPU type, or raises ValueError listing the allowed ones."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in GENERATIONS:
        allowed = ", ".join(sorted(GENERATIONS))
        raise ValueError(f"unknown TPU type {name!r}; allowed: {allowed} (aliases: {', '.join(sorted(ALIASES))})")
    return key


def slice_shape(tpu_type: str, topology: str) -> SliceShape:
    """Validates a (type, topology) pair against the catalog."""
    gen = GENERATIONS[canonical_type(tpu_type)]
    if topology not in gen.topologies:
        raise ValueError(
            f"topology {topology!r} is not valid for {gen.name}; allowed: {', '.join(gen.topologies)}"
        )
    return SliceShape(gen, topology)
