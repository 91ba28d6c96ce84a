"""A local stand-in for Cloud SQL for PostgreSQL that the real Cloud SQL Python Connector talks to, offline.

What the connector (cloud-sql-python-connector 1.23) does, and what answers it here:

- Credentials: with no credentials passed, `Connector.__init__` calls `google.auth.default(scopes=[sqlservice.admin])`
  (connector.py:241). `write_credentials()` writes a service account key file (a key made here) whose `token_uri`
  is this server's `/token` route: point GOOGLE_APPLICATION_CREDENTIALS at it and google-auth's own JWT-bearer
  grant POSTs a signed assertion here, which is verified and answered with an access token for the assertion's
  scope. (An `authorized_user` file cannot be redirected: google-auth 2.62's `from_authorized_user_info` always
  sets the token URI to oauth2.googleapis.com; the metadata server's address, what GKE workload identity uses, is
  read once at import.) Service account credentials are `Scoped`, like workload identity's, so the connector
  down-scopes them with `with_scopes` (refresh_utils.py:101-102). It refreshes the admin credentials before its
  API calls (client.py:331-332) and, for IAM database authentication, refreshes a copy down-scoped to
  sqlservice.login (refresh_utils.py:82-113) whose token goes into generateEphemeralCert's body
  (client.py:256-259). Tokens are handed out per scope, so a test can tell them apart.
- SQL Admin API (`endpoint`, the connector's `sqladmin_api_endpoint`): GET
  /sql/v1beta4/projects/{p}/instances/{i}/connectSettings (client.py:124) and POST
  /sql/v1beta4/projects/{p}/instances/{i}:generateEphemeralCert (client.py:252), both with the admin token as a
  Bearer header. connectSettings answers the instance's region (the connector checks it, client.py:143), its
  addresses (a PRIMARY and a PRIVATE one), databaseVersion and serverCaCert (a CA made here); generateEphemeralCert
  signs the client's public key with that CA (1 h), which the connector caps at the login token's expiry
  (client.py:292-302).
- The instance: the connector opens TCP to <ip>:3307 (`SERVER_PROXY_PORT`, a module constant, connector.py:61,644)
  and wraps it in TLS 1.3 with the ephemeral cert, verifying the server's chain against serverCaCert with no
  hostname check (connection_info.py:88-122, `check_hostname = False`). Here a TLS terminator on <PRIVATE ip>:3307
  requires a client cert from the CA and relays the bytes to a real PostgreSQL's unix socket, recording the client
  cert, the TLS version and the first bytes pg8000 sends inside the tunnel (SSLRequest, then the StartupMessage
  naming the user and database). Nothing checks the IAM token on the database side (the local server trusts local
  logins): the point is to run the connector's and pg8000's code, not Cloud SQL's login check.
- External account credentials (a google-auth credential configuration of type external_account, identity_pool,
  with service account impersonation: what workloads/service.py engine_credentials gives the engine), with its
  `token_url` and the host of its `service_account_impersonation_url` pointed here:
  - STS (`sts_token_url`, POST /v1/token): google-auth reads the subject token from credential_source.file as is
    (identity_pool.py:102-111, format "text") and POSTs an RFC 8693 token exchange, form-encoded
    (sts.py:40,59-80): grant_type urn:ietf:params:oauth:grant-type:token-exchange, audience, scope (space-joined),
    requested_token_type urn:ietf:params:oauth:token-type:access_token, subject_token, subject_token_type
    (external_account.py:60-62,516-526; sts.py:144-164 drops empty fields). With impersonation the exchanging
    credentials are a copy without it, re-scoped to iam._IAM_SCOPE (https://www.googleapis.com/auth/iam,
    impersonated_credentials.py:250-257, iam.py:36): that is the scope STS gets, whatever the connector asked for.
    Answered like GKE's workload identity: for an audience identitynamespace:<pool>:<provider> registered with
    `trust_cluster`, the subject token must be a JWT signed by that cluster (`ksa_token` makes one), issued by
    <provider> for the audience <pool>; the federated token's principal is serviceAccount:<pool>[<ns>/<ksa>].
  - IAM Credentials (POST /v1/projects/-/serviceAccounts/{email}:generateAccessToken, the impersonation URL as
    given, impersonated_credentials.py:94-100): Bearer the federated token, JSON {"delegates": null, "scope":
    [the connector's scopes], "lifetime": "3600s"} (impersonated_credentials.py:299-311), answered
    {"accessToken", "expireTime"} with expireTime exactly %Y-%m-%dT%H:%M:%SZ (parsed so,
    impersonated_credentials.py:112-117). Allowed when `allow_impersonation` bound the caller's principal to the
    account (roles/iam.workloadIdentityUser); the token is the account's, for the scopes asked, and the SQL Admin
    routes take it as they take a key's. Federated tokens themselves are refused there (401), so a test shows the
    impersonated token is what the connector used. The connector re-scopes with `with_scopes`, which for external
    account credentials builds a new object from the constructor arguments without the cached impersonated
    credentials (external_account.py:367-375,486-499,617-663): the sqlservice.login token costs a second STS exchange
    and a second generateAccessToken, for [sqlservice.login].

The port being fixed, both addresses are random 127.x.y.z loopback addresses (Linux routes all of 127/8 to lo), so
parallel runs do not collide; the PRIMARY one has a plain listener that only counts connections, so a test can
assert the connector never used it. Everything runs on one asyncio loop in a daemon thread.

For pods in network namespaces (tests/deployed/gcp.py), which reach only one address of this machine: `instance_ip`
puts the PRIVATE endpoint on that address (and no PRIMARY listener), `handle` answers a request another listener got
(on the fake's loop: `run`), `issue_token` / `federated_token` hand out tokens for another issuer (a metadata
server) and `stop_instance` / `start_instance` take the instance's port 3307 down and up.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import json
import random
import re
import secrets
import ssl
import struct
import tempfile
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from google.auth import crypt as google_crypt
from google.auth import exceptions as google_exceptions
from google.auth import jwt as google_jwt

SERVER_PROXY_PORT = 3307  # google.cloud.sql.connector.connector.SERVER_PROXY_PORT: not configurable
ADMIN_SCOPE = "https://www.googleapis.com/auth/sqlservice.admin"
LOGIN_SCOPE = "https://www.googleapis.com/auth/sqlservice.login"
IAM_SCOPE = "https://www.googleapis.com/auth/iam"  # google.auth.iam._IAM_SCOPE
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
TOKEN_EXCHANGE_GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"
ID_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:id_token"
_SSL_REQUEST = struct.pack("!ii", 8, 80877103)
_INSTANCE_PATH = re.compile(
    r"/sql/v1beta4/projects/([^/]+)/instances/([^/:]+)(/connectSettings|:generateEphemeralCert)")
_GENERATE_ACCESS_TOKEN = re.compile(r"/v1/projects/-/serviceAccounts/([^/:]+):generateAccessToken")
# GKE workload identity's STS audience: the identity namespace (pool) and the cluster's identity provider (its issuer).
_IDENTITY_NAMESPACE = re.compile(r"identitynamespace:([^:]+):(https://.+)")
_KSA_SUBJECT = re.compile(r"system:serviceaccount:([^:]+):([^:]+)")


class PortUnavailable(RuntimeError):
    """No loopback address has port 3307 free (the connector's port is fixed)."""


@dataclass
class ApiCall:
    """One HTTP request the fake received (token route, STS, IAM Credentials or SQL Admin API)."""

    method: str
    path: str
    authorization: str | None
    body: dict[str, Any]  # the JSON body, or the form fields of a token request
    status: int = 0
    content_type: str = ""


@dataclass(frozen=True)
class IssuedToken:
    """An access token of a service account: for a signed assertion (/token) or by impersonation."""

    token: str
    account: str  # the service account: the assertion's signer, or the one generateAccessToken impersonated
    scope: str
    expires_in: int
    via: str = "jwt-bearer"  # or "generateAccessToken"
    caller: str | None = None  # generateAccessToken: the principal whose Bearer token asked for it


@dataclass(frozen=True)
class FederatedToken:
    """A token STS gave for a Kubernetes service account token: good for impersonation, not for the SQL Admin API."""

    token: str
    principal: str  # serviceAccount:<pool>[<namespace>/<ksa>]
    audience: str
    scope: str
    subject_token: str
    expires_in: int


@dataclass(frozen=True)
class IssuedCert:
    """An ephemeral client certificate, with what its generateEphemeralCert request carried."""

    cert: x509.Certificate
    public_key_pem: str
    access_token: str | None


@dataclass
class Tunnel:
    """One TLS connection to the instance's port 3307."""

    local_ip: str
    client_cert: x509.Certificate | None
    issued: IssuedCert | None  # the generateEphemeralCert answer the client cert came from
    tls_version: str | None
    client_bytes: bytearray = field(default_factory=bytearray)  # the first bytes the client sent inside TLS

    @property
    def ssl_request(self) -> bool:
        """Whether the driver began with PostgreSQL's SSLRequest (pg8000 does, even on the connector's socket)."""
        return bytes(self.client_bytes[:8]) == _SSL_REQUEST

    def startup_params(self) -> dict[str, str]:
        """The parameters of the PostgreSQL StartupMessage the client sent (user, database, ...)."""
        data = bytes(self.client_bytes[8:] if self.ssl_request else self.client_bytes)
        length, protocol = struct.unpack("!ii", data[:8])
        if protocol != 196608 or len(data) < length:
            raise ValueError(f"no protocol 3.0 StartupMessage in {data[:64]!r}")
        words = data[8:length].split(b"\0")
        params: dict[str, str] = {}
        for key, value in zip(words[0::2], words[1::2], strict=False):
            if not key:
                break
            params[key.decode()] = value.decode()
        return params


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn[:64])])  # X.509's upper bound on a CN


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


class FakeCloudSql:
    """The SQL Admin API, the OAuth token route, STS and IAM Credentials' generateAccessToken, and the instance's TLS
    endpoint, for one instance.

    `pg_unix_socket`: the PostgreSQL server's socket file the tunnel relays to. `token_lifetime_s`: seconds of
    validity per scope of the access tokens handed out (default 3600). `instance_ip`: listen for the instance (the
    PRIVATE address) on this address's port 3307 instead of a random loopback one, with no PRIMARY listener. Use as a
    context manager (or start/stop).
    """

    def __init__(
        self,
        connection_name: str,
        pg_unix_socket: str,
        *,
        database_version: str = "POSTGRES_17",
        service_account: str = "api-sa@proj.iam.gserviceaccount.com",
        token_lifetime_s: dict[str, int] | None = None,
        cert_lifetime_s: int = 3600,
        instance_ip: str | None = None,
    ) -> None:
        self.project, self.region, self.instance = connection_name.split(":")
        self.pg_unix_socket = pg_unix_socket
        self.database_version = database_version
        self.token_lifetime_s = dict(token_lifetime_s or {})
        self.cert_lifetime_s = cert_lifetime_s
        self.service_account = service_account
        self.sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_key_id = secrets.token_hex(20)
        # What was asked and handed out (appended from the loop's thread; read them once the client is done).
        self.calls: list[ApiCall] = []
        self.tokens: dict[str, IssuedToken] = {}
        self.sts_tokens: dict[str, FederatedToken] = {}
        self.impersonators: dict[str, set[str]] = {}  # service account email -> principals that may impersonate it
        self._clusters: dict[str, tuple[rsa.RSAPrivateKey, str]] = {}  # STS audience -> the cluster's signing key, kid
        self.certs: list[IssuedCert] = []
        self.tunnels: list[Tunnel] = []
        self.public_ip_connections = 0
        self.errors: list[str] = []  # the loop's unhandled errors, relay failures (a refused TLS handshake: no tunnel)
        self.private_ip = self.public_ip = ""
        self.instance_ip = instance_ip
        self.port = 0
        self._make_pki()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-cloudsql", daemon=True)
        self._runner: web.AppRunner | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._instance: asyncio.base_events.Server | None = None  # the PRIVATE address's listener
        self._tunnel_writers: set[asyncio.StreamWriter] = set()
        self._tmp = tempfile.TemporaryDirectory(prefix="fake-cloudsql-")

    # -- life cycle ------------------------------------------------------------------------------------------

    def start(self) -> FakeCloudSql:
        self._loop.set_exception_handler(self._on_loop_error)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_running():
            self._loop.close()
        self._tmp.cleanup()

    def __enter__(self) -> FakeCloudSql:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """The SQL Admin API base URL (the connector's `sqladmin_api_endpoint`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def token_uri(self) -> str:
        return f"{self.endpoint}/token"

    def write_credentials(self, path: Path) -> Path:
        """A service account key file (Application Default Credentials) whose token route is this server."""
        info = {
            "type": "service_account",
            "project_id": self.project,
            "private_key_id": self.sa_key_id,
            "private_key": self.sa_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode(),
            "client_email": self.service_account,
            "client_id": "100000000000000000001",
            "token_uri": self.token_uri,
            "universe_domain": "googleapis.com",
        }
        path.write_text(json.dumps(info))
        return path

    @property
    def sts_token_url(self) -> str:
        """STS's token route (https://sts.googleapis.com/v1/token here)."""
        return f"{self.endpoint}/v1/token"

    def trust_cluster(self, audience: str) -> None:
        """Let STS take tokens of a GKE cluster's service accounts for `audience`,
        identitynamespace:<pool>:<provider> (the cluster's identity provider URL, also its tokens' issuer)."""
        if _IDENTITY_NAMESPACE.fullmatch(audience) is None:
            raise ValueError(f"not an identitynamespace:<pool>:<provider> audience: {audience!r}")
        self._clusters.setdefault(audience, (rsa.generate_private_key(public_exponent=65537, key_size=2048),
                                             secrets.token_hex(20)))

    def ksa_token(self, audience: str, namespace: str, name: str, lifetime_s: int = 3600,
                  token_audience: str | None = None) -> str:
        """A projected service account token of the cluster `trust_cluster` registered for `audience`, as the kubelet
        writes it (a JWT; its audience is the pool, `serviceAccountToken.audience`, or `token_audience`; its issuer
        the provider)."""
        key, kid = self._clusters[audience]
        m = _IDENTITY_NAMESPACE.fullmatch(audience)
        assert m is not None
        now = int(dt.datetime.now(dt.UTC).timestamp())
        claims = {"aud": [token_audience or m.group(1)], "iss": m.group(2),
                  "sub": f"system:serviceaccount:{namespace}:{name}",
                  "iat": now, "nbf": now, "exp": now + lifetime_s,
                  "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": name,
                                                                               "uid": secrets.token_hex(8)}}}
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        return google_jwt.encode(google_crypt.RSASigner.from_string(pem, kid), claims).decode()

    def allow_impersonation(self, email: str, principal: str) -> None:
        """Grant `principal` (serviceAccount:<pool>[<ns>/<ksa>], or serviceAccount:<email>) generateAccessToken on
        the service account `email` (roles/iam.workloadIdentityUser or roles/iam.serviceAccountTokenCreator)."""
        self.impersonators.setdefault(email, set()).add(principal)

    def calls_to(self, suffix: str) -> list[ApiCall]:
        return [c for c in self.calls if c.path.endswith(suffix)]

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the fake's loop (where its servers live) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    def issue_token(self, account: str, scope: str, *, via: str, caller: str | None = None) -> IssuedToken:
        """A token of the service account `account` for `scope` (space-separated), as if an issuer other than the
        routes here (a metadata server) had got it; the SQL Admin routes take it as they take their own."""
        lifetime = self.token_lifetime_s.get(scope, 3600)
        token = IssuedToken(f"ya29.c.fake-{len(self.tokens)}-{secrets.token_urlsafe(8)}", account, scope, lifetime,
                            via=via, caller=caller)
        self.tokens[token.token] = token
        return token

    def federated_token(self, principal: str, audience: str, scope: str) -> FederatedToken:
        """A federated token of `principal` (serviceAccount:<pool>[<ns>/<ksa>]) as STS would give it: good for
        impersonation where `allow_impersonation` allows it, refused by the SQL Admin routes."""
        token = FederatedToken(f"ya29.d.fake-sts-{len(self.sts_tokens)}-{secrets.token_urlsafe(8)}", principal,
                               audience, scope, "", 3600)
        self.sts_tokens[token.token] = token
        return token

    def stop_instance(self) -> None:
        """The instance goes away: its port 3307 refuses connections and open tunnels are closed."""
        self.run(self._stop_instance())

    def start_instance(self) -> None:
        """The instance is back on the same PRIVATE address."""
        self.run(self._start_instance())

    # -- PKI ---------------------------------------------------------------------------------------------------

    def _make_pki(self) -> None:
        now = dt.datetime.now(dt.UTC)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name(f"Google Cloud SQL Server CA (fake) {self.project}:{self.instance}")
        self.ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(self.ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                              key_encipherment=False, data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.ca_key.public_key()), critical=False)
            .sign(self.ca_key, hashes.SHA256())
        )
        self.server_key = ec.generate_private_key(ec.SECP256R1())
        # google-auth verifies JWTs against certificates (or public keys) in PEM: the service account key's.
        self._sa_cert_pem = self.sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()

    def _sign(self, subject: str, public_key: Any, lifetime: dt.timedelta, *, server: bool,
              sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(subject))
            .issuer_name(self.ca_cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                           critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self.ca_key, hashes.SHA256())

    def _server_ssl_context(self) -> ssl.SSLContext:
        # Like a Cloud SQL server cert of a per-instance CA: CN "project:instance" (the connector checks no name).
        cert = self._sign(
            f"{self.project}:{self.instance}", self.server_key.public_key(), dt.timedelta(days=1), server=True,
            sans=[x509.DNSName(f"{self.instance}.{self.region}.sql.goog")],
        )
        cert_file, key_file = Path(self._tmp.name) / "server.pem", Path(self._tmp.name) / "server.key"
        cert_file.write_text(_pem(cert))
        key_file.write_bytes(self.server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED  # only clients holding an ephemeral cert from this CA get in
        ctx.load_verify_locations(cadata=_pem(self.ca_cert))
        ctx.load_cert_chain(cert_file, key_file)
        return ctx

    # -- servers -----------------------------------------------------------------------------------------------

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        # The PRIVATE address gets the TLS terminator; a PRIMARY one gets a listener that only counts connections.
        if self.instance_ip is not None:
            self.private_ip = self.instance_ip
            self.public_ip = "203.0.113.10"  # TEST-NET-3: nothing answers there
            await self._start_instance()
            return
        server, self.private_ip = await self._listen_3307(self._tunnel, self._server_ssl_context())
        self._instance = server
        self._servers.append(server)
        try:
            server, self.public_ip = await self._listen_3307(self._public, None)
            self._servers.append(server)
        except PortUnavailable:
            self.public_ip = "192.0.2.10"  # TEST-NET-1: nothing answers there (and there is no listener to count)

    async def _listen_3307(self, handler: Any, ctx: ssl.SSLContext | None) -> tuple[asyncio.base_events.Server, str]:
        """Listen on port 3307 of a random loopback address (127.0.0.1 last)."""
        rng = random.Random()
        candidates = [f"127.{rng.randint(1, 254)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}" for _ in range(20)]
        reasons: list[str] = []
        for ip in [*candidates, "127.0.0.1"]:
            if ip in (self.private_ip, self.public_ip):
                continue
            try:
                server = await asyncio.start_server(handler, ip, SERVER_PROXY_PORT, ssl=ctx,
                                                    ssl_handshake_timeout=10 if ctx else None)
                return server, ip
            except OSError as e:
                reasons.append(f"{ip}: {errno.errorcode.get(e.errno or 0, str(e))}")
        raise PortUnavailable(f"port {SERVER_PROXY_PORT} (the connector's fixed SERVER_PROXY_PORT) cannot be bound on "
                              f"any loopback address tried ({'; '.join(reasons[-2:])})")

    async def _start_instance(self) -> None:
        if self._instance is not None:
            return
        self._instance = await asyncio.start_server(self._tunnel, self.private_ip, SERVER_PROXY_PORT,
                                                    ssl=self._server_ssl_context(), ssl_handshake_timeout=10)
        self._servers.append(self._instance)

    async def _stop_instance(self) -> None:
        if self._instance is None:
            return
        self._servers.remove(self._instance)
        self._instance.close()
        for writer in list(self._tunnel_writers):
            writer.close()
        await self._instance.wait_closed()
        self._instance = None

    async def _stop(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._tunnel_writers):
            writer.close()
        for server in self._servers:
            await server.wait_closed()
        if self._runner is not None:
            await self._runner.cleanup()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    # -- HTTP: token route and SQL Admin API -------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.Response:
        """Answer one request to the HTTP routes (what `endpoint` and `serve`'s listeners run)."""
        raw = await request.read()
        if request.content_type == "application/x-www-form-urlencoded":
            body: dict[str, Any] = dict(urllib.parse.parse_qsl(raw.decode()))
        else:
            body = json.loads(raw) if raw else {}
        call = ApiCall(request.method, request.path, request.headers.get("Authorization"), body,
                       content_type=request.content_type)
        self.calls.append(call)
        if request.method == "POST" and request.path == "/token":
            response = self._token(body)
        elif request.method == "POST" and request.path == "/v1/token":
            response = self._sts(body)
        elif request.method == "POST" and (g := _GENERATE_ACCESS_TOKEN.fullmatch(request.path)) is not None:
            response = self._generate_access_token(g.group(1), call.authorization, body)
        elif (m := _INSTANCE_PATH.fullmatch(request.path)) is None:
            response = _google_error(404, "NOT_FOUND", f"no such API method: {request.method} {request.path}")
        elif (denied := self._check_admin_token(call.authorization)) is not None:
            response = denied
        elif (m.group(1), m.group(2)) != (self.project, self.instance):
            response = _google_error(404, "NOT_FOUND", "The Cloud SQL instance does not exist.")
        elif m.group(3) == "/connectSettings" and request.method == "GET":
            response = web.json_response(self._connect_settings())
        elif m.group(3) == ":generateEphemeralCert" and request.method == "POST":
            response = self._ephemeral_cert(body)
        else:
            response = _google_error(405, "METHOD_NOT_ALLOWED", f"{request.method} {request.path}")
        call.status = response.status
        return response

    def _token(self, form: dict[str, str]) -> web.Response:
        """OAuth 2.0 JWT-bearer grant (RFC 7523), what google-auth's service account credentials send."""
        if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
            return _oauth_error("unsupported_grant_type", f"grant_type {form.get('grant_type')!r}")
        try:
            # google-auth always names Google's token endpoint as the audience, whatever the token_uri.
            claims = google_jwt.decode(form.get("assertion", ""), certs={self.sa_key_id: self._sa_cert_pem},
                                       audience="https://oauth2.googleapis.com/token")
        except (ValueError, google_exceptions.GoogleAuthError) as e:
            return _oauth_error("invalid_grant", f"Invalid JWT Signature or claims: {e}")
        if claims.get("iss") != self.service_account:
            return _oauth_error("invalid_grant", f"unknown issuer {claims.get('iss')!r}")
        scope = claims.get("scope", "")
        lifetime = self.token_lifetime_s.get(scope, 3600)
        token = IssuedToken(f"ya29.fake-{len(self.tokens)}-{secrets.token_urlsafe(8)}", claims["iss"], scope, lifetime)
        self.tokens[token.token] = token
        return web.json_response({"access_token": token.token, "expires_in": lifetime, "token_type": "Bearer"})

    def _sts(self, form: dict[str, str]) -> web.Response:
        """RFC 8693 token exchange (what google.oauth2.sts sends), for a GKE cluster's service account tokens."""
        if form.get("grant_type") != TOKEN_EXCHANGE_GRANT:
            return _oauth_error("unsupported_grant_type", f"grant_type {form.get('grant_type')!r}")
        if form.get("requested_token_type") != ACCESS_TOKEN_TYPE:
            return _oauth_error("invalid_request", f"requested_token_type {form.get('requested_token_type')!r}")
        if form.get("subject_token_type") not in (JWT_TOKEN_TYPE, ID_TOKEN_TYPE):
            return _oauth_error("invalid_request", f"subject_token_type {form.get('subject_token_type')!r}")
        if not form.get("scope"):
            return _oauth_error("invalid_request", "scope is required")
        audience = form.get("audience", "")
        if audience not in self._clusters:
            return _oauth_error("invalid_target", f"The target service indicated by the audience is invalid: "
                                                  f"{audience!r}")
        m = _IDENTITY_NAMESPACE.fullmatch(audience)
        assert m is not None
        pool, provider = m.groups()
        key, kid = self._clusters[audience]
        public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        subject_token = form.get("subject_token", "")
        try:
            claims = google_jwt.decode(subject_token, certs={kid: public_pem})
        except (ValueError, google_exceptions.GoogleAuthError) as e:
            return _oauth_error("invalid_grant", f"The subject token could not be verified: {e}")
        aud = claims.get("aud")
        if claims.get("iss") != provider or pool not in (aud if isinstance(aud, list) else [aud]):
            return _oauth_error("invalid_grant", f"The subject token's issuer {claims.get('iss')!r} or audience "
                                                 f"{aud!r} does not match {audience!r}")
        if (sub := _KSA_SUBJECT.fullmatch(str(claims.get("sub")))) is None:
            return _oauth_error("invalid_grant", f"not a Kubernetes service account: {claims.get('sub')!r}")
        token = FederatedToken(f"ya29.d.fake-sts-{len(self.sts_tokens)}-{secrets.token_urlsafe(8)}",
                               f"serviceAccount:{pool}[{sub.group(1)}/{sub.group(2)}]", audience, form["scope"],
                               subject_token, 3600)
        self.sts_tokens[token.token] = token
        return web.json_response({"access_token": token.token, "issued_token_type": ACCESS_TOKEN_TYPE,
                                  "token_type": "Bearer", "expires_in": token.expires_in})

    def _generate_access_token(self, email: str, authorization: str | None, body: dict[str, Any]) -> web.Response:
        """IAM Credentials projects.serviceAccounts.generateAccessToken: a token of `email` for the caller."""
        bearer = (authorization or "").removeprefix("Bearer ")
        if not (authorization or "").startswith("Bearer ") or not bearer:
            return _google_error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials.")
        if (federated := self.sts_tokens.get(bearer)) is not None:
            principal, scope = federated.principal, federated.scope
        elif (own := self.tokens.get(bearer)) is not None:
            principal, scope = f"serviceAccount:{own.account}", own.scope
        else:
            return _google_error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials.")
        if not {IAM_SCOPE, CLOUD_PLATFORM_SCOPE} & set(scope.split()):
            return _google_error(403, "PERMISSION_DENIED", "Request had insufficient authentication scopes.")
        if principal not in self.impersonators.get(email, set()):
            return _google_error(403, "PERMISSION_DENIED", "Permission 'iam.serviceAccounts.getAccessToken' denied "
                                                           "on resource (or it may not exist).")
        scopes = body.get("scope")
        if not scopes or not isinstance(scopes, list):
            return _google_error(400, "INVALID_ARGUMENT", "Scope required.")
        if body.get("delegates"):
            return _google_error(400, "INVALID_ARGUMENT", "delegates are not supported here")
        lifetime = re.fullmatch(r"(\d+)s", str(body.get("lifetime", "3600s")))
        if lifetime is None or not 0 < int(lifetime.group(1)) <= 3600:
            return _google_error(400, "INVALID_ARGUMENT", f"lifetime {body.get('lifetime')!r}")
        scope_str = " ".join(scopes)
        expires_in = self.token_lifetime_s.get(scope_str, int(lifetime.group(1)))
        token = IssuedToken(f"ya29.c.fake-{len(self.tokens)}-{secrets.token_urlsafe(8)}", email, scope_str,
                            expires_in, via="generateAccessToken", caller=principal)
        self.tokens[token.token] = token
        expire = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=expires_in)
        return web.json_response({"accessToken": token.token, "expireTime": expire.strftime("%Y-%m-%dT%H:%M:%SZ")})

    def _check_admin_token(self, authorization: str | None) -> web.Response | None:
        token = self.tokens.get((authorization or "").removeprefix("Bearer "))
        if token is None or not (authorization or "").startswith("Bearer "):
            return _google_error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials.")
        if ADMIN_SCOPE not in token.scope.split():
            return _google_error(403, "PERMISSION_DENIED", "Request had insufficient authentication scopes.")
        return None

    def _connect_settings(self) -> dict[str, Any]:
        ca_pem = _pem(self.ca_cert)
        return {
            "kind": "sql#connectSettings",
            "serverCaCert": {
                "kind": "sql#sslCert",
                "certSerialNumber": str(self.ca_cert.serial_number),
                "cert": ca_pem,
                "commonName": self.ca_cert.subject.rfc4514_string(),
                "sha1Fingerprint": self.ca_cert.fingerprint(hashes.SHA1()).hex(),
                "instance": self.instance,
            },
            "ipAddresses": [
                {"type": "PRIMARY", "ipAddress": self.public_ip},
                {"type": "PRIVATE", "ipAddress": self.private_ip},
            ],
            "region": self.region,
            "databaseVersion": self.database_version,
            "backendType": "SECOND_GEN",
            "pscEnabled": False,
            "serverCaMode": "GOOGLE_MANAGED_INTERNAL_CA",
        }

    def _ephemeral_cert(self, body: dict[str, Any]) -> web.Response:
        try:
            public_key = serialization.load_pem_public_key(body["public_key"].encode())
        except (KeyError, ValueError, AttributeError) as e:
            return _google_error(400, "INVALID_ARGUMENT", f"bad public_key: {e!r}")
        access_token = body.get("access_token")
        if access_token is not None:
            # IAM database authentication: the login token, down-scoped to sqlservice.login, rides in the request.
            token = self.tokens.get(access_token)
            if token is None or LOGIN_SCOPE not in token.scope.split():
                return _google_error(400, "INVALID_ARGUMENT", "access_token is not a sqlservice.login token")
        cert = self._sign(f"{self.project}:{self.instance}:ephemeral", public_key,
                          dt.timedelta(seconds=self.cert_lifetime_s), server=False)
        self.certs.append(IssuedCert(cert, body["public_key"], access_token))
        return web.json_response({"ephemeralCert": {
            "kind": "sql#sslCert",
            "certSerialNumber": str(cert.serial_number),
            "cert": _pem(cert),
            "commonName": cert.subject.rfc4514_string(),
            "sha1Fingerprint": cert.fingerprint(hashes.SHA1()).hex(),
            "instance": self.instance,
            "expirationTime": cert.not_valid_after_utc.isoformat().replace("+00:00", "Z"),
        }})

    # -- the instance's port 3307 ------------------------------------------------------------------------------

    async def _public(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.public_ip_connections += 1
        writer.close()

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sslobj = writer.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
        cert = x509.load_der_x509_certificate(der) if der else None
        issued = next((c for c in self.certs if cert is not None and c.cert == cert), None)
        tunnel = Tunnel(writer.get_extra_info("sockname")[0], cert, issued, sslobj.version() if sslobj else None)
        self.tunnels.append(tunnel)
        self._tunnel_writers.add(writer)
        try:
            pg_reader, pg_writer = await asyncio.open_unix_connection(self.pg_unix_socket)
        except OSError as e:
            self.errors.append(f"tunnel: cannot reach PostgreSQL at {self.pg_unix_socket}: {e!r}")
            writer.close()
            self._tunnel_writers.discard(writer)
            return
        await asyncio.gather(_pump(reader, pg_writer, tunnel.client_bytes), _pump(pg_reader, writer, None))
        self._tunnel_writers.discard(writer)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, capture: bytearray | None) -> None:
    """Copy src to dst until either side ends; then close dst (which ends the pump going the other way)."""
    try:
        while data := await src.read(65536):
            if capture is not None and len(capture) < 4096:
                capture += data[: 4096 - len(capture)]
            dst.write(data)
            await dst.drain()
    except OSError:  # ConnectionError, ssl.SSLError: the other side went away
        pass
    finally:
        dst.close()


def _oauth_error(error: str, description: str) -> web.Response:
    return web.json_response({"error": error, "error_description": description}, status=400)


def _google_error(code: int, status: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "status": status, "message": message}}, status=code)
