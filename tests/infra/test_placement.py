"""A split placement (issue 43) in the stack: counted against the chips of trainer.slices by the trainer's own rule
(trainer/base/placement.py), refused before anything is registered where the trainer could not run it."""

from __future__ import annotations

from typing import Any

import pytest

from envspec.config import ConfigError
from infra.offline.mockrun import PlanMocks, RecordingMonitor, run_stack
from tests.infra.conftest import stack_config
from trainer.base.config import ConfigError as TrainerConfigError
from trainer.base.config import load_config, resolve_mesh
from trainer.base.placement import job_devices, split_groups

SPLIT = ["--set", "placement.mode=split", "--set", "placement.sampler.fsdp=-1", "--set", "sampling.tensor=null"]


def _staging(slices: int, args: list[str]) -> dict[str, Any]:
    config = stack_config("staging")
    trainer = config["gke-tpu-rl:trainer"]
    trainer.update(slices=slices, args=args, terminationGraceSeconds=900)
    return config


def test_the_split_rule_on_a_jobs_hosts() -> None:
    """One process per host: a multi-host job may split only each host's chips, into groups of equal size."""
    on = ["placement.mode=split", "mesh.slices=1", "mesh.tensor=1", "sampling.tensor=null"]
    cfg = load_config(None, [*on, "mesh.fsdp=-1", "placement.sampler.fsdp=-1"])
    # One 4-host slice of 4 chips each: each host's first 2 chips train, the next 2 sample.
    mine, theirs = split_groups(resolve_mesh(cfg, 16, exact=True), job_devices(1, 4, 4), 4)
    assert [d.id for d in mine] == [0, 1, 4, 5, 8, 9, 12, 13] and [d.id for d in theirs] == [2, 3, 6, 7, 10, 11, 14, 15]
    # Two slices of one host each (dev's v6e 2x2 x 2): the devices split by slice, a host samples alone: refused.
    two = load_config(None, [*on, "mesh.fsdp=-1", "placement.sampler.fsdp=-1"])
    with pytest.raises(TrainerConfigError, match=r"job of 2 processes .* here the devices split by slice"):
        split_groups(resolve_mesh(two, 8, exact=True), job_devices(2, 1, 4), 2)
    # One host: any split of its chips (not all of them, groups of any size).
    uneven = load_config(None, [*on, "mesh.fsdp=1", "placement.sampler.fsdp=2"])
    mine, theirs = split_groups(resolve_mesh(uneven, 4), job_devices(1, 1, 4), 1)
    assert ([d.id for d in mine], [d.id for d in theirs]) == ([0], [1, 2])
    # The same groups on two hosts of 2 chips: unequal, refused.
    with pytest.raises(TrainerConfigError, match=r"equal size \(1 and 2 devices\) .* here the devices split unevenly"):
        split_groups(resolve_mesh(uneven, 4), job_devices(1, 2, 2), 2)


@pytest.mark.parametrize(("slices", "args", "message"), [
    # staging's two 4x4 slices: the sampler takes a whole slice, whose 4 hosts would sample only.
    (2, [*SPLIT, "--set", "mesh.slices=1"],
     r"placement\.mode=split on 2 x v6e-stg \(4x4\) = 8 host\(s\) x 4 chips = 32 chips: placement\.mode=split in a "
     r"job of 8 processes needs mesh and placement\.sampler of equal size \(16 and 16 devices\) .* split by slice"),
    # One slice, groups of unequal size (8 + 8 of 16 chips is what a multi-host split needs).
    (1, [*SPLIT, "--set", "mesh.fsdp=1", "--set", "placement.sampler.fsdp=4"],
     r"placement\.mode=split on 1 x v6e-stg \(4x4\) = 4 host\(s\) x 4 chips = 16 chips: "
     r"placement\.mode=split needs mesh \(1 x 1 x 4 = 4\) \+ "
     r"placement\.sampler \(1 x 4 x 1 = 4\) = 8 devices, which must equal the 16 available devices"),
], ids=["by slice across hosts", "not every chip"])
def test_a_split_the_trainer_would_refuse_registers_nothing(slices: int, args: list[str], message: str) -> None:
    monitor = RecordingMonitor(PlanMocks())
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:trainer\.config \(llama3-70b-grpo-2xv6e-4x4\.yaml\) / "
                                          r"trainer\.args \(--set placement\.mode=split .*\): " + message):
        run_stack("staging", _staging(slices, args), monitor=monitor)
    assert monitor.registrations == []
