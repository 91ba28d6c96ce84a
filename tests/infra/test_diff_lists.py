"""A change inside a list of scalars (container args, CIDR lists) shows the element that changed: printed whole,
both sides of a long list were cut at the same length and the change was invisible."""

from __future__ import annotations

import copy

from infra.offline.diff import _short, changed_inputs, compare, snapshot, text
from infra.offline.mockrun import run_stack
from tests.infra.conftest import stack_config


def test_list_elements_are_compared_one_by_one() -> None:
    old = {"args": ["--config", "a.yaml", "--run-dir", "/checkpoints/grpo/run", "--set", "mesh.slices=1"]}
    new = {"args": ["--config", "a.yaml", "--run-dir", "/checkpoints/grpo/run", "--set", "mesh.slices=2",
                    "--set", "steps=5"]}
    assert changed_inputs(old, new) == [("args[5]", "mesh.slices=1", "mesh.slices=2"), ("args[6]", None, "--set"),
                                        ("args[7]", None, "steps=5")]
    # The old rendering: both sides equal once cut, so a reviewer saw no change.
    assert _short(old["args"], 40) == _short(new["args"], 40)
    assert changed_inputs({"a": [1, 2, 3]}, {"a": [1, 3]}) == [("a[1]", 2, None)]


def test_a_trainer_args_change_names_the_argument() -> None:
    config = stack_config("staging")
    changed = copy.deepcopy(config)
    changed["gke-tpu-rl:trainer"] = {**changed["gke-tpu-rl:trainer"], "args": ["--set", "steps=300"]}
    d = compare("staging", "base", snapshot(run_stack("staging", config)), snapshot(run_stack("staging", changed)))
    [job] = [c for c in d.changed if c.type.endswith(":JobSet")]
    args = [(path, a, b) for path, a, b in job.inputs if ".args[" in path]
    assert [(a, b) for _, a, b in args] == [(None, "--set"), (None, "steps=300")]
    assert job.replaced
    assert "steps=300" in text(d)
