"""The tinker environment as deployed: a user's copy of environments/Pulumi.tinker.yaml whose only changes are what a
team could set itself (service.args: a tiny base model from the Hub and a mesh for CPU devices), rendered by the
plan and run by the harness (tests/deployed/cluster.py) with GCP at its boundary (tests/deployed/gcp.py): the
staging Job fetches the model into the bucket, then the engine JobSet's four pods and the API Deployment's two
replicas start with their rendered commands, env and volumes, against one PostgreSQL behind the Cloud SQL stand-in.

What a user relies on, in order:
- a key made by `keys create` in one API replica (`kubectl exec`) works through the other replica: they share the
  database (the review's defect 1 broke this: each replica kept its own sqlite file);
- the real `tinker` SDK trains through the API's Service port, the engine doing the work (defect 2: the engine's
  own store dialled localhost:5432 and died);
- the engine preempted (SIGTERM to every pod: Spot takes the slice) and crashed (SIGKILL): the JobSet restarts it
  as its rendered policy says and the request accepted meanwhile completes;
- the database down while the engine starts: the engine exits with a code the rendered podFailurePolicy restarts
  (defect 3: exit 1 failed the JobSet for good), and serves once the database is back;
- `tinker checkpoint download` (the real CLI) fetches what save_weights_external saved, from an API pod as rendered:
  the API reads the engine's files through its own read-only mount of the checkpoint bucket (without one every
  download answered 400 "cannot be read by this API server").
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.deployed import sandbox as S
from tests.deployed.cluster import Cluster, Pod
from tests.deployed.conftest import (
    HUB_ENV,
    HUB_MOUNT,
    TINY_REPO,
    hub_mirror,
    instance_name,
    provision_database,
    workload_identity,
)
from tests.deployed.gcp import GcpBoundary
from tests.deployed.render import Rendered, render, user_copy
from workloads.service import engine_credentials, storage_dir

# What a team sets to try the service on CPUs: a tiny model, no tensor axis, small batches, and a short database retry
# window at start (service.db_retry_s; 300 s by default) so the database-down case ends within the test.
ENGINE_ARGS = [a for kv in (f"service.base_model={TINY_REPO}", "service.db_retry_s=15", "mesh.tensor=1", "lora.slots=4",
                             "lora.rank=8", "service.max_batch_tokens=256", "service.min_bucket=16",
                             "service.sample_max_sequences=4", "compute.dtype=float32") for a in ("--set", kv)]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    folder = tmp_path_factory.mktemp("env")
    return render("tinker-local", user_copy("tinker", folder, "tinker-local", {"service": {"args": ENGINE_ARGS}}))


class Deployed:
    def __init__(self, cluster: Cluster, boundary: GcpBoundary, rendered: Rendered) -> None:
        self.cluster, self.boundary, self.rendered = cluster, boundary, rendered
        self.api = rendered.result.spec.service_api_name
        self.engine = rendered.result.spec.service_engine_name
        self.key = ""  # made by the first test, in an API replica

    def api_pods(self) -> list[Pod]:
        return [p for p in self.cluster.pods.values() if p.owner == f"Deployment/{self.api}" and p.deleting is None]

    def engine_running(self) -> bool:
        """Every pod of the engine JobSet running (the SDK's futures then wait for it to take their requests)."""
        js = self.cluster.jobsets.get(self.engine)
        return js is not None and not js.recreating and js.status == "Active" and all(
            c.running() for j in js.jobs for p in j.pods for c in p.containers)


@pytest.fixture(scope="module")
def deployed(harness_lock: None, rendered: Rendered, pg_server_url: str,  # noqa: F811
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="gke-tpu-rl-harness-", dir="/var/tmp"))
    work.chmod(0o755)
    spec = rendered.result.spec
    socket_dir = pg_server_url.split("host=")[-1].split("&")[0]
    issuer = engine_credentials(spec)["audience"].split(":", 2)[2]  # identitynamespace:<pool>:<issuer>
    network = S.Network()  # the boundary listens on the bridge's address
    with provision_database(pg_server_url, rendered):
        boundary = GcpBoundary(host_ip=S.HOST_IP, project=spec.project,
                               instance_connection_name=instance_name(rendered),
                               pg_unix_socket=f"{socket_dir}/.s.PGSQL.5432", workdir=work / "gcp",
                               cluster_issuer=issuer)
        boundary.env.update(HUB_ENV)
        with boundary:
            for gsa, member in workload_identity(rendered):
                boundary.bind_workload_identity(gsa, member)
            cluster = Cluster(rendered.objects, work / "cluster", boundary=boundary, cpu_devices=1,
                              depends_on=rendered.depends_on, mounts={HUB_MOUNT: str(hub_mirror(work))},
                              network=network)
            try:
                with cluster:
                    yield Deployed(cluster, boundary, rendered)
            finally:
                shutil.rmtree(work, ignore_errors=True)


def _data() -> list[types.Datum]:
    rng = np.random.default_rng(0)
    out = []
    for n in (10, 17, 5):
        t = rng.integers(1, 100, n + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                               loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * n}))
    return out


def _authorized(url: str, key: str) -> int:
    req = urllib.request.Request(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _key(deployed: Deployed) -> str:
    """The test user's key, made in an API replica (`kubectl exec`) if no test before made it."""
    c = deployed.cluster
    if not deployed.key:
        c.wait("an API replica Ready", lambda: any(p.ready for p in deployed.api_pods()), 300)
        pod = sorted(p.name for p in deployed.api_pods() if p.ready)[0]
        made = c.exec(pod, ["python", "-m", "trainer.service", "keys", "create", "alice"])
        assert made.returncode == 0, made.stderr
        deployed.key = made.stdout.strip().splitlines()[-1]
    return deployed.key


def test_the_service_as_deployed(deployed: Deployed) -> None:
    c, api, engine = deployed.cluster, deployed.api, deployed.engine
    c.wait("the staging Job completes", lambda: c.jobs.get(f"{engine}-stage") is not None
           and c.jobs[f"{engine}-stage"].status == "Complete", 300)
    c.wait("both API replicas Ready", lambda: sum(p.ready for p in deployed.api_pods()) == 2, 180)
    first, second = sorted(p.name for p in deployed.api_pods())

    # A key made in one replica's environment, as docs/service.md says (kubectl exec deploy/<api> -- ... keys create).
    made = c.exec(first, ["python", "-m", "trainer.service", "keys", "create", "alice"])
    assert made.returncode == 0, made.stderr
    key = deployed.key = made.stdout.strip().splitlines()[-1]
    for name in (first, second):
        pod = c.pods[name]
        assert _authorized(f"http://{pod.ip}:8000", key) == 200, f"the key is refused by {name}: {c.report()}"
    assert not list((c.work / "pods").rglob("service.db")), "a replica keeps a private sqlite file"

    c.wait("the engine runs", deployed.engine_running, 300)
    url = c.service_url(api, 8000)
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY_REPO, rank=4, seed=1).result(timeout=120)
    data = _data()
    first_loss = tc.forward_backward(data, "cross_entropy").result(timeout=300).metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)

    # A Spot preemption takes the slice: SIGTERM to every engine pod at once (each node's shutdown). Their Job fails
    # (143 is a restart code, counted by nothing), the JobSet restarts every pod.
    js = c.jobsets[engine]
    for pod in sorted(p.name for j in js.jobs for p in j.pods):
        c.kill(pod, signal.SIGTERM)
    pending = tc.forward_backward(data, "cross_entropy")  # accepted while the engine goes down
    c.wait("the engine JobSet restarts after SIGTERM", lambda: js.restarts == 1 and not js.recreating, 300)
    assert js.status == "Active" and js.restarts_toward_max == 0, js.history
    assert np.isfinite(pending.result(timeout=600).metrics["loss:sum"])
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)

    # A crash: SIGKILL (137 is a restart code too).
    c.wait("the engine runs again", deployed.engine_running, 300)
    c.kill(f"{engine}-slice-0-0", signal.SIGKILL)
    c.wait("the engine JobSet restarts after SIGKILL", lambda: js.restarts == 2 and not js.recreating, 300)
    after = tc.forward_backward(data, "cross_entropy").result(timeout=600).metrics["loss:sum"]
    assert after != first_loss  # the two optimizer steps were kept across both restarts

    # Each start warmed the smallest shapes before taking requests (service.warmup); the first compiled them into the
    # state bucket (service.compile_cache), and each restart read every one back instead of compiling it.
    log = c.log(f"{engine}-slice-0-0")
    warm = [tuple(map(int, m)) for m in re.findall(r"warm-up ran (\d+) programs in [\d.]+ s \((\d+) read from the "
                                                     r"compile cache\)", log)]
    assert len(warm) >= 3 and warm[0][1] == 0 and all(n > 0 and hits == n for n, hits in warm[1:]), (warm, log[-3000:])
    cache = c.work / "buckets" / deployed.rendered.result.spec.service_state_bucket / "_jax-compile-cache"
    assert len(list(cache.iterdir())) >= warm[0][0], sorted(p.name for p in cache.iterdir())


def test_the_engine_survives_the_database_down_at_start(deployed: Deployed) -> None:
    """The database down while the engine starts (Cloud SQL's maintenance restart): the engine retries for
    service.db_retry_s, exits 42, which the rendered policy counts as a restart (restartOnTransient), and serves once
    the database is back; a request accepted meanwhile completes. On the old code the start-up died with exit 1,
    which the podFailurePolicy turns into FailJobSet (review 2026-11-28 #3)."""
    c, engine = deployed.cluster, deployed.engine
    c.wait("the engine runs", deployed.engine_running, 300)
    js = c.jobsets[engine]
    sc = tinker.ServiceClient(base_url=c.service_url(deployed.api, 8000), api_key=deployed.key)
    tc = sc.create_lora_training_client(base_model=TINY_REPO, rank=4, seed=2).result(timeout=300)
    counted = js.restarts_toward_max
    deployed.boundary.stop_database()
    try:
        c.kill(f"{engine}-slice-0-0", signal.SIGTERM)
        c.wait("an engine start gives up on the database with 42", lambda: js.status != "Active" or any(
            "exit code 42" in h for h in js.history), 600)
        assert js.status == "Active", f"{js.reason}: {js.message}; {js.history}"
        assert js.restarts_toward_max == counted + 1, js.history  # 42 is counted; the SIGTERM was not
        assert "the database stayed unavailable" in c.log(f"{engine}-slice-0-0")
    finally:
        deployed.boundary.start_database()
    loss = tc.forward_backward(_data(), "cross_entropy").result(timeout=900).metrics["loss:sum"]
    assert np.isfinite(loss)
    assert js.status == "Active", js.history


def test_external_weights_download_with_the_tinker_cli_from_the_api_pods(deployed: Deployed, tmp_path: Path) -> None:
    """save_weights_external through the Service, then the real `tinker checkpoint download` (a subprocess, as a user
    runs it): the API pods, as rendered, list and serve the files the engine wrote to the bucket, through their own
    read-only mount of it at the engine's path. Before the API Deployment mounted the bucket this failed with the
    API's 400 "cannot be read by this API server" (the CLI exits non-zero with it)."""
    c, api = deployed.cluster, deployed.api
    key = _key(deployed)
    c.wait("the engine runs", deployed.engine_running, 600)
    url = c.service_url(api, 8000)
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY_REPO, rank=4, seed=3).result(timeout=300)
    tc.forward_backward(_data(), "cross_entropy").result(timeout=600)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
    ext = tc.save_weights_external("final").result(timeout=300).path
    assert ext == f"tinker://{tc.model_id}/external_weights/final"

    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key}
    cli = [str(Path(sys.executable).parent / "tinker"), "checkpoint", "download", ext, "--output", str(tmp_path)]
    run = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:], c.report())
    got = tmp_path / f"{tc.model_id}_external_weights_final"  # the CLI's own naming
    assert sorted(p.name for p in got.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # Byte for byte what the engine wrote to the bucket, under the service's store folder.
    spec = deployed.rendered.result.spec
    store = c.work / "buckets" / spec.bucket_name / storage_dir(spec).removeprefix("/checkpoints/")
    found = [p.parent for p in store.rglob("adapter_model.safetensors") if "external_weights" in p.parts]
    assert len(found) == 1, sorted(str(p) for p in store.rglob("*"))
    saved = found[0]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (got / name).read_bytes() == (saved / name).read_bytes(), name

    # Every API replica reads the bucket, and none can change it: the mount is read-only in the pod.
    for pod in sorted(p.name for p in deployed.api_pods()):
        probe = c.exec(pod, ["python", "-c", (
            "import os, sys; d = sys.argv[1]; assert any(os.scandir(d)), d\n"
            "try:\n open(os.path.join(d, 'written-by-the-api'), 'w')\n"
            "except OSError as e:\n print('refused', e.errno)\nelse:\n print('written')"), storage_dir(spec)])
        assert probe.returncode == 0 and probe.stdout.strip().startswith("refused"), (pod, probe.stdout, probe.stderr)
