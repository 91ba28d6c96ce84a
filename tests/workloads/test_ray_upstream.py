"""Ray's own code run on the RayJob we render, where schemas and mocks proved nothing: the KubeRay autoscaler's config
reader (it runs in the head pod; an error there keeps the head from ever getting Ready), Ray Train's TPU slice
reservation against what the autoscaler offers, and a real Ray head started from the head group's parameters with
the image's dependency set, probed the way KubeRay 1.7 probes it and called the way its RayJob controller calls."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workloads.test_rayjob import CASES, _rayjob
from workloads import rayjob


def _ray_cluster(obj: dict[str, Any]) -> dict[str, Any]:
    """The RayCluster KubeRay makes of a RayJob: its name and namespace, and the embedded spec as is."""
    return {"metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]},
            "spec": obj["spec"]["rayClusterSpec"]}


@pytest.mark.parametrize("env", sorted(CASES))
def test_kuberay_autoscaler_reads_the_cluster(env: str) -> None:
    """Ray 2.60's autoscaler (autoscaler/_private/kuberay/autoscaling_config.py) turns the RayCluster into node types;
    it raises for a group with no CPU count (_get_num_cpus), which the TPU group had."""
    from ray._private.accelerators.tpu import infer_tpu_pod_type_from_topology
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    spec = CASES[env]()
    group = spec.trainer_group
    assert group is not None
    config = _derive_autoscaling_config_from_ray_cr(_ray_cluster(_rayjob(spec)))
    types = config["available_node_types"]
    assert types["headgroup"]["resources"]["CPU"] == 0  # no Ray task or training worker on the head
    node = types[group.name]
    hosts = group.shape.hosts
    assert (node["min_workers"], node["max_workers"]) == (spec.ray_min_slices * hosts, spec.trainer.slices * hosts)
    assert node["resources"]["CPU"] == rayjob.TPU_WORKER_RAY_CPUS
    assert node["resources"]["TPU"] == group.shape.chips_per_host
    # Ray Train reserves a slice through a placement group on "TPU-<pod type>-head" (ray/_private/accelerators/
    # tpu.py): the autoscaler can only scale up for that demand if this node type offers the same resource.
    pod_type = infer_tpu_pod_type_from_topology(group.topology, group.shape.generation.ray_accelerator)
    assert node["resources"][f"TPU-{pod_type}-head"] == 1


def test_the_images_ray_has_the_dashboard() -> None:
    """The image installs pyproject's `ray` extra, as this environment does. Without ray[default] (aiohttp, grpcio,
    opencensus, prometheus_client, ...) Ray starts the dashboard and its agent `--minimal`
    (ray/_private/services.py): no job API on 8265, no /api/healthz on 52365."""
    import ray._private.utils

    assert ray._private.utils.get_dashboard_dependency_error() is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token is not None:
        # KubeRay's dashboard client (utils/dashboardclient/dashboard_httpclient.go) sends the token this way.
        request.add_header("x-ray-authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, ""


@pytest.fixture
def ray_head() -> Iterator[dict[str, Any]]:
    """A Ray head started as KubeRay 1.7 starts it (common/pod.go generateRayStartCommand: `ray start --head` with
    each rayStartParams entry as --key=value), on free local ports, with the env KubeRay injects for token auth."""
    obj = _rayjob(CASES["dev"]())
    cluster = obj["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}  # so KubeRay sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN
    params = {**cluster["headGroupSpec"]["rayStartParams"], "dashboard-host": "127.0.0.1"}
    ports = {"port": _free_port(), "dashboard-port": _free_port(), "dashboard-agent-listen-port": _free_port()}
    token = "0123456789abcdef" * 2
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}
    # A short temp dir: Ray's Unix sockets live under it, and pytest's tmp_path exceeds their 107-byte limit.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    argv = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--temp-dir={temp}",
            *(f"--{k}={v}" for k, v in {**params, **ports}.items())]
    log = open(os.path.join(temp, "start.log"), "wb")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {"token": token, "agent": ports["dashboard-agent-listen-port"], "dashboard": ports["dashboard-port"],
               "proc": proc}
    finally:
        # On SIGTERM the head's raylet and dashboard exit within 2 s, but gcs_server and the autoscaler's monitor
        # linger for 30 s before `ray start --block` exits (measured with Ray 2.60): nothing here depends on that
        # shutdown, so what is left after 5 s is killed instead of waited for.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_head_from_the_rendered_params_is_ready_and_guards_its_job_api(ray_head: dict[str, Any]) -> None:
    """KubeRay 1.7 probes a Ray >= 2.53 pod with one HTTP GET of /api/healthz on the dashboard agent's port
    (common/pod.go supportsUnifiedHealthCheck, initLivenessAndReadinessProbe); the RayJob controller and the
    SidecarMode submitter use the dashboard's job API (rayjob_controller.go, common/job.go)."""
    agent, dashboard, token = ray_head["agent"], ray_head["dashboard"], ray_head["token"]
    deadline = time.monotonic() + 90
    status = (0, "")
    while time.monotonic() < deadline:
        assert ray_head["proc"].poll() is None, "ray start --head exited"
        try:
            status = _get(f"http://127.0.0.1:{agent}/api/healthz")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            status = (0, "")
        if status[0] == 200:
            break
        time.sleep(1)
    assert status[0] == 200 and "success" in status[1], status  # the kubelet probe sends no token
    # The job API: refused without the token KubeRay generated, served with it.
    assert _get(f"http://127.0.0.1:{dashboard}/api/jobs/")[0] == 401
    code, body = _get(f"http://127.0.0.1:{dashboard}/api/version", token)
    assert code == 200 and rayjob.RAY_VERSION in body
    assert _get(f"http://127.0.0.1:{dashboard}/api/jobs/", token)[0] == 200
