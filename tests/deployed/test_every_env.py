"""Every container of every Job, JobSet, Deployment and RayJob of every shipped environment (and a user's copy of
one), resolved as the cluster would start it from the plan's objects: each env var (downward API fields as JobSet, the
Job controller and KubeRay set them, secret refs from the rendered Secrets and KubeRay's), each volume and mount, each
host name a pod's env names. The scenarios (test_service.py, test_trainer.py, test_ray.py) then run some of them; this
covers the rest, prod's 80 TPU pods among them, without starting them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deployed import sandbox
from tests.deployed.cluster import Cluster, HarnessError
from tests.deployed.render import render, user_copy
from workloads.jobset import COORDINATOR_PORT

ENVS = ("dev", "staging", "prod", "tinker")


@pytest.mark.parametrize("env", [*ENVS, "mine"])
def test_every_container_resolves(env: str, tmp_path: Path) -> None:
    if env == "mine":  # a user's copy: staging on its own project, one slice, a secret Hub token
        path = user_copy("staging", tmp_path, "mine", {"project": "my-rl-project", "trainer": {"slices": 1}})
        rendered = render("mine", path)
    else:
        rendered = render(env)
    pods = Cluster(rendered.objects, tmp_path / "work", secrets={}).dry_run()
    assert pods, f"{env}: no pod"
    for name, containers in pods.items():
        for c in containers:
            if c.name.startswith("ray-") or c.name == "wait-gcs-ready":  # KubeRay's commands (kuberay.py)
                assert c.argv[:2] == ["/bin/bash", "-c"] or c.argv[:2] == ["/bin/bash", "-ce"], (name, c.argv)
                assert "ray start" in c.argv[-1] or "ray job submit" in c.argv[-1] or "health-check" in c.argv[-1]
                continue
            assert c.argv[:2] == ["python", "-m"], (name, c.argv)
            if "COORDINATOR_ADDRESS" in c.env:
                assert c.env["COORDINATOR_ADDRESS"].endswith(f":{COORDINATOR_PORT}")
                assert c.env["HOST_INDEX"].isdigit() and c.env["SLICE_INDEX"].isdigit()


def test_a_checkout_a_pod_would_cover_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every container gets its own /tmp (its writable layer, or the emptyDir the pod mounts there), so a checkout
    # under /tmp is hidden from the pods it would run: the harness says so instead of every pod failing with
    # "No such file or directory: b'/bin/python'".
    monkeypatch.setattr(sandbox, "exposed", lambda: ["/usr", "/tmp/cc/repo"])
    with pytest.raises(HarnessError, match=r"mounts /tmp over /tmp/cc/repo, which holds the code it runs"):
        Cluster(render("tinker").objects, tmp_path / "work", secrets={}).dry_run()
