"""The store's connection: which database (a URL, a sqlite file, or Cloud SQL through its Python Connector), the
pool and its transactions, and riding out a database that is not there yet (`retry_database`).

`Database` is the floor every part of the `Store` stands on: it opens the engine, creates the schema, and gives the
parts their transactions (`_read`, `_write`), row locks (`_lock`), pages (`_page`) and owner-scoped lookups
(`_owned`). It knows no table but through `schema`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, Self, TypeVar

from sqlalchemy import create_engine, event, func, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import Select

from envspec.pod import CLOUDSQL_CREDENTIALS_ENV, CLOUDSQL_DATABASE_ENV, CLOUDSQL_INSTANCE_ENV, CLOUDSQL_USER_ENV
from trainer.service.store import schema
from trainer.service.store.errors import DatabaseUnavailable, NotFound, StoreError

log = logging.getLogger(__name__)

DB_ENV: Final = "GKE_TPU_RL_SERVICE_DB"
DATA_DIR_ENV: Final = "GKE_TPU_RL_SERVICE_HOME"
# Cloud SQL through the connector: what the stack's pods set (CLOUDSQL_INSTANCE_ENV, _USER_ENV, _DATABASE_ENV and
# _CREDENTIALS_ENV) are the pod contract's names (envspec/pod.py, imported above). Another SQL Admin API endpoint and
# IP type are this module's own (tests run the connector against a local stand-in of the API).
CLOUDSQL_ADMIN_ENDPOINT_ENV: Final = "GKE_TPU_RL_CLOUDSQL_ADMIN_ENDPOINT"
CLOUDSQL_IP_TYPE_ENV: Final = "GKE_TPU_RL_CLOUDSQL_IP_TYPE"
# The role that owns the tables on Cloud SQL: the API's and the engine's IAM users are both members of it (the stack
# grants it, infra/components/database.py), and a table belongs to whoever creates it, so each creates as this role,
# or the other would be refused the tables it did not create.
CLOUDSQL_OWNER_ROLE: Final = "cloudsqlsuperuser"
# retry_database's backoff: the first wait, doubling up to the cap (jittered: restarted pods do not retry in step).
DB_RETRY_FIRST_S: Final = 1.0
DB_RETRY_MAX_S: Final = 30.0
# SQLSTATE classes that say the server or the way to it is not available yet, not that the statement is wrong:
# 08 connection exception, 28 invalid authorization (an IAM database user or its grant not propagated yet), 53
# insufficient resources (too many connections), 57 operator intervention (57P01-03: shutting down, starting up:
# Cloud SQL's maintenance restart), 58 system error (I/O on the server).
_UNAVAILABLE_SQLSTATE_CLASSES: Final = ("08", "28", "53", "57", "58")
# The Cloud SQL Python Connector's own errors of that kind (by name: the connector is imported only for Cloud SQL).
_UNAVAILABLE_CONNECTOR_ERRORS: Final = frozenset({
    "CloudSQLConnectionError", "ResourceExhaustedError", "RefreshNotValidError", "DnsResolutionError",
    "DnsLoopError", "CacheClosedError"})

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing, with the total count the SDK's cursor reports."""

    items: list[T]
    total: int
    offset: int
    limit: int



def _sqlstate(err: BaseException | None) -> str | None:
    """The SQLSTATE of a DBAPI error: psycopg's `sqlstate`; pg8000 passes the server's fields as a dict (C: code)."""
    if err is None:  # a DBAPIError without the driver's exception
        return None
    if (code := getattr(err, "sqlstate", None)) is not None:
        return str(code)
    if err.args and isinstance(err.args[0], dict):
        return err.args[0].get("C")
    return None


def is_database_unavailable(err: BaseException) -> bool:
    """Whether `err` says the database, or the way to it, is not available for now (what a retry can outlast): a
    refused or dropped connection, a server starting up or shutting down, a login refused, a timeout; and on Cloud SQL
    the connector's calls (SQL Admin API, OAuth/STS/IAM tokens) failing. A statement the server rejects for what it
    says (a bug) is not."""
    if isinstance(err, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
                        sa_exc.DisconnectionError)):
        return True
    if isinstance(err, sa_exc.DBAPIError):
        if err.connection_invalidated:
            return True
        code = _sqlstate(err.orig)
        return code is not None and code[:2] in _UNAVAILABLE_SQLSTATE_CLASSES
    if isinstance(err, OSError):  # ConnectionError, TimeoutError, ssl.SSLError, socket errors
        return True
    if type(err).__name__ in _UNAVAILABLE_CONNECTOR_ERRORS:
        return True
    module = type(err).__module__
    # google-auth's RefreshError/TransportError (a token refused or unreachable: IAM not propagated yet) and
    # aiohttp's ClientError (the SQL Admin API's answers, 403 while a role binding propagates, 5xx).
    return module.startswith("google.auth") or module.startswith("aiohttp")


def retry_database(call: Callable[[], T], what: str, *, within_s: float) -> T:
    """`call()`, again with backoff while it fails with `is_database_unavailable` errors, for up to `within_s`
    seconds from the first try (0: once); then DatabaseUnavailable naming `what`, the last error chained. Other
    errors propagate at once."""
    start = time.monotonic()
    delay = DB_RETRY_FIRST_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except Exception as err:
            if not is_database_unavailable(err):
                raise
            left = within_s - (time.monotonic() - start)
            if left <= 0:
                raise DatabaseUnavailable(
                    f"the database stayed unavailable for {within_s:g} s ({attempt} tries) to {what}: "
                    f"{' '.join(str(err).split())[:500]}") from err
            wait = min(left, delay * random.uniform(0.5, 1.0))
            log.warning("the database is unavailable to %s (try %d, again in %.1f s, for %.0f s more): %s",
                        what, attempt, wait, left, " ".join(str(err).split())[:300])
            time.sleep(wait)
            delay = min(delay * 2, DB_RETRY_MAX_S)


def default_db_url() -> str:
    """$GKE_TPU_RL_SERVICE_DB, else a sqlite file service.db in $GKE_TPU_RL_SERVICE_HOME, else in
    $XDG_DATA_HOME/gke-tpu-rl/service (~/.local/share/gke-tpu-rl/service)."""
    if url := os.environ.get(DB_ENV):
        return url
    return f"sqlite:///{default_data_dir() / 'service.db'}"


@dataclass(frozen=True)
class CloudSqlSettings:
    instance: str  # PROJECT:REGION:INSTANCE
    user: str  # the IAM database user
    database: str
    ip_type: str = "PRIVATE"
    admin_endpoint: str | None = None
    owner_role: str = CLOUDSQL_OWNER_ROLE
    credentials: str | None = None  # a google-auth credential configuration (JSON); None: ADC


def cloudsql_settings() -> CloudSqlSettings | None:
    """The Cloud SQL connection the environment names (the stack's pods), or None."""
    instance = os.environ.get(CLOUDSQL_INSTANCE_ENV)
    if not instance:
        return None
    missing = [k for k in (CLOUDSQL_USER_ENV, CLOUDSQL_DATABASE_ENV) if not os.environ.get(k)]
    if missing:
        raise StoreError(f"{CLOUDSQL_INSTANCE_ENV} is set but {', '.join(missing)} is not")
    if instance.count(":") != 2:
        raise StoreError(f"{CLOUDSQL_INSTANCE_ENV}={instance!r} is not an instance connection name "
                         "PROJECT:REGION:INSTANCE")
    return CloudSqlSettings(instance, os.environ[CLOUDSQL_USER_ENV], os.environ[CLOUDSQL_DATABASE_ENV],
                            os.environ.get(CLOUDSQL_IP_TYPE_ENV, "PRIVATE"),
                            os.environ.get(CLOUDSQL_ADMIN_ENDPOINT_ENV) or None,
                            credentials=os.environ.get(CLOUDSQL_CREDENTIALS_ENV) or None)


def default_data_dir() -> Path:
    if home := os.environ.get(DATA_DIR_ENV):
        return Path(home)
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "gke-tpu-rl" / "service"


def normalize_url(url: str) -> URL:
    """A URL or a plain file path (-> sqlite); postgres URLs without a driver get psycopg 3."""
    if "://" not in url:
        return make_url(f"sqlite:///{Path(url).expanduser().resolve()}")
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


class Database:
    """The connection to the service's database (see the module docstring); `Store` adds the tables' operations.
    Thread-safe; any number of processes may open the same database."""

    def __init__(self, url: str | None = None, *, poll_interval_s: float = 0.05, create: bool = True,
                 cloudsql: CloudSqlSettings | None = None) -> None:
        """url: a database URL; else Cloud SQL (`cloudsql`, or what the environment names: `cloudsql_settings`);
        else $GKE_TPU_RL_SERVICE_DB or the default sqlite file."""
        if url is None and cloudsql is None:
            cloudsql = cloudsql_settings()
        self.cloudsql = cloudsql if url is None else None
        self._connector: Any = None
        self._connector_lock = threading.Lock()  # the pool may open its first connections from several threads
        if self.cloudsql is not None:
            self.url = URL.create("postgresql+pg8000", username=self.cloudsql.user, database=self.cloudsql.database)
        else:
            self.url = normalize_url(url or default_db_url())
        self.poll_interval_s = poll_interval_s
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self.engine: Engine = self._make_engine(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # Same pool; the option tells the sqlite begin hook to take the write lock up front.
        self._write_sessions = sessionmaker(
            self.engine.execution_options(store_write=True), expire_on_commit=False
        )
        # Wakes waiters of this process as soon as a request finishes here; other processes' results are polled.
        self._finished = threading.Condition()
        if create:
            try:
                self.create_schema()
            except BaseException:
                self.close()  # no pooled connection (nor the connector's thread) outlives a Store that failed to open
                raise

    def clone(self, *, create: bool = False) -> Self:
        """Another Store on the same database, with its own pool (and on Cloud SQL its own connector). A Cloud SQL
        store's `url` names only the dialect and user (the connection comes from the connector), so rebuilding a
        Store from it would dial localhost:5432 instead."""
        if self.cloudsql is not None:
            return type(self)(cloudsql=self.cloudsql, poll_interval_s=self.poll_interval_s, create=create)
        return type(self)(self.url.render_as_string(hide_password=False), poll_interval_s=self.poll_interval_s,
                     create=create)

    def _make_engine(self, url: URL) -> Engine:
        if self.cloudsql is not None:
            return create_engine(url, creator=self._cloudsql_connect, pool_pre_ping=True)
        if url.get_backend_name() != "sqlite":
            return create_engine(url, pool_pre_ping=True)
        if not url.database or url.database == ":memory:":
            # Every pooled connection would get its own empty database, and nothing would survive a restart.
            raise ValueError("the store needs a sqlite file, not an in-memory database")
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn: Any, _record: Any) -> None:
            # SQLAlchemy's documented recipe: pysqlite must not open transactions itself, the begin hook does.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA busy_timeout = 30000")
            cur.execute("PRAGMA journal_mode = WAL")  # readers don't block the writer and vice versa
            cur.execute("PRAGMA synchronous = FULL")  # a committed row survives power loss, not only a kill
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            # IMMEDIATE takes the write lock at BEGIN, so a read-then-update (claim, idempotent submit) cannot be
            # interleaved with another process's; a DEFERRED one would fail with SQLITE_BUSY on upgrade instead.
            immediate = conn.get_execution_options().get("store_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    def _cloudsql_connect(self) -> Any:
        """A pg8000 connection through the Cloud SQL Python Connector: as the pod's Google identity (Application
        Default Credentials: workload identity on GKE) it fetches the instance's private address and CA and an
        ephemeral client certificate from the SQL Admin API; with enable_iam_auth that request carries an OAuth token
        of the IAM user, which the certificate stands for (no password is sent), and the TLS connection to the
        instance (port 3307) authenticates with it (tests/service/test_cloudsql.py runs it against a stand-in)."""
        from google.cloud.sql.connector import Connector

        cs = self.cloudsql
        assert cs is not None
        with self._connector_lock:
            if self._connector is None:
                credentials = None
                if cs.credentials is not None:
                    import google.auth

                    credentials, _ = google.auth.load_credentials_from_dict(json.loads(cs.credentials))
                # lazy: refresh the certificate when a connection needs it, not from a background task (the
                # connector's advice where CPU may be throttled between requests).
                self._connector = Connector(ip_type=cs.ip_type, enable_iam_auth=True, refresh_strategy="lazy",
                                            sqladmin_api_endpoint=cs.admin_endpoint, credentials=credentials)
        return self._connector.connect(cs.instance, "pg8000", user=cs.user, db=cs.database)

    def create_schema(self) -> None:
        """Create the tables if missing; refuse a database written by a newer schema (`schema.create_schema`). Safe
        to race: the API and the engine processes may start at the same moment."""
        owner_role = self.cloudsql.owner_role if self.cloudsql is not None else None
        with self.engine.execution_options(store_write=True).begin() as conn:
            schema.create_schema(conn, postgres=not self.is_sqlite, owner_role=owner_role)

    def close(self) -> None:
        self.engine.dispose()
        if self._connector is not None:
            self._connector.close()
            self._connector = None

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._sessions() as s, s.begin():
            yield s

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._write_sessions() as s, s.begin():
            yield s

    def _lock(self, q: Select[Any], *, skip_locked: bool = False) -> Select[Any]:
        # Row locks only mean something on PostgreSQL; sqlite's IMMEDIATE transaction already holds the db lock.
        return q if self.is_sqlite else q.with_for_update(skip_locked=skip_locked)

    @staticmethod
    def _page(s: Session, q: Select[Any], order: Sequence[Any], limit: int, offset: int) -> Page[Any]:
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must be >= 0")
        total = s.scalar(select(func.count()).select_from(q.subquery())) or 0
        items = list(s.scalars(q.order_by(*order).limit(limit).offset(offset)))
        return Page(items=items, total=total, offset=offset, limit=limit)

    def _owned(self, s: Session, cls: type[T], owner_id: str, row_id: Any, what: str, *, lock: bool = False) -> T:
        # cls is one of the owned row classes, each with id and owner_id columns (T itself declares none).
        q = select(cls).where(cls.id == row_id, cls.owner_id == owner_id)  # type: ignore[attr-defined]
        row: T | None = s.scalars(self._lock(q) if lock else q).first()
        if row is None:
            raise NotFound(f"no {what} {row_id!r}")
        return row
