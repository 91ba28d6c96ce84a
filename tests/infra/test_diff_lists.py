"""Lists in a diff as a reviewer reads them: named things (env, containers, volumes, ports, ...) by their Kubernetes
merge key, a reorder being no change; a container's args as the flags that changed; every change shown, long ones
folded rather than cut (issue 42: `args[10]: ∅ → --set`, `env[10]` before `env[1]`, "… 3 more")."""

from __future__ import annotations

import copy
from typing import Any

from infra.offline.changes import PRESENT, argv_flags, changed_inputs
from infra.offline.diff import Snapshot, compare, markdown, snapshot, text
from infra.offline.mockrun import PlanResult, run_stack
from tests.infra.conftest import stack_config

JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
POD = "spec.replicatedJobs[name=slice].template.spec.template.spec"


def _pod(snap: Snapshot) -> dict[str, Any]:
    [job] = [r for r in snap.resources.values() if r["type"] == JOBSET]
    return job["inputs"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_scalar_lists_are_compared_one_by_one() -> None:
    assert changed_inputs({"a": [1, 2, 3]}, {"a": [1, 3]}) == [("a[1]", 2, None)]
    assert changed_inputs({"cidrs": ["10.0.0.0/8"]}, {"cidrs": ["10.0.0.0/8", "10.1.0.0/16"]}) == [
        ("cidrs[1]", None, "10.1.0.0/16")]


def test_argv_is_read_as_flags() -> None:
    words = ["python", "-m", "trainer", "--config", "a.yaml", "--run-dir=/ckpt", "--set", "rl.group_size=8",
             "--set", "mesh.fsdp=-1", "--resume", "--seed", "-1", "--set", "rl.group_size=16"]
    assert argv_flags(words) == {"[0]": "python", "-m": "trainer", "--config": "a.yaml", "--run-dir": "/ckpt",
                                 "--set rl.group_size": "8", "--set mesh.fsdp": "-1", "--resume": PRESENT,
                                 "--seed": "-1", "--set rl.group_size #2": "16"}


def test_args_changes_are_the_flags_that_changed() -> None:
    old = {"args": ["--config", "a.yaml", "--set", "mesh.slices=1", "--set", "rl.group_size=8", "--set", "steps=5"]}
    # A flag inserted in front shifts every position after it; by flag, only what changed shows.
    new = {"args": ["--config", "a.yaml", "--set", "rl.kl_beta=0.01", "--set", "mesh.slices=1",
                    "--set", "rl.group_size=16"]}
    assert changed_inputs(old, new) == [("args --set rl.kl_beta", None, "0.01"),
                                        ("args --set rl.group_size", "8", "16"), ("args --set steps", "5", None)]


def test_flags_given_in_another_order_are_a_change() -> None:
    # `--set task=...` then `--set task.split=test` is not the config the other order gives.
    old = {"args": ["--config", "a.yaml", "--set", "task={name: dataset}", "--set", "task.split=test"]}
    new = {"args": ["--config", "a.yaml", "--set", "task.split=test", "--set", "task={name: dataset}"]}
    assert changed_inputs(old, new) == [("args (order)", "--config --set task --set task.split",
                                         "--config --set task.split --set task")]


def test_named_items_are_matched_by_their_merge_key(plans: dict[str, PlanResult]) -> None:
    new = copy.deepcopy(snapshot(plans["staging"]))
    _pod(new)["tolerations"].append({"key": "example.com/x", "operator": "Exists"})
    old = copy.deepcopy(new)
    pod = _pod(old)
    container = pod["containers"][0]
    # A reorder of env, volumes, mounts, ports and tolerations is no change...
    for items in (container["env"], container["volumeMounts"], container["ports"], pod["volumes"], pod["tolerations"]):
        items.reverse()
    assert compare("staging", "base", old, new).empty
    # ...and a change names the item, not its position, in the order of the document.
    env = {e["name"]: e for e in container["env"]}
    env["NUM_SLICES"]["value"] = "1"
    del env["MEGASCALE_PORT"]
    container["env"] = list(env.values())
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    pod["containers"].append({"name": "sidecar", "image": "busybox"})
    [job] = compare("staging", "base", old, new).changed
    c = f"{POD}.containers[name=trainer]"
    assert job.inputs == [
        (f"{c}.env[name=NUM_SLICES].value", "1", "2"),
        (f"{c}.env[name=MEGASCALE_PORT]", None, {"name": "MEGASCALE_PORT", "value": "8080"}),
        (f"{c}.volumeMounts[mountPath=/dev/shm]", None, {"mountPath": "/dev/shm", "name": "dshm"}),
        (f"{POD}.containers[name=sidecar]", {"name": "sidecar", "image": "busybox"}, None)]


def test_a_trainer_flag_change_reads_as_the_flag() -> None:
    config = stack_config("staging")
    changed = copy.deepcopy(config)
    changed["gke-tpu-rl:trainer"] = {**changed["gke-tpu-rl:trainer"], "args": ["--set", "rl.group_size=16"]}
    d = compare("staging", "base", snapshot(run_stack("staging", config)), snapshot(run_stack("staging", changed)))
    [job] = [c for c in d.changed if c.type == JOBSET]
    assert job.inputs == [(f"{POD}.containers[name=trainer].args --set rl.group_size", None, "16")]
    assert job.replaced
    assert f"{POD}.containers[name=trainer].args --set rl.group_size: ∅ → 16" in text(d)


def test_every_change_is_shown_and_a_long_one_folded(plans: dict[str, PlanResult]) -> None:
    new = snapshot(plans["staging"])
    old = copy.deepcopy(new)
    env = _pod(old)["containers"][0]["env"]
    for i, e in enumerate(env):
        e["name"] = f"OLD_{i}"
    d = compare("staging", "base", old, new)
    [job] = d.changed
    assert len(job.inputs) == 24  # 12 env vars gone, 12 new; the old table stopped at 12 and said "… N more"
    md = markdown(d)
    assert "more" not in md and f"| {len(job.inputs)} changes, folded below |" in md
    folded = md[md.index("<details><summary>`jobset-rl-grpo-stg` (JobSet)"):]
    container = f"{POD}.containers[name=trainer]"
    assert folded.count("\n- `") == len(job.inputs) and f"\n- under `{container}`:\n" in folded  # said once
    for path, _, _ in job.inputs:
        assert f"- `{path.removeprefix(container + '.')}`: " in folded
    assert '- `env[name=NUM_SLICES]`: `∅` → `{"name": "NUM_SLICES", "value": "2"}`' in folded
    # Long values are whole: the image digest is not cut at 80 characters.
    digest = _pod(new)["containers"][0]["image"]
    old_image = copy.deepcopy(old)
    _pod(old_image)["containers"][0]["image"] = digest[:-1] + "0"
    assert digest in text(compare("staging", "base", old_image, new))
