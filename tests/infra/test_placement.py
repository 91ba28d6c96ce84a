"""A split placement (issue 43) in the stack: counted against the chips of trainer.slices by the trainer's own rule
(trainer/base/placement.py), refused before anything is registered where the trainer could not run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from envspec.config import ConfigError
from infra.base.pod_config import env_job
from infra.checks.placement import Placement
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
    """One process per host: a multi-host job splits each host's chips into groups of equal size, or by slice with
    the training slices on 2 hosts at least (orbax saves no array held by one process of several)."""
    on = ["placement.mode=split", "mesh.slices=1", "mesh.tensor=1", "sampling.tensor=null"]
    cfg = load_config(None, [*on, "mesh.fsdp=-1", "placement.sampler.fsdp=-1"])
    # One 4-host slice of 4 chips each: each host's first 2 chips train, the next 2 sample.
    mine, theirs = split_groups(resolve_mesh(cfg, 16, exact=True), job_devices(1, 4, 4), 4)
    assert [d.id for d in mine] == [0, 1, 4, 5, 8, 9, 12, 13] and [d.id for d in theirs] == [2, 3, 6, 7, 10, 11, 14, 15]
    # staging's two 4-host v6e 4x4 slices, by slice: the first slice's 4 hosts train, the second's sample.
    two = load_config(None, [*on, "mesh.fsdp=-1", "placement.sampler.fsdp=-1"])
    mine, theirs = split_groups(resolve_mesh(two, 32, exact=True), job_devices(2, 4, 4), 8)
    assert [d.id for d in mine] == list(range(16)) and [d.id for d in theirs] == list(range(16, 32))
    assert Placement("split", (1, 16, 1), (1, 16, 1), 1, "decoupled", 32, 8, by_host=True).line() == (
        "sampling on 4 hosts (16 chips) (mesh 1x16x1), training on the other 4 hosts (16 chips) (mesh 1x16x1), "
        "weights pushed every step, lag 1, decoupled")
    # Two slices of one host each (dev's v6e 2x2 x 2): the trainer's devices on one process of two: refused.
    with pytest.raises(TrainerConfigError, match=r"job of 2 processes needs the trainer's devices on 2 processes"):
        split_groups(resolve_mesh(two, 8, exact=True), job_devices(2, 1, 4), 2)
    # One host: any split of its chips (not all of them, groups of any size).
    uneven = load_config(None, [*on, "mesh.fsdp=1", "placement.sampler.fsdp=2"])
    mine, theirs = split_groups(resolve_mesh(uneven, 4), job_devices(1, 1, 4), 1)
    assert ([d.id for d in mine], [d.id for d in theirs]) == ([0], [1, 2])
    # The same groups on two hosts of 2 chips: unequal, refused.
    with pytest.raises(TrainerConfigError, match=r"equal size \(now 1 and 2 devices\)"):
        split_groups(resolve_mesh(uneven, 4), job_devices(1, 2, 2), 2)


@pytest.mark.parametrize(("slices", "args", "message"), [
    # One slice, groups of unequal size (8 + 8 of 16 chips is what a multi-host split needs).
    (1, [*SPLIT, "--set", "mesh.slices=1", "--set", "mesh.fsdp=1", "--set", "placement.sampler.fsdp=4"],
     r"placement\.mode=split on 1 x v6e-stg \(4x4\) = 4 host\(s\) x 4 chips = 16 chips: "
     r"placement\.mode=split needs mesh \(1 x 1 x 4 = 4\) \+ "
     r"placement\.sampler \(1 x 4 x 1 = 4\) = 8 devices, which must equal the 16 available devices"),
], ids=["not every chip"])
def test_a_split_the_trainer_would_refuse_registers_nothing(slices: int, args: list[str], message: str) -> None:
    monitor = RecordingMonitor(PlanMocks())
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:trainer\.config \(llama3-70b-grpo-2xv6e-4x4\.yaml\) / "
                                          r"trainer\.args \(--set placement\.mode=split .*\): " + message):
        run_stack("staging", _staging(slices, args), monitor=monitor)
    assert monitor.registrations == []


def test_a_split_under_the_ray_launcher_is_refused_before_anything_is_registered() -> None:
    """dev runs its trainer as a RayJob: each attempt gets its own count of slices, which a split's groups depend on,
    so the stack refuses a split there as the trainer's Ray driver does (trainer/run/ray_train.py check_mesh)."""
    config = stack_config("dev")
    config["gke-tpu-rl:trainer"]["args"] = [*SPLIT, "--set", "mesh.slices=1"]
    monitor = RecordingMonitor(PlanMocks())
    with pytest.raises(ConfigError, match=r"gke-tpu-rl:trainer\.launcher is 'ray' .*placement\.mode=split: not with "
                                          r"--ray .*allowed with --ray: placement\.mode=colocated"):
        run_stack("dev", config, monitor=monitor)
    assert monitor.registrations == []


def test_a_split_config_runs_as_fit_prices_it(tmp_path: Path) -> None:
    """A config that places sampling apart names its own layout (mesh + placement.sampler): the JobSet's pods get no
    job mesh (workloads/trainer_pod.py job_mesh), so they run what `fit --config` prices, and plan says where
    sampling runs."""
    import json

    import yaml

    from infra.offline.fit import file_job
    from infra.offline.plan import plan
    from infra.offline.render import summarize

    name = "qwen3-8b-grpo-async-2xv6e-4x4.yaml"
    config = stack_config("staging")
    config["gke-tpu-rl:trainer"].update(config=name, terminationGraceSeconds=900)
    path = tmp_path / "Pulumi.staging.yaml"
    path.write_text(yaml.safe_dump({"config": config}))
    result = plan("staging", path)
    assert ("sampling on 4 hosts (16 chips) (mesh 1x2x8), training on the other 4 hosts (16 chips) (mesh 1x16x1), "
            "weights pushed every step, lag 1, clip") in summarize(result).trainer
    [jobset] = result.of_type("kubernetes:jobset.x-k8s.io/v1alpha2:JobSet")
    assert "mesh.slices" not in json.dumps(jobset.inputs) and "mesh.fsdp" not in json.dumps(jobset.inputs)
    assert env_job(result.spec).cfg == file_job(name, "v6e:4x4", 2).cfg  # what the pods load is what fit prices


def test_a_split_whose_slices_axes_are_not_the_jobs_slices_is_refused() -> None:
    """The staging config's mesh keeps slices 2: a split set through trainer.args on one slice without
    mesh.slices=1 would run a 'slices' axis of 2 inside one slice; refused, naming the keys and trainer.slices."""
    monitor = RecordingMonitor(PlanMocks())
    with pytest.raises(ConfigError, match=r"mesh\.slices \(2\) and placement\.sampler\.slices \(1\) must both be 1 "
                                          r"\(each group on every slice: a split within each host\) or add up to 1"):
        run_stack("staging", _staging(1, SPLIT), monitor=monitor)
    assert monitor.registrations == []
