"""GcpBoundary against the real clients, from inside network namespaces as the harness's pods are: the tinker plan's
API container env and engine container env, as rendered, plus `boundary.env`; /etc/hosts from `boundary.hosts`.
Store() creates the schema in the PostgreSQL behind the stand-in (the API through the metadata server, the engine
through STS and impersonation), and fails while the database is down."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from tests.deployed import render as deployed_render
from tests.deployed.conftest import provision_database
from tests.deployed.gcp import GcpBoundary
from tests.deployed.render import render
from tests.service.cloudsql_fake import (
    ACCESS_TOKEN_TYPE,
    ADMIN_SCOPE,
    IAM_SCOPE,
    JWT_TOKEN_TYPE,
    LOGIN_SCOPE,
    TOKEN_EXCHANGE_GRANT,
)
from tests.service.conftest import pg_server_url  # noqa: F401  (the embedded PostgreSQL, a fixture)
from trainer.service.store import CLOUDSQL_OWNER_ROLE, Base, normalize_url

ROOT = Path(__file__).resolve().parents[2]
IP = shutil.which("ip")
UNSHARE = shutil.which("unshare")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or IP is None or UNSHARE is None,
                                reason="needs root, ip and unshare (network and mount namespaces)")
STORE = "from trainer.service.store import Store; s = Store(); s.close(); print('schema ok')"


@dataclass
class Rendered:
    """The tinker plan's objects the pods come from."""

    objects: list[dict[str, Any]]
    plan: deployed_render.Rendered  # the plan itself (its database resources)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        [obj] = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        return obj

    def gsa(self, ksa: str) -> str:
        return self.get("ServiceAccount", ksa)["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]

    @property
    def api_pod(self) -> dict[str, Any]:
        return self.get("Deployment", "tinker-api")["spec"]["template"]["spec"]

    @property
    def engine_pod(self) -> dict[str, Any]:
        return self.get("JobSet", "tinker-engine")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _env(pod: dict[str, Any], container: str) -> dict[str, str]:
    """The container's literal env entries (fieldRef ones are the harness's business, and not the store's)."""
    [c] = [c for c in pod["containers"] if c["name"] == container]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    full = render("tinker")
    return Rendered(full.objects, full)


@pytest.fixture(scope="module")
def database(pg_server_url: str, rendered: Rendered) -> Iterator[Engine]:  # noqa: F811
    """What infra/components/database.py makes on Cloud SQL (tests/deployed/conftest.py provision_database, from the
    plan's sql.User and sql.Database). Yields a superuser engine on the database."""
    name = _env(rendered.api_pod, "api")["GKE_TPU_RL_CLOUDSQL_DATABASE"]
    with provision_database(pg_server_url, rendered.plan):
        db = create_engine(normalize_url(pg_server_url).set(database=name), isolation_level="AUTOCOMMIT")
        try:
            yield db
        finally:
            db.dispose()


@dataclass
class Network:
    """A bridge with the host's address, and pods: a network namespace each, a veth into the bridge."""

    tag: str
    prefix: str  # 10.212.<n>
    namespaces: list[str] = field(default_factory=list)

    @property
    def host_ip(self) -> str:
        return f"{self.prefix}.1"

    def pod(self, name: str, host: int, hosts: dict[str, str], extra: tuple[int, ...] = ()) -> tuple[str, str]:
        """Namespace and address of a new pod (with more addresses `extra`), its /etc/hosts `hosts`."""
        ns = f"gtrg-{self.tag}-{name}"
        ip = f"{self.prefix}.{host}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", f"gtrg{self.tag}{host}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", f"gtrg{self.tag}{host}", "master", f"gtrgb{self.tag}", "up")
        for h in (host, *extra):
            _ip("-n", ns, "addr", "add", f"{self.prefix}.{h}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{ip} {name}", *(f"{addr} {host}" for host, addr in hosts.items())]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        return ns, ip


def _ip(*args: str) -> None:
    assert IP is not None
    subprocess.run([IP, *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    net = Network(secrets.token_hex(2), f"10.212.{secrets.randbelow(250) + 1}")
    bridge = f"gtrgb{net.tag}"
    _ip("link", "add", bridge, "type", "bridge")
    try:
        _ip("addr", "add", f"{net.host_ip}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        yield net
    finally:
        for ns in net.namespaces:
            subprocess.run([IP or "ip", "netns", "del", ns], capture_output=True)  # its veth goes with it
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        subprocess.run([IP or "ip", "link", "del", bridge], capture_output=True)


def _pg_socket(pg_server_url: str) -> str:  # noqa: F811
    socket_dir = Path(make_url(pg_server_url).query["host"])  # type: ignore[arg-type]
    [sock] = [p for p in socket_dir.glob(".s.PGSQL.*") if not p.name.endswith(".lock")]
    return str(sock)


@pytest.fixture(scope="module")
def boundary(network: Network, rendered: Rendered, pg_server_url: str,  # noqa: F811
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcpBoundary]:
    api = _env(rendered.api_pod, "api")
    credentials = json.loads(_env(rendered.engine_pod, "engine")["GKE_TPU_RL_CLOUDSQL_CREDENTIALS"])
    project = api["GKE_TPU_RL_CLOUDSQL_INSTANCE"].split(":")[0]
    issuer = credentials["audience"].removeprefix(f"identitynamespace:{project}.svc.id.goog:")
    with GcpBoundary(host_ip=network.host_ip, project=project, instance_connection_name=api[
            "GKE_TPU_RL_CLOUDSQL_INSTANCE"], pg_unix_socket=_pg_socket(pg_server_url),
            workdir=tmp_path_factory.mktemp("gcp"), cluster_issuer=issuer) as b:
        yield b


def _run(ns: str, env: dict[str, str], code: str, *, wrapper: tuple[str, ...] = (),
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -c code` in the pod's namespace with exactly `env` (after `wrapper`, which runs as root there)."""
    assert IP is not None
    cmd = [IP, "netns", "exec", ns, *wrapper, "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()),
           sys.executable, "-c", code]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _pod_env(rendered_env: dict[str, str], boundary: GcpBoundary) -> dict[str, str]:
    assert not set(rendered_env) & set(boundary.env)
    return {**rendered_env, **boundary.env}


@pytest.fixture(scope="module")
def api_pod(network: Network, boundary: GcpBoundary, rendered: Rendered) -> tuple[str, str]:
    """The API pod, its KSA bound to its GSA (infra/components/database.py's workloadIdentityUser binding)."""
    ns, ip = network.pod("api", 2, boundary.hosts)
    ksa = rendered.api_pod["serviceAccountName"]
    boundary.add_pod(ip, "rl", ksa, rendered.gsa(ksa))
    boundary.bind_workload_identity(rendered.gsa(ksa), boundary.principal("rl", ksa))
    return ns, ip


def test_the_api_pod_creates_the_schema_as_its_gsa_through_the_metadata_server(
    api_pod: tuple[str, str], boundary: GcpBoundary, rendered: Rendered, database: Engine
) -> None:
    ns, ip = api_pod
    env = _pod_env(_env(rendered.api_pod, "api"), boundary)
    assert set(env) == {"GKE_TPU_RL_CLOUDSQL_INSTANCE", "GKE_TPU_RL_CLOUDSQL_USER", "GKE_TPU_RL_CLOUDSQL_DATABASE",
                        "HOME", *boundary.env}
    fake = boundary.fake
    seen = len(fake.calls)
    done = _run(ns, env, STORE)
    assert done.returncode == 0 and "schema ok" in done.stdout, done.stderr[-3000:]

    with database.connect() as conn:
        owners = dict(conn.execute(
            text("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'")).all())
    assert owners == {name: CLOUDSQL_OWNER_ROLE for name in Base.metadata.tables}
    gsa = rendered.gsa("tinker-api")
    principal = boundary.principal("rl", "tinker-api")
    # The metadata server saw the pod by its address: the ping, the account, one token per scope.
    mine = [c for c in boundary.metadata_calls if c.source_ip == ip]
    assert {c.status for c in mine} == {200}
    assert [c.query.get("scopes") for c in mine if c.path.endswith("/token")] == [ADMIN_SCOPE, LOGIN_SCOPE]
    assert sorted((t.account, t.scope, t.via, t.caller) for t in fake.tokens.values() if t.via == "metadata") == [
        (gsa, ADMIN_SCOPE, "metadata", principal), (gsa, LOGIN_SCOPE, "metadata", principal)]
    # The Google APIs over HTTPS: only the SQL Admin API (no STS, no key file), with those tokens. The connector makes
    # the two calls concurrently, so in either order.
    calls = fake.calls[seen:]
    cert_call = f"{fake.instance}:generateEphemeralCert"
    assert sorted((c.path.rsplit("/", 1)[-1], c.status) for c in calls) == sorted(
        [("connectSettings", 200), (cert_call, 200)])
    [admin] = [t for t in fake.tokens.values() if t.account == gsa and t.scope == ADMIN_SCOPE]
    [login] = [t for t in fake.tokens.values() if t.account == gsa and t.scope == LOGIN_SCOPE]
    [settings] = [c for c in calls if c.path.endswith("/connectSettings")]
    [cert] = [c for c in calls if c.path.endswith(cert_call)]
    assert settings.authorization == f"Bearer {admin.token}" and cert.body["access_token"] == login.token
    # The instance at HOST_IP (connectSettings' PRIVATE address), logged in as the API's IAM user.
    assert fake.tunnels and {t.local_ip for t in fake.tunnels} == {boundary.host_ip}
    assert {t.startup_params()["user"] for t in fake.tunnels} == {_env(rendered.api_pod, "api")[
        "GKE_TPU_RL_CLOUDSQL_USER"]}
    assert fake.errors == []


def test_the_engine_pod_logs_in_through_sts_and_impersonation(
    network: Network, boundary: GcpBoundary, rendered: Rendered, database: Engine
) -> None:
    pod = rendered.engine_pod
    ksa = pod["serviceAccountName"]
    gsa = rendered.gsa(ksa)
    ns, ip = network.pod("engine", 3, boundary.hosts)
    boundary.add_pod(ip, "rl", ksa, gsa, host_network=pod.get("hostNetwork", False))
    env = _pod_env(_env(pod, "engine"), boundary)
    credentials = json.loads(env["GKE_TPU_RL_CLOUDSQL_CREDENTIALS"])
    assert credentials["token_url"] == "https://sts.googleapis.com/v1/token"  # unchanged
    # The projected token at its rendered path, in the pod's own mount namespace (a tmpfs over /run: /var/run's).
    [volume] = [v for v in pod["volumes"] if v["name"] == "ksa-token"]
    [source] = [s["serviceAccountToken"] for s in volume["projected"]["sources"]]
    [mount] = [m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == "ksa-token"]
    assert credentials["credential_source"]["file"] == f"{mount}/{source['path']}"
    token = boundary.projected_token(source["audience"], "rl", ksa)
    token_file = boundary.workdir / "engine-token"
    token_file.write_text(token)
    wrapper = (UNSHARE or "unshare", "--mount", "--propagation", "private", "sh", "-ec",
               'mount -t tmpfs tmpfs /run; mkdir -p "$1"; cp "$2" "$1/$3"; shift 3; exec "$@"', "sh", mount,
               str(token_file), source["path"])
    boundary.bind_workload_identity(gsa, boundary.principal("rl", ksa))
    fake = boundary.fake
    seen, tokens_seen = len(fake.calls), len(fake.tokens)
    done = _run(ns, env, STORE, wrapper=wrapper)
    assert done.returncode == 0 and "schema ok" in done.stdout, done.stderr[-3000:]

    principal = boundary.principal("rl", ksa)
    calls = fake.calls[seen:]
    assert {c.status for c in calls} == {200}, [(c.path, c.status, c.body) for c in calls]
    exchanges = [c for c in calls if c.path == "/v1/token"]
    assert len(exchanges) == 2  # the admin-scoped credentials and the connector's login-scoped copy
    for call in exchanges:
        assert call.body == {"grant_type": TOKEN_EXCHANGE_GRANT, "audience": credentials["audience"],
                             "scope": IAM_SCOPE, "requested_token_type": ACCESS_TOKEN_TYPE, "subject_token": token,
                             "subject_token_type": JWT_TOKEN_TYPE}
    assert [(t.account, t.scope, t.via, t.caller) for t in list(fake.tokens.values())[tokens_seen:]] == [
        (gsa, ADMIN_SCOPE, "generateAccessToken", principal), (gsa, LOGIN_SCOPE, "generateAccessToken", principal)]
    # The engine never asked the metadata server (it is on the host network: that would be the node's account).
    assert [c for c in boundary.metadata_calls if c.source_ip == ip] == []
    engine_user = env["GKE_TPU_RL_CLOUDSQL_USER"]
    assert engine_user in {t.startup_params()["user"] for t in fake.tunnels}
    assert fake.errors == []


def test_the_database_down_and_up(
    api_pod: tuple[str, str], boundary: GcpBoundary, rendered: Rendered, database: Engine
) -> None:
    ns, _ = api_pod
    env = _pod_env(_env(rendered.api_pod, "api"), boundary)
    boundary.stop_database()
    try:
        down = _run(ns, env, STORE)
    finally:
        boundary.start_database()
    assert down.returncode != 0 and "Connection refused" in down.stderr, down.stderr[-3000:]
    up = _run(ns, env, STORE)
    assert up.returncode == 0 and "schema ok" in up.stdout, up.stderr[-3000:]


# Run with sys.argv = [scopes, a SQL Admin API URL, source addresses...]: per address, the metadata server's answers
# (status, body, Metadata-Flavor), and the SQL Admin API's status for the token it gave.
PROBE = """
import http.client, json, sys, urllib.error, urllib.request
scopes, url, sources = sys.argv[0], sys.argv[1], sys.argv[2:]
sa = "/computeMetadata/v1/instance/service-accounts/default/"
flavor = {"Metadata-Flavor": "Google"}
out = {}
for src in sources:
    res = out[src] = {}
    for name, path, headers in [("email", sa + "email", flavor), ("token", sa + "token?scopes=" + scopes, flavor),
                                ("bare", sa + "email", {})]:
        c = http.client.HTTPConnection("metadata.google.internal", 80, source_address=(src, 0), timeout=10)
        c.request("GET", path, headers=headers)
        r = c.getresponse()
        res[name] = [r.status, r.read().decode(), r.headers.get("Metadata-Flavor")]
    if res["token"][0] == 200:  # urllib verifies against SSL_CERT_FILE
        token = json.loads(res["token"][1])["access_token"]
        req = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
        try:
            res["sqladmin"] = urllib.request.urlopen(req, timeout=10).status
        except urllib.error.HTTPError as e:
            res["sqladmin"] = e.code
print(json.dumps(out))
"""


def test_the_metadata_server_answers_as_gke_does(network: Network, boundary: GcpBoundary, rendered: Rendered) -> None:
    """Per source address: a bound KSA gets its GSA's token, an unbound one GKE's 403, an unannotated one the pool's
    federated token (which the SQL Admin API refuses), a host-network pod the node's account, an unknown address 404;
    a request without Metadata-Flavor is refused."""
    ns, bound = network.pod("probe", 4, boundary.hosts, extra=(5, 6, 7, 8))
    unbound, plain, node, unknown = (f"{network.prefix}.{h}" for h in (5, 6, 7, 8))
    api_gsa, engine_gsa = rendered.gsa("tinker-api"), rendered.gsa("tinker-engine")
    boundary.add_pod(bound, "rl", "prober", api_gsa)
    boundary.bind_workload_identity(api_gsa, boundary.principal("rl", "prober"))
    boundary.add_pod(unbound, "rl", "stranger", engine_gsa)
    boundary.add_pod(plain, "rl", "default", None)
    boundary.add_pod(node, "rl", "tinker-engine", engine_gsa, host_network=True)
    fake = boundary.fake
    url = f"https://sqladmin.googleapis.com/sql/v1beta4/projects/{fake.project}/instances/{fake.instance}/" \
          "connectSettings"
    argv = [ADMIN_SCOPE, url, bound, unbound, plain, node, unknown]
    done = _run(ns, dict(boundary.env), f"import sys; sys.argv = {argv!r}\n{PROBE}")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out[bound]["email"] == [200, api_gsa, "Google"]
    assert out[bound]["sqladmin"] == 200
    assert out[bound]["bare"][0] == 403
    assert out[unbound]["email"] == [200, engine_gsa, "Google"]
    assert out[unbound]["token"][0] == 403
    assert out[unbound]["token"][1].startswith("Unable to generate access token; IAM returned 403 Forbidden")
    assert out[plain]["email"][:2] == [200, f"{boundary.project}.svc.id.goog"]
    assert out[plain]["token"][0] == 200 and out[plain]["sqladmin"] == 401
    assert out[node]["email"][:2] == [200, boundary.node_service_account]
    assert out[unknown]["email"][0] == 404
