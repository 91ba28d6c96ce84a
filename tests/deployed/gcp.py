"""GCP at its boundary, for pods that run as local processes in network namespaces (the as-deployed harness).

The pods' own code runs unchanged (google-auth, the Cloud SQL Python Connector, pg8000, trainer/service/store/);
only names, addresses and trust anchors point it here. Everything listens on HOST_IP, the one address of this
machine a pod can reach (the pod bridge's address in the root namespace):

- :80, the GKE metadata server (what pods get at metadata.google.internal / 169.254.169.254 on GKE). A pod is known
  by its source address (`add_pod`): its KSA, and the Google service account the KSA's iam.gke.io/gcp-service-account
  annotation names. As GKE's metadata server does (Workload Identity Federation for GKE):
  - annotated and bound (`bind_workload_identity`: roles/iam.workloadIdentityUser for
    serviceAccount:<project>.svc.id.goog[<ns>/<ksa>] on the GSA): .../service-accounts/default/email is the GSA, and
    .../token a token of it for ?scopes= (comma-separated; cloud-platform if none), which the SQL Admin API takes as
    that account's (an `IssuedToken` with via="metadata", caller the KSA's principal);
  - annotated, not bound: email is the GSA, token is HTTP 403 "Unable to generate access token; IAM returned 403
    Forbidden: ..." (what the real one answers; google-auth raises RefreshError);
  - not annotated: email is the pool, <project>.svc.id.goog, and token a federated token of the KSA's principal,
    which the SQL Admin API refuses (the real one is meant for IAM bindings on principal:// identities);
  - a host-network pod (`add_pod(..., host_network=True)`): the node's service account, whatever its KSA (GKE
    hands host-network pods' requests to the node's GCE metadata server), by default
    <cluster>-nodes@<project>.iam.gserviceaccount.com (infra/components/iam.py's node account);
  - an address no pod has (not `add_pod`ed): 404 on identity paths. project/project-id and universe/universe-domain
    answer anyone.
  Every request but the root's (google-auth's ping) must carry Metadata-Flavor: Google (else 403); every answer
  does.
- :443, HTTPS for sts., iamcredentials., sqladmin. and oauth2.googleapis.com with a certificate signed by a CA made
  here (the pods trust it through `env`): each host answers only its own API's paths, served by `FakeCloudSql`
  (tests/service/cloudsql_fake.py: STS for this cluster's KSA tokens, generateAccessToken, connectSettings,
  generateEphemeralCert, the JWT-bearer token route).
- :3307, the instance's TLS endpoint, relaying to a real PostgreSQL's unix socket; connectSettings answers HOST_IP
  as the PRIVATE address. `stop_database` / `start_database` take it down and up (the SQL Admin API stays up).

Usage: boundary = GcpBoundary(...).start(); per pod: add_pod(ip, ns, ksa, gsa), /etc/hosts += boundary.hosts,
env = rendered env + boundary.env; projected serviceAccountToken volumes hold projected_token(audience, ns, ksa).
`workdir` holds the CA bundle the pods read: it and its parents must be readable by the pods' users.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import certifi
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.service.cloudsql_fake import CLOUD_PLATFORM_SCOPE, FakeCloudSql

METADATA_HOST = "metadata.google.internal"
# Each API host and the paths it serves (the fake routes by path alone).
API_HOSTS: dict[str, re.Pattern[str]] = {
    "sts.googleapis.com": re.compile(r"/v1/token"),
    "iamcredentials.googleapis.com": re.compile(r"/v1/projects/-/serviceAccounts/[^/]+:generateAccessToken"),
    "sqladmin.googleapis.com": re.compile(r"/sql/v1beta4/.*"),
    "oauth2.googleapis.com": re.compile(r"/token"),
}
_SA_PATH = re.compile(r"/computeMetadata/v1/instance/service-accounts/([^/]+)/(.*)")
# What GKE's metadata server answers when generateAccessToken refuses the KSA (no workloadIdentityUser binding).
_UNBOUND = ("Unable to generate access token; IAM returned 403 Forbidden: Permission "
            "'iam.serviceAccounts.getAccessToken' denied on resource (or it may not exist).\n"
            "This error could be caused by a missing IAM policy binding on the target IAM service account.\n"
            "For more information, refer to the Workload Identity documentation:\n"
            "\thttps://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity#authenticating_to\n")


@dataclass(frozen=True)
class PodIdentity:
    namespace: str
    service_account: str
    gcp_service_account: str | None  # the KSA's iam.gke.io/gcp-service-account annotation
    host_network: bool = False


@dataclass
class MetadataCall:
    """One request the metadata server got."""

    source_ip: str
    method: str
    path: str
    query: dict[str, str]
    status: int = 0


class GcpBoundary:
    """The GKE metadata server, the Google APIs the pods call (STS, IAM Credentials, SQL Admin, OAuth) and the Cloud
    SQL instance, on `host_ip` (see the module docstring). `cluster_issuer`: the cluster's identity provider URL,
    https://container.googleapis.com/v1/projects/<p>/locations/<l>/clusters/<c> (the issuer of its KSA tokens, in
    the STS audience of workloads/service.py engine_credentials). `node_service_account`: what host-network pods are
    (default: infra/components/iam.py's <cluster>-nodes@<project>.iam.gserviceaccount.com). Use as a context manager (or
    start/stop)."""

    def __init__(self, *, host_ip: str, project: str, instance_connection_name: str, pg_unix_socket: str,
                 workdir: Path, cluster_issuer: str, node_service_account: str | None = None,
                 database_version: str = "POSTGRES_17") -> None:
        self.host_ip = host_ip
        self.project = project
        self.node_service_account = (node_service_account or
                                     f"{cluster_issuer.rstrip('/').rsplit('/', 1)[-1]}-nodes@{project}"
                                     ".iam.gserviceaccount.com")
        self.pool = f"{project}.svc.id.goog"
        self.sts_audience = f"identitynamespace:{self.pool}:{cluster_issuer}"
        self.workdir = workdir
        self.fake = FakeCloudSql(instance_connection_name, pg_unix_socket, database_version=database_version,
                                 instance_ip=host_ip)
        self.pods: dict[str, PodIdentity] = {}  # source IP -> who runs there
        self.metadata_calls: list[MetadataCall] = []
        self.ca_bundle = workdir / "gcp-ca-bundle.pem"
        self.hosts: dict[str, str] = {name: host_ip for name in (*API_HOSTS, METADATA_HOST)}
        self.env: dict[str, str] = {
            # The connector's SQL Admin calls go through aiohttp, which verifies with ssl.create_default_context():
            # OpenSSL's default paths, which SSL_CERT_FILE replaces.
            "SSL_CERT_FILE": str(self.ca_bundle),
            # google-auth's transport is requests (STS, IAM Credentials), which verifies against certifi's bundle
            # unless REQUESTS_CA_BUNDLE names another.
            "REQUESTS_CA_BUNDLE": str(self.ca_bundle),
            # google-auth trusts the metadata server only after a ping to 169.254.169.254 by address
            # (compute_engine/_metadata.py ping), which a pod cannot reach here (GKE's node redirects it to the
            # gke-metadata-server); GCE_METADATA_IP is google-auth's own override of that address.
            # metadata.google.internal, where it then reads, comes from `hosts`.
            "GCE_METADATA_IP": host_ip,
        }
        self._runners: list[web.AppRunner] = []

    # -- life cycle ------------------------------------------------------------------------------------------

    def start(self) -> GcpBoundary:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(0o755)  # the pods' users read the CA bundle here
        self.fake.start()
        try:
            self.fake.trust_cluster(self.sts_audience)
            api_tls = self._make_pki()
            self.fake.run(self._serve(self._google_apis, 443, api_tls))
            self.fake.run(self._serve(self._metadata, 80, None))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for runner in self._runners:
            self.fake.run(runner.cleanup())
        self._runners.clear()
        self.fake.stop()

    def __enter__(self) -> GcpBoundary:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the cluster's view ------------------------------------------------------------------------------------

    def add_pod(self, ip: str, namespace: str, service_account: str, gcp_service_account: str | None, *,
                host_network: bool = False) -> None:
        """The pod at `ip` runs as KSA namespace/service_account, annotated with `gcp_service_account` (or not);
        a host-network pod's metadata identity is the node's. A later call for the same address replaces it."""
        self.pods[ip] = PodIdentity(namespace, service_account, gcp_service_account, host_network)

    def principal(self, namespace: str, service_account: str) -> str:
        """The IAM member a KSA is: serviceAccount:<project>.svc.id.goog[<ns>/<ksa>]."""
        return f"serviceAccount:{self.pool}[{namespace}/{service_account}]"

    def bind_workload_identity(self, gsa_email: str, principal: str) -> None:
        """roles/iam.workloadIdentityUser on `gsa_email` for `principal` (`principal(ns, ksa)`): the metadata server
        gives that KSA's pods the GSA's tokens, and its federated tokens may impersonate the GSA."""
        self.fake.allow_impersonation(gsa_email, principal)

    def projected_token(self, audience: str, namespace: str, service_account: str) -> str:
        """What the kubelet writes for a projected serviceAccountToken of this KSA with this audience: a JWT of this
        cluster (issuer `cluster_issuer`), which STS exchanges when the audience is the pool."""
        return self.fake.ksa_token(self.sts_audience, namespace, service_account, token_audience=audience)

    def stop_database(self) -> None:
        """The instance's port 3307 refuses connections (open ones are closed); the SQL Admin API still answers."""
        self.fake.stop_instance()

    def start_database(self) -> None:
        self.fake.start_instance()

    # -- servers -----------------------------------------------------------------------------------------------

    async def _serve(self, handler: Any, port: int, tls: ssl.SSLContext | None) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, self.host_ip, port, ssl_context=tls).start()

    async def _google_apis(self, request: web.Request) -> web.Response:
        host = (request.host or "").split(":")[0]
        paths = API_HOSTS.get(host)
        if paths is None or not paths.fullmatch(request.path):
            return web.json_response({"error": {"code": 404, "status": "NOT_FOUND", "message":
                                                f"no such API method: {request.method} {host}{request.path}"}},
                                     status=404)
        return await self.fake.handle(request)

    async def _metadata(self, request: web.Request) -> web.Response:
        call = MetadataCall(request.remote or "", request.method, request.path, dict(request.query))
        self.metadata_calls.append(call)
        response = self._metadata_answer(request, call.source_ip)
        response.headers["Metadata-Flavor"] = "Google"
        call.status = response.status
        return response

    def _metadata_answer(self, request: web.Request, ip: str) -> web.Response:
        if request.path == "/":  # google-auth's ping: only the status and the Metadata-Flavor header count
            return _text("computeMetadata/\n")
        if request.headers.get("Metadata-Flavor") != "Google":
            return _text("Missing required header: Metadata-Flavor: Google\n", 403)
        path = request.path
        if path == "/computeMetadata/v1/project/project-id":
            return _text(self.project)
        if path == "/computeMetadata/v1/universe/universe-domain":
            return _text("googleapis.com")
        if not path.startswith("/computeMetadata/v1/instance/service-accounts/"):
            return _text("Not Found\n", 404)
        pod = self.pods.get(ip)
        if pod is None:
            return _text(f"no pod has the address {ip}\n", 404)
        email = (self.node_service_account if pod.host_network else pod.gcp_service_account) or self.pool
        if path == "/computeMetadata/v1/instance/service-accounts/":
            return _text(f"default/\n{email}/\n")
        m = _SA_PATH.fullmatch(path)
        if m is None or m.group(1) not in ("default", email):
            return _text("Not Found\n", 404)
        leaf = m.group(2)
        if leaf == "" and request.query.get("recursive") == "true":
            return web.json_response({"aliases": ["default"], "email": email, "scopes": [CLOUD_PLATFORM_SCOPE]})
        if leaf == "":
            return _text("aliases\nemail\nidentity\nscopes\ntoken\n")
        if leaf == "email":
            return _text(email)
        if leaf == "aliases":
            return _text("default")
        if leaf == "scopes":
            return _text(f"{CLOUD_PLATFORM_SCOPE}\n")
        if leaf != "token":
            return _text("Not Found\n", 404)
        scope = " ".join(s for s in request.query.get("scopes", CLOUD_PLATFORM_SCOPE).split(",") if s)
        if pod.host_network:  # the node's own account: GCE's metadata server needs no binding
            token = self.fake.issue_token(email, scope, via="metadata", caller="node")
            return web.json_response({"access_token": token.token, "expires_in": token.expires_in,
                                      "token_type": "Bearer"})
        principal = self.principal(pod.namespace, pod.service_account)
        if pod.gcp_service_account is None:
            federated = self.fake.federated_token(principal, self.sts_audience, scope)
            return web.json_response({"access_token": federated.token, "expires_in": federated.expires_in,
                                      "token_type": "Bearer"})
        if principal not in self.fake.impersonators.get(pod.gcp_service_account, set()):
            return _text(_UNBOUND, 403)
        token = self.fake.issue_token(pod.gcp_service_account, scope, via="metadata", caller=principal)
        return web.json_response({"access_token": token.token, "expires_in": token.expires_in,
                                  "token_type": "Bearer"})

    # -- PKI ---------------------------------------------------------------------------------------------------

    def _make_pki(self) -> ssl.SSLContext:
        """A CA, a certificate for the API host names signed by it, and the pods' CA bundle (certifi's + this CA)."""
        now = dt.datetime.now(dt.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gke-tpu-rl GCP boundary CA (test)")])
        usage = dict(content_commitment=False, key_encipherment=False, data_encipherment=False, key_agreement=False,
                     encipher_only=False, decipher_only=False)
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=False, key_cert_sign=True, crl_sign=True, **usage),
                             critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName(h) for h in API_HOSTS]
        names.append(x509.IPAddress(ipaddress.ip_address(self.host_ip)))
        leaf = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "*.googleapis.com")]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, **usage),
                               critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
        # Pods run as the image's user: the bundle must be readable by anyone (the key is this process's only).
        self.ca_bundle.write_text(Path(certifi.where()).read_text() + "\n" + ca_pem)
        os.chmod(self.ca_bundle, 0o644)
        cert_file, key_file = self.workdir / "googleapis.pem", self.workdir / "googleapis.key"
        cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
        key_file.touch(mode=0o600)
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert_file, key_file)
        return ctx


def _text(body: str, status: int = 200) -> web.Response:
    return web.Response(text=body, status=status, content_type="application/text")
