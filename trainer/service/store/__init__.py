"""The service's durable state: API keys, sessions, models, requests (futures), checkpoints, sampling sessions.

Everything the service accepts is a row here before the client hears back, so a killed server loses nothing: a
new process on the same database finds every session, model, checkpoint and request, and `Store.recover()` settles
the requests the dead process had claimed. SQLAlchemy 2.0 over a sqlite file (the default), PostgreSQL (by URL,
driver psycopg 3), or Cloud SQL for PostgreSQL through the Cloud SQL Python Connector (`cloudsql_settings`: private
IP, IAM database authentication as the pod's Google service account, no password).

Durable model state: `ModelState` says where each model's training state can be rebuilt from (a snapshot the engine
wrote after the request `seq_id`, or the model's initial adapter), and it changes in the same transaction that
completes that request, so a model's state and its completed requests never disagree: after a crash the engine
rebuilds the state and replays the forward_backward requests completed since (their gradients were in memory).

Ownership: every user-facing lookup and listing takes the caller's owner id (the API key id, see `auth`) and a row
of another owner is treated exactly like a missing one (`NotFound`, same message), so ids leak nothing across keys.
The engine-side calls (`claim`, `complete`, `fail`, `recover`) are trusted and not owner-scoped.

Ordering: a model's requests carry the client's `seq_id` and run strictly in that order: request N is claimable only
once every seq_id below N of that model is done or failed (`Model.next_seq_id` is that frontier). The request that
creates a model is its seq_id 0 (the SDK numbers a TrainingClient's own requests from 1). Requests without a model
or without a seq_id run in arrival order.

Availability: `retry_database` retries a call while the database is unavailable (`is_database_unavailable`: a refused
connection, a server restarting, a login refused, the Cloud SQL connector's API calls failing) for a bounded time;
the engine's start-up uses it (trainer/service/cli.py), its loop retries on its own.

Transactions: on PostgreSQL claiming uses SELECT ... FOR UPDATE SKIP LOCKED, so concurrent engines never take the
same row and do not block each other; on sqlite every writing transaction starts with BEGIN IMMEDIATE (one writer
at a time across processes, WAL so readers are not blocked), which makes read-then-update claims atomic.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, Literal, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    case,
    create_engine,
    event,
    func,
    insert,
    or_,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.sql import Select

log = logging.getLogger(__name__)

DB_ENV: Final = "GKE_TPU_RL_SERVICE_DB"
# Bump with every schema change, and teach create_schema() to migrate from the previous version.
SCHEMA_VERSION: Final = 2
_SCHEMA_LOCK: Final = 0x6B7470757273  # PostgreSQL advisory lock key for create_schema: any constant, same everywhere
DATA_DIR_ENV: Final = "GKE_TPU_RL_SERVICE_HOME"
# Cloud SQL through the connector (what the stack's pods set): the instance connection name PROJECT:REGION:INSTANCE,
# the IAM database user (the Google service account's email without ".gserviceaccount.com") and the database.
CLOUDSQL_INSTANCE_ENV: Final = "GKE_TPU_RL_CLOUDSQL_INSTANCE"
CLOUDSQL_USER_ENV: Final = "GKE_TPU_RL_CLOUDSQL_USER"
CLOUDSQL_DATABASE_ENV: Final = "GKE_TPU_RL_CLOUDSQL_DATABASE"
# Another SQL Admin API endpoint and IP type (tests run the connector against a local stand-in of the API).
CLOUDSQL_ADMIN_ENDPOINT_ENV: Final = "GKE_TPU_RL_CLOUDSQL_ADMIN_ENDPOINT"
CLOUDSQL_IP_TYPE_ENV: Final = "GKE_TPU_RL_CLOUDSQL_IP_TYPE"
# A google-auth credential configuration (JSON) the connector authenticates with instead of Application Default
# Credentials: what a pod on the host network needs, where the GKE metadata server cannot tell the pod from its node
# and would hand out the node's identity (the stack's engine pods on a multi-host slice without DRANET).
CLOUDSQL_CREDENTIALS_ENV: Final = "GKE_TPU_RL_CLOUDSQL_CREDENTIALS"
# The role that owns the tables on Cloud SQL: the API's and the engine's IAM users are both members of it (the stack
# grants it, infra/database.py), and a table belongs to whoever creates it, so each creates as this role, or the other
# would be refused the tables it did not create.
CLOUDSQL_OWNER_ROLE: Final = "cloudsqlsuperuser"
# An engine whose heartbeat is older than this is taken for gone (it beats every ENGINE_HEARTBEAT_S from a thread of
# its own, so a long compile or device op does not silence it).
ENGINE_HEARTBEAT_S: Final = 2.0
ENGINE_GONE_AFTER_S: Final = 10.0
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

# Request lifecycle.
QUEUED: Final = "queued"
RUNNING: Final = "running"
DONE: Final = "done"
FAILED: Final = "failed"
FINISHED: Final = frozenset({DONE, FAILED})
ErrorCategory = Literal["user", "server"]
# training: LoRA + optimizer (save_state); sampler: a PEFT adapter to sample from; external: a PEFT adapter to download
# (save_weights_external, fetched through signed URLs: api.py, downloads.py).
CheckpointKind = Literal["training", "sampler", "external"]

# What `recover()` puts back in the queue when their process died mid-flight: they change no state (a forward pass
# reads the weights, a sample draws from them), so running them again gives the client what it asked for. Anything
# else (forward_backward accumulates gradients, optim_step updates weights and Adam moments, saves/loads write files
# and rows) may already have taken effect, and nothing in the database can tell, so it fails instead.
RERUNNABLE_KINDS: Final = frozenset({"forward", "sample", "compute_logprobs"})
SERVER_RESTARTED: Final = (
    "the server restarted while this request was running, so it did not finish; it was not run again because it "
    "may already have changed the model (a forward_backward or optim_step must not be applied twice). Check the "
    "model's state (or restore a checkpoint) and resubmit it."
)
# A rerunnable request that was running when the engine died this many times is failed instead of queued again: it is
# likely what killed it (memory, a crash in the device code), and running it forever would keep every other request
# of the engine from being served.
MAX_RUNS: Final = 3
CRASHED_ENGINE: Final = (
    "the server stopped while running this request {n} times, so it is not run again (it may be what stops the "
    "server); check its size and inputs and resubmit it."
)

# Checkpoint names become file names on the engine's side: keep them to one safe path component.
_CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_TINKER_SCHEME: Final = "tinker://"
_KIND_SEGMENT: Final[dict[str, CheckpointKind]] = {
    "weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_SEGMENT_FOR_KIND: Final[dict[CheckpointKind, str]] = {v: k for k, v in _KIND_SEGMENT.items()}


class StoreError(Exception):
    """Base of the store's typed errors; the API maps each to an HTTP status."""


class NotFound(StoreError, LookupError):
    """No such row for this owner (another owner's row reads the same as a missing one)."""


class Conflict(StoreError):
    """A resubmission with a different body, or a name that is already taken."""


class SessionFinished(StoreError):
    """The session was finished (the SDK expects HTTP 410 for its heartbeat)."""


class StaleClaim(StoreError):
    """The engine reported on a request it no longer holds (finished already, or recovered after a restart)."""


class DatabaseUnavailable(StoreError):
    """`retry_database` gave up: the database stayed unreachable for its whole window (the cause is chained)."""


# The SDK documents checkpoint TTLs from 1 hour to 10 years; far beyond, a datetime overflows.
MAX_TTL_S: Final = 10 * 366 * 86400


def _expiry(now: dt.datetime, ttl_seconds: float | None) -> dt.datetime | None:
    if ttl_seconds is None:
        return None
    if ttl_seconds > MAX_TTL_S:
        raise ValueError(f"ttl_seconds must be at most {MAX_TTL_S} (10 years), or none (no expiry); got {ttl_seconds}")
    return now + dt.timedelta(seconds=ttl_seconds)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Aware UTC datetimes on both backends (sqlite keeps no zone: store naive UTC, hand back aware)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: the store takes aware UTC datetimes only")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    type_annotation_map = {
        dt.datetime: UTCDateTime,
        dict[str, Any]: JSON,
        list[str]: JSON,
        bytes: LargeBinary,
    }


class ApiKey(Base):
    """An API key: only the hash of the secret is stored; the id is the owner id of everything the key creates."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class ClientSession(Base):
    """A ServiceClient's session (create_session / session_heartbeat / sessions/{id}/finish)."""

    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    tags: Mapped[list[str]] = mapped_column(default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    sdk_version: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    finish_reason: Mapped[str | None] = mapped_column(String(32), default=None)
    finish_detail: Mapped[str | None] = mapped_column(Text, default=None)


class Model(Base):
    """A trainable model (a LoRA adapter on a base model): the SDK's training run."""

    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("session_id", "model_seq_id"),)
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    model_seq_id: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(500))
    lora_config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_request_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # Every seq_id below this one is done or failed; the request with exactly this seq_id is the next to run.
    next_seq_id: Mapped[int] = mapped_column(Integer, default=0)


class Request(Base):
    """An accepted request (a future): the body as received, then the engine's result or error."""

    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("model_id", "seq_id"),
        UniqueConstraint("owner_id", "dedup_key"),
        Index("ix_requests_status_id", "status", "id"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # arrival order
    request_id: Mapped[str] = mapped_column(String(64), unique=True)  # what the client sees (random, not a count)
    owner_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id"), default=None)
    seq_id: Mapped[int | None] = mapped_column(Integer, default=None)
    sampling_session_id: Mapped[str | None] = mapped_column(ForeignKey("sampling_sessions.id"), default=None)
    # Idempotency key of requests that have no (model_id, seq_id), e.g. "sample:<sampling session>:<seq_id>".
    dedup_key: Mapped[str | None] = mapped_column(String(300), default=None)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    body_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=QUEUED)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    error_message: Mapped[str | None] = mapped_column(Text, default=None)
    error_category: Mapped[str | None] = mapped_column(String(16), default=None)
    worker_id: Mapped[str | None] = mapped_column(String(200), default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)

    @property
    def ordered(self) -> bool:
        return self.model_id is not None and self.seq_id is not None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


class Checkpoint(Base):
    """A saved state (kind training: LoRA + optimizer), sampler weights or external weights, addressed by its
    tinker:// path."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("model_id", "kind", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"))
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(16))
    tinker_path: Mapped[str] = mapped_column(String(500), unique=True)
    storage_path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(default=None)

    @property
    def checkpoint_id(self) -> str:
        """The REST form: "weights/<name>", "sampler_weights/<name>" or "external_weights/<name>"."""
        return f"{_SEGMENT_FOR_KIND[self.kind]}/{self.name}"  # type: ignore[index]


class SamplingSession(Base):
    """A sampler: a base model, or a model's sampler weights by tinker:// path."""

    __tablename__ = "sampling_sessions"
    __table_args__ = (UniqueConstraint("session_id", "sampling_session_seq_id"),)
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    sampling_session_seq_id: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(500))
    model_path: Mapped[str | None] = mapped_column(String(500), default=None)
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id"), default=None)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Meta(Base):
    """Facts about the database itself: its schema_version; and server secrets (`Store.secret`)."""

    __tablename__ = "store_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Worker(Base):
    """An engine process; its heartbeat tells `recover(stale_after_s=...)` whose claims are orphaned, and the API
    whether any engine serves a base model (else its futures answer try_again with queue_state paused_capacity)."""

    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str | None] = mapped_column(String(500), default=None)  # schema 2
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ModelState(Base):
    """Where a model's training state can be rebuilt from (schema 2): the state right after its request `seq_id`
    completed, as a snapshot directory (LoRA weights, Adam moments, step) or, with storage_path None, the model's
    initial adapter (re-made from its lora_config and seed)."""

    __tablename__ = "model_states"
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), primary_key=True)
    seq_id: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer, default=0)
    storage_path: Mapped[str | None] = mapped_column(Text, default=None)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


@dataclass(frozen=True)
class StateUpdate:
    """The model state a request leaves behind, committed with its completion."""

    model_id: str
    seq_id: int
    step: int
    storage_path: str | None


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing, with the total count the SDK's cursor reports."""

    items: list[T]
    total: int
    offset: int
    limit: int


@dataclass(frozen=True)
class Recovery:
    """What `recover()` did: request ids put back in the queue and failed with SERVER_RESTARTED."""

    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def _sqlstate(err: BaseException) -> str | None:
    """The SQLSTATE of a DBAPI error: psycopg's `sqlstate`; pg8000 passes the server's fields as a dict (C: code)."""
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


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id the SDK itself derives for create_training_client_from_state (service_client.py)."""
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def tinker_path(model_id: str, kind: CheckpointKind, name: str) -> str:
    return f"{_TINKER_SCHEME}{model_id}/{_SEGMENT_FOR_KIND[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, CheckpointKind, str]:
    """tinker://<model_id>/weights|sampler_weights|external_weights/<name> -> (model_id, kind, name); ValueError
    otherwise."""
    if not path.startswith(_TINKER_SCHEME):
        raise ValueError(f"not a tinker:// path: {path!r}")
    parts = path[len(_TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not parts[0] or parts[1] not in _KIND_SEGMENT or not _CHECKPOINT_NAME.fullmatch(parts[2]):
        raise ValueError(f"not a checkpoint path (tinker://<model_id>/{'|'.join(_KIND_SEGMENT)}/<name>): {path!r}")
    return parts[0], _KIND_SEGMENT[parts[1]], parts[2]


def rest_tinker_path(model_id: str, checkpoint_id: str) -> str:
    """The tinker:// path of a REST route's checkpoint (/training_runs/<model_id>/checkpoints/<checkpoint_id>/...);
    ValueError if it is none."""
    path = f"{_TINKER_SCHEME}{model_id}/{checkpoint_id}"
    parse_tinker_path(path)
    return path


def body_hash(kind: str, body: bytes) -> str:
    # The kind is hashed too, so the same bytes under another operation count as a different request.
    return hashlib.sha256(kind.encode() + b"\0" + body).hexdigest()


def _new_id() -> str:
    return uuid.uuid4().hex


class Store:
    """The database behind the service. Thread-safe; any number of processes may open the same database.

    Returned rows are detached snapshots (read them freely, change state only through these methods).
    """

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

    def clone(self, *, create: bool = False) -> Store:
        """Another Store on the same database, with its own pool (and on Cloud SQL its own connector). A Cloud SQL
        store's `url` names only the dialect and user (the connection comes from the connector), so rebuilding a
        Store from it would dial localhost:5432 instead."""
        if self.cloudsql is not None:
            return Store(cloudsql=self.cloudsql, poll_interval_s=self.poll_interval_s, create=create)
        return Store(self.url.render_as_string(hide_password=False), poll_interval_s=self.poll_interval_s,
                     create=create)

    # -- plumbing -----------------------------------------------------------------------------------------------

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
        """Create the tables if missing; refuse a database written by a newer schema. Safe to race: the API and
        the engine processes may start at the same moment (PostgreSQL: an advisory lock; sqlite: the write lock)."""
        engine = self.engine.execution_options(store_write=True)
        with engine.begin() as conn:
            if not self.is_sqlite:
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK})
            if self.cloudsql is not None:
                conn.execute(text(f'SET LOCAL ROLE "{self.cloudsql.owner_role}"'))
            Base.metadata.create_all(conn)
            found = conn.scalar(select(Meta.value).where(Meta.key == "schema_version"))
            if found is None:
                conn.execute(insert(Meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
            elif int(found) > SCHEMA_VERSION:
                raise StoreError(f"database schema version {found} is newer than this code's ({SCHEMA_VERSION})")
            elif int(found) < SCHEMA_VERSION:
                self._migrate(conn, int(found))

    @staticmethod
    def _migrate(conn: Connection, found: int) -> None:
        """Bring an older schema up to date (create_all above already added the new tables)."""
        if found < 2:  # 2: workers.base_model; the model_states table is new
            conn.execute(text("ALTER TABLE workers ADD COLUMN base_model VARCHAR(500)"))
        conn.execute(Meta.__table__.update().where(Meta.key == "schema_version").values(value=str(SCHEMA_VERSION)))

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

    def secret(self, name: str) -> bytes:
        """A random 256-bit server secret kept in the database (made on first use), so every API replica and every
        restart shares it: e.g. the key that signs download URLs (downloads.py)."""
        key = f"secret:{name}"
        with self._read() as s:
            found = s.scalar(select(Meta.value).where(Meta.key == key))
        if found is None:
            # IntegrityError: another process made it first (PostgreSQL): read theirs.
            with suppress(IntegrityError), self._write() as s:
                if s.get(Meta, key) is None:
                    s.add(Meta(key=key, value=os.urandom(32).hex()))
            with self._read() as s:
                found = s.scalar(select(Meta.value).where(Meta.key == key))
        assert found is not None
        return bytes.fromhex(found)

    # -- API keys (the rows; generation, hashing and verification live in auth.py) -----------------------------

    def add_api_key(self, key_id: str, name: str, key_hash: str) -> ApiKey:
        with self._write() as s:
            row = ApiKey(id=key_id, name=name, key_hash=key_hash)
            s.add(row)
        return row

    def get_api_key(self, key_id: str) -> ApiKey | None:
        with self._read() as s:
            return s.get(ApiKey, key_id)

    def list_api_keys(self) -> list[ApiKey]:
        with self._read() as s:
            return list(s.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))

    def revoke_api_key(self, key_id: str) -> ApiKey:
        """Idempotent: revoking a revoked key keeps its first revocation time."""
        with self._write() as s:
            row = s.get(ApiKey, key_id)
            if row is None:
                raise NotFound(f"no API key {key_id!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
        return row

    # -- sessions ----------------------------------------------------------------------------------------------

    def create_session(
        self,
        owner_id: str,
        *,
        tags: Sequence[str] = (),
        user_metadata: dict[str, Any] | None = None,
        sdk_version: str | None = None,
    ) -> ClientSession:
        with self._write() as s:
            row = ClientSession(
                id=str(uuid.uuid4()), owner_id=owner_id, tags=list(tags), user_metadata=dict(user_metadata or {}),
                sdk_version=sdk_version,
            )
            s.add(row)
        return row

    def _owned(self, s: Session, cls: type[T], owner_id: str, row_id: Any, what: str, *, lock: bool = False) -> T:
        q = select(cls).where(cls.id == row_id, cls.owner_id == owner_id)  # type: ignore[attr-defined]
        row: T | None = s.scalars(self._lock(q) if lock else q).first()
        if row is None:
            raise NotFound(f"no {what} {row_id!r}")
        return row

    def get_session(self, owner_id: str, session_id: str) -> ClientSession:
        with self._read() as s:
            return self._owned(s, ClientSession, owner_id, session_id, "session")

    def heartbeat(self, owner_id: str, session_id: str) -> ClientSession:
        with self._write() as s:
            row = self._owned(s, ClientSession, owner_id, session_id, "session", lock=True)
            if row.finished_at is not None:
                raise SessionFinished(f"session {session_id!r} is finished")
            row.heartbeat_at = utcnow()
        return row

    def finish_session(self, owner_id: str, session_id: str, reason: str, detail: str | None = None) -> ClientSession:
        """Idempotent: the first finish wins."""
        with self._write() as s:
            row = self._owned(s, ClientSession, owner_id, session_id, "session", lock=True)
            if row.finished_at is None:
                row.finished_at, row.finish_reason, row.finish_detail = utcnow(), reason, detail
        return row

    def list_sessions(self, owner_id: str, *, limit: int = 100, offset: int = 0) -> Page[ClientSession]:
        with self._read() as s:
            q = select(ClientSession).where(ClientSession.owner_id == owner_id)
            return self._page(s, q, (ClientSession.created_at, ClientSession.id), limit, offset)

    # -- models ------------------------------------------------------------------------------------------------

    def create_model(
        self,
        owner_id: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        *,
        user_metadata: dict[str, Any] | None = None,
        first_seq_id: int = 0,
    ) -> Model:
        """Idempotent per (session, model_seq_id): a resubmission returns the model created the first time.

        `first_seq_id` is the seq_id of the model's first request: 0 when the API queues the creation itself as
        the model's request 0 (so the client's requests 1, 2, ... wait for it), 1 when it builds the model inline.
        """
        model_id = model_id_for(session_id, model_seq_id)
        for attempt in range(2):
            try:
                with self._write() as s:
                    self._owned(s, ClientSession, owner_id, session_id, "session")
                    if (row := s.get(Model, model_id)) is not None:
                        return row
                    row = Model(
                        id=model_id, owner_id=owner_id, session_id=session_id, model_seq_id=model_seq_id,
                        base_model=base_model, lora_config=dict(lora_config or {}),
                        user_metadata=dict(user_metadata or {}), next_seq_id=first_seq_id,
                    )
                    s.add(row)
                return row
            except IntegrityError:  # a concurrent identical create won the insert (PostgreSQL): read it back
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get_model(self, owner_id: str, model_id: str) -> Model:
        with self._read() as s:
            return self._owned(s, Model, owner_id, model_id, "model")

    def list_models(
        self, owner_id: str, *, session_id: str | None = None, limit: int = 100, offset: int = 0
    ) -> Page[Model]:
        with self._read() as s:
            q = select(Model).where(Model.owner_id == owner_id)
            if session_id is not None:
                q = q.where(Model.session_id == session_id)
            return self._page(s, q, (Model.created_at, Model.id), limit, offset)

    # -- requests (futures) ------------------------------------------------------------------------------------

    def submit(
        self,
        owner_id: str,
        kind: str,
        body: bytes,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        sampling_session_id: str | None = None,
        dedup_key: str | None = None,
    ) -> Request:
        """Accept a request (committed before this returns). Idempotent: the same (model_id, seq_id), or the same
        dedup_key, with the same kind and body gives back the first submission's row; a different body -> Conflict.

        A seq_id needs a model_id (the pair orders it). Hash the canonical body (decompressed) so a client's
        retry with other transport encoding still matches.
        """
        if seq_id is not None and model_id is None and dedup_key is None:
            raise ValueError("a seq_id without a model_id needs a dedup_key (e.g. sample:<sampling session>:<seq>)")
        if seq_id is not None and seq_id < 0:
            raise ValueError("seq_id must be >= 0")
        digest = body_hash(kind, body)
        for attempt in range(2):
            try:
                with self._write() as s:
                    model = self._owned(s, Model, owner_id, model_id, "model") if model_id is not None else None
                    if sampling_session_id is not None:
                        self._owned(s, SamplingSession, owner_id, sampling_session_id, "sampling session")
                    existing = self._find_duplicate(s, owner_id, model_id, seq_id, dedup_key)
                    if existing is not None:
                        if existing.body_hash != digest:
                            raise Conflict(
                                f"request {self._describe(model_id, seq_id, dedup_key)} was already submitted with a "
                                f"different body (request_id {existing.request_id})"
                            )
                        return existing
                    if model is not None:
                        model.last_request_at = utcnow()
                    row = Request(
                        request_id=_new_id(), owner_id=owner_id, kind=kind, model_id=model_id, seq_id=seq_id,
                        sampling_session_id=sampling_session_id, dedup_key=dedup_key, body=body, body_hash=digest,
                    )
                    s.add(row)
                return row
            except IntegrityError:  # a concurrent twin was inserted first (PostgreSQL): the retry finds it
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def refuse(self, owner_id: str, kind: str, model_id: str | None, seq_id: int | None, message: str) -> bool:
        """Record a request the API refused at submit (a 4xx) as failed, in its place in the model's order.

        The SDK numbers a training client's requests before sending them and runs them in that order; a number the
        API refused would otherwise never reach the database, and every later request of the client would wait
        behind the gap for good. Only for the caller's own model and a number nothing holds yet (a request already
        there answers for that number). True when a row was written.
        """
        if model_id is None or seq_id is None or seq_id < 1:
            return False
        try:
            with self._write() as s:
                self._owned(s, Model, owner_id, model_id, "model")
                if self._find_duplicate(s, owner_id, model_id, seq_id, None) is not None:
                    return False
                now = utcnow()
                row = Request(
                    request_id=_new_id(), owner_id=owner_id, kind=kind, model_id=model_id, seq_id=seq_id, body=b"",
                    body_hash=body_hash(kind, b""), status=FAILED, finished_at=now, error_message=message,
                    error_category="user",
                )
                s.add(row)
                self._advance(s, row)
        except (NotFound, IntegrityError):  # not the caller's model, or a concurrent submit took the number
            return False
        self._notify()
        return True

    @staticmethod
    def _describe(model_id: str | None, seq_id: int | None, dedup_key: str | None) -> str:
        return f"seq_id {seq_id} of model {model_id!r}" if model_id is not None and seq_id is not None else repr(
            dedup_key
        )

    @staticmethod
    def _find_duplicate(
        s: Session, owner_id: str, model_id: str | None, seq_id: int | None, dedup_key: str | None
    ) -> Request | None:
        if model_id is not None and seq_id is not None:
            return s.scalars(select(Request).where(Request.model_id == model_id, Request.seq_id == seq_id)).first()
        if dedup_key is not None:
            return s.scalars(
                select(Request).where(Request.owner_id == owner_id, Request.dedup_key == dedup_key)
            ).first()
        return None

    def get_request(self, owner_id: str, request_id: str) -> Request:
        with self._read() as s:
            row = s.scalars(
                select(Request).where(Request.request_id == request_id, Request.owner_id == owner_id)
            ).first()
            if row is None:
                raise NotFound(f"no request {request_id!r}")
            return row

    def requests_with_session(self, owner_id: str, kind: str, request_ids: Collection[str]
                              ) -> dict[str, tuple[Request, str]]:
        """This owner's requests of `kind` among `request_ids`, each with the session of its sampling session, in one
        read (what a stable_reinforce request's provenance names; ids not found are left out)."""
        if not request_ids:
            return {}
        with self._read() as s:
            rows = s.execute(
                select(Request, SamplingSession.session_id)
                .join(SamplingSession, Request.sampling_session_id == SamplingSession.id)
                .where(Request.owner_id == owner_id, Request.kind == kind, Request.request_id.in_(list(request_ids)))
            ).all()
            return {row.request_id: (row, session_id) for row, session_id in rows}

    def wait(self, owner_id: str, request_id: str, timeout_s: float) -> Request:
        """The request once done or failed, or as it stands after timeout_s (queued/running): for long-polling."""
        deadline = time.monotonic() + timeout_s
        while True:
            # Poll the status alone: the body (up to a few MB of forward_backward data) is read once, at the end.
            with self._read() as s:
                status = s.scalar(
                    select(Request.status).where(Request.request_id == request_id, Request.owner_id == owner_id)
                )
            if status is None:
                raise NotFound(f"no request {request_id!r}")
            left = deadline - time.monotonic()
            if status in FINISHED or left <= 0:
                return self.get_request(owner_id, request_id)
            with self._finished:
                self._finished.wait(min(self.poll_interval_s, left))

    def _notify(self) -> None:
        with self._finished:
            self._finished.notify_all()

    # -- the engine's side -------------------------------------------------------------------------------------

    def register_worker(self, name: str | None = None, *, base_model: str | None = None) -> str:
        worker_id = name or f"{socket.gethostname()}:{os.getpid()}:{_new_id()[:8]}"
        with self._write() as s:
            s.merge(Worker(id=worker_id, host=socket.gethostname(), pid=os.getpid(), base_model=base_model,
                           heartbeat_at=utcnow()))
        return worker_id

    def retire_worker(self, worker_id: str) -> None:
        """An engine that stops on purpose says so: the API reports no engine at once, not 30 s later."""
        with self._write() as s:
            if (row := s.get(Worker, worker_id)) is not None:
                s.delete(row)

    def unfinished(self, owner_id: str, kind: str) -> int:
        """The owner's requests of `kind` queued or running (samples: each finishes or fails, so the count drains;
        an ordered request can wait behind a gap for good). Reads through the (status, id) index: few rows are
        queued or running at once."""
        with self._read() as s:
            return int(s.scalar(select(func.count()).select_from(Request).where(
                Request.status.in_([QUEUED, RUNNING]), Request.kind == kind, Request.owner_id == owner_id)) or 0)

    def engine_up(self, base_model: str | None, *, within_s: float = ENGINE_GONE_AFTER_S) -> bool:
        """Whether an engine serving `base_model` (any engine, with None) has beaten its heart within `within_s`."""
        cutoff = utcnow() - dt.timedelta(seconds=within_s)
        with self._read() as s:
            q = select(func.count()).select_from(Worker).where(Worker.heartbeat_at >= cutoff)
            if base_model is not None:
                q = q.where(or_(Worker.base_model.is_(None), Worker.base_model == base_model))
            return bool(s.scalar(q))

    def request_base_model(self, request: Request) -> str | None:
        """The base model a request runs on (its model's or its sampler's), None for model-less work."""
        with self._read() as s:
            if request.model_id is not None:
                return s.scalar(select(Model.base_model).where(Model.id == request.model_id))
            if request.sampling_session_id is not None:
                return s.scalar(select(SamplingSession.base_model).where(
                    SamplingSession.id == request.sampling_session_id))
        return None

    def worker_heartbeat(self, worker_id: str) -> None:
        with self._write() as s:
            if (row := s.get(Worker, worker_id)) is None:
                raise NotFound(f"no worker {worker_id!r}")
            row.heartbeat_at = utcnow()

    def claim(
        self,
        worker_id: str,
        *,
        kinds: Collection[str] | None = None,
        max_batch: int = 1,
        base_model: str | None = None,
        owner_order: Sequence[str] = (),
        batch_unordered: bool = True,
    ) -> list[Request]:
        """Mark the next runnable request running for this worker and return it ([] when nothing is runnable).

        With base_model, only requests on that base model (their model's or their sampler's) and those on none: an
        engine serves one base model, and an API may list several, each with its own engine.

        Runnable: queued, and either unordered (no model or no seq_id) or its model's next seq_id. Oldest first;
        with owner_order (owners served lately, the least recent first) the fair share: owners not in it first, then
        the one served longest ago, so one owner's backlog never keeps another's request waiting behind all of it.
        With max_batch > 1 the batch grows with further requests of the same kind that are runnable once the first
        one is (the model's following seq_ids without a gap, or, unless batch_unordered is False, further unordered
        requests), e.g. the consecutive forward_backward chunks before an optim_step; report each with
        complete()/fail().
        """
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        with self._write() as s:
            q = (
                select(Request)
                .outerjoin(Model, Request.model_id == Model.id)
                .where(
                    Request.status == QUEUED,
                    or_(Request.model_id.is_(None), Request.seq_id.is_(None), Request.seq_id == Model.next_seq_id),
                )
                .order_by(*self._owner_rank(owner_order), Request.id)
                .limit(1)
            )
            if kinds is not None:
                q = q.where(Request.kind.in_(list(kinds)))
            if base_model is not None:
                q = self._on_base_model(q, base_model)
            if not self.is_sqlite:
                q = q.with_for_update(of=Request, skip_locked=True)
            first = s.scalars(q).first()
            if first is None:
                return []
            batch = [first]
            if max_batch > 1 and (batch_unordered or first.ordered):
                batch += self._batch_after(s, first, max_batch - 1, base_model)
            now = utcnow()
            for row in batch:
                row.status, row.worker_id, row.started_at, row.attempts = RUNNING, worker_id, now, row.attempts + 1
            if (worker := s.get(Worker, worker_id)) is not None:
                worker.heartbeat_at = now
        return batch

    @staticmethod
    def _owner_rank(owner_order: Sequence[str]) -> list[Any]:
        """ORDER BY terms putting owners not in owner_order first, then owner_order's own order."""
        if not owner_order:
            return []
        return [case({owner: i for i, owner in enumerate(owner_order)}, value=Request.owner_id, else_=-1)]

    @staticmethod
    def _on_base_model(q: Select[Any], base_model: str) -> Select[Any]:
        """Requests of q (joined with Model) on `base_model`, or on no base model at all (e.g. a file deletion)."""
        sampler_base = select(SamplingSession.base_model).where(
            SamplingSession.id == Request.sampling_session_id).scalar_subquery()
        return q.where(or_(
            Model.base_model == base_model,
            Request.model_id.is_(None) & Request.sampling_session_id.is_(None),
            Request.model_id.is_(None) & (sampler_base == base_model),
        ))

    def _batch_after(self, s: Session, first: Request, more: int, base_model: str | None = None) -> list[Request]:
        base = select(Request).where(Request.status == QUEUED, Request.kind == first.kind)
        if first.ordered:
            q = base.where(
                Request.model_id == first.model_id,
                Request.seq_id > first.seq_id,
                Request.seq_id <= first.seq_id + more,  # type: ignore[operator]
            ).order_by(Request.seq_id)
            taken: list[Request] = []
            expected = first.seq_id + 1  # type: ignore[operator]
            for row in s.scalars(self._lock(q, skip_locked=True)):
                if row.seq_id != expected:  # a gap (not yet submitted, or another kind): the batch stops there
                    break
                taken.append(row)
                expected += 1
            return taken
        q = base.where(or_(Request.model_id.is_(None), Request.seq_id.is_(None)), Request.id > first.id)
        q = q.order_by(Request.id).limit(more)
        if base_model is not None:
            q = self._on_base_model(q.outerjoin(Model, Request.model_id == Model.id), base_model)
            # PostgreSQL locks no row of the nullable side of an outer join: lock the requests only.
            return list(s.scalars(q if self.is_sqlite else q.with_for_update(of=Request, skip_locked=True)))
        return list(s.scalars(self._lock(q, skip_locked=True)))

    def complete(self, request_id: str, result: bytes, *, worker_id: str, state: StateUpdate | None = None) -> Request:
        """Done, with its result; `state` (the model's state after it) is committed in the same transaction."""
        return self._finish(request_id, DONE, worker_id=worker_id, result=result, state=state)

    def requeue(self, request_id: str, *, worker_id: str) -> Request:
        """Put a request this worker is running back in the queue, in its place in its model's order."""
        with self._write() as s:
            row: Request | None = s.scalars(self._lock(select(Request).where(Request.request_id == request_id))).first()
            if row is None:
                raise NotFound(f"no request {request_id!r}")
            if row.status != RUNNING or row.worker_id != worker_id:
                raise StaleClaim(f"request {request_id} is {row.status} (worker {row.worker_id}), not running for "
                                 f"{worker_id}")
            row.status, row.worker_id, row.started_at = QUEUED, None, None
        return row

    def model(self, model_id: str) -> Model:
        """A model by id alone, for the engine (trusted, not owner-scoped, like the other engine-side calls)."""
        with self._read() as s:
            if (row := s.get(Model, model_id)) is None:
                raise NotFound(f"no model {model_id!r}")
            return row

    def model_state(self, model_id: str) -> ModelState | None:
        with self._read() as s:
            return s.get(ModelState, model_id)

    def replay_log(self, model_id: str, after_seq_id: int, kinds: Collection[str]) -> list[Request]:
        """The model's completed requests of these kinds after `after_seq_id`, in seq_id order: what the engine
        runs again on top of a restored state (forward_backward: the gradients accumulated since)."""
        with self._read() as s:
            q = select(Request).where(Request.model_id == model_id, Request.seq_id > after_seq_id,
                                      Request.status == DONE, Request.kind.in_(list(kinds))).order_by(Request.seq_id)
            return list(s.scalars(q))

    def live_models(self, *, quiet_s: float) -> list[Model]:
        """Models with a saved state whose session is open and has beaten within quiet_s (what an engine restores
        when it starts), most recently used first."""
        cutoff = utcnow() - dt.timedelta(seconds=quiet_s)
        with self._read() as s:
            q = (select(Model).join(ClientSession, Model.session_id == ClientSession.id)
                 .join(ModelState, ModelState.model_id == Model.id)
                 .where(ClientSession.finished_at.is_(None), ClientSession.heartbeat_at >= cutoff)
                 .order_by(Model.last_request_at.desc()))
            return list(s.scalars(q))

    def fail(
        self, request_id: str, message: str, *, category: ErrorCategory = "server", worker_id: str | None = None
    ) -> Request:
        """Fail a running request (or a queued one, with worker_id None: e.g. an engine giving up on a model)."""
        if category not in ("user", "server"):
            raise ValueError(f"category must be 'user' or 'server', not {category!r}")
        return self._finish(request_id, FAILED, worker_id=worker_id, message=message, category=category)

    def _finish(self, request_id: str, status: str, **how: Any) -> Request:
        """_finish_in in a transaction of its own, then wake this process's waiters."""
        with self._write() as s:
            row = self._finish_in(s, request_id, status, **how)
        self._notify()
        return row

    def _finish_in(
        self,
        s: Session,
        request_id: str,
        status: str,
        *,
        worker_id: str | None,
        result: bytes | None = None,
        message: str | None = None,
        category: str | None = None,
        state: StateUpdate | None = None,
    ) -> Request:
        row: Request | None = s.scalars(self._lock(select(Request).where(Request.request_id == request_id))).first()
        if row is None:
            raise NotFound(f"no request {request_id!r}")
        allowed = {RUNNING} if worker_id is not None or status == DONE else {RUNNING, QUEUED}
        if row.status not in allowed or (worker_id is not None and row.worker_id != worker_id):
            raise StaleClaim(
                f"request {request_id} is {row.status} (worker {row.worker_id}), not running for {worker_id}"
            )
        row.status, row.finished_at = status, utcnow()
        row.result, row.error_message, row.error_category = result, message, category
        self._advance(s, row)
        if state is not None:
            s.merge(ModelState(model_id=state.model_id, seq_id=state.seq_id, step=state.step,
                               storage_path=state.storage_path, updated_at=utcnow()))
        return row

    def _advance(self, s: Session, row: Request) -> None:
        """Move the model's next_seq_id past every finished seq_id (a batch may finish out of order)."""
        if not row.ordered:
            return
        model = s.scalars(self._lock(select(Model).where(Model.id == row.model_id))).one()
        s.flush()
        while True:
            status = s.scalar(
                select(Request.status).where(Request.model_id == model.id, Request.seq_id == model.next_seq_id)
            )
            if status not in FINISHED:
                return
            model.next_seq_id += 1

    def fail_queued(self, model_id: str, message: str, *, category: ErrorCategory = "server") -> list[str]:
        """Fail every queued request of a model (e.g. its in-memory state is gone and cannot be restored)."""
        with self._write() as s:
            q = select(Request).where(Request.model_id == model_id, Request.status == QUEUED).order_by(Request.id)
            rows = list(s.scalars(self._lock(q)))
            now = utcnow()
            for row in rows:
                row.status, row.finished_at, row.error_message, row.error_category = FAILED, now, message, category
            for row in rows:
                self._advance(s, row)
        self._notify()
        return [r.request_id for r in rows]

    def recover(
        self, *, stale_after_s: float | None = None, rerunnable_kinds: Collection[str] = RERUNNABLE_KINDS
    ) -> Recovery:
        """Settle the requests that a dead engine left running. Call it at start-up.

        Decision: a request of a kind in `rerunnable_kinds` (pure reads: forward, sample) is queued again, in its
        place in its model's order, unless it has been claimed MAX_RUNS times (then it fails with CRASHED_ENGINE);
        every other one fails with SERVER_RESTARTED (category server). The database
        cannot tell whether a killed forward_backward/optim_step/save had already taken effect (weights updated in
        memory, a file written) and running it again could apply it twice, so the client is told instead and
        decides. Queued requests stay queued: nothing has run them.

        stale_after_s None: every running request is orphaned (the single-server start-up, no other engine alive).
        Otherwise only those claimed by workers with no heartbeat for that long (several engines on one database).
        """
        with self._write() as s:
            q = select(Request).where(Request.status == RUNNING).order_by(Request.id)
            if stale_after_s is not None:
                cutoff = utcnow() - dt.timedelta(seconds=stale_after_s)
                live = select(Worker.id).where(Worker.heartbeat_at >= cutoff)
                q = q.where(or_(Request.worker_id.is_(None), Request.worker_id.not_in(live)))
            rows = list(s.scalars(self._lock(q)))
            report = Recovery()
            now = utcnow()
            for row in rows:
                if row.kind in rerunnable_kinds and row.attempts >= MAX_RUNS:
                    row.status, row.finished_at = FAILED, now
                    row.error_message, row.error_category = CRASHED_ENGINE.format(n=row.attempts), "server"
                    report.failed.append(row.request_id)
                elif row.kind in rerunnable_kinds:
                    row.status, row.worker_id, row.started_at = QUEUED, None, None
                    report.requeued.append(row.request_id)
                else:
                    row.status, row.finished_at = FAILED, now
                    row.error_message, row.error_category = SERVER_RESTARTED, "server"
                    report.failed.append(row.request_id)
            for row in rows:
                if row.status == FAILED:
                    self._advance(s, row)
        self._notify()
        return report

    def pending_count(self) -> int:
        with self._read() as s:
            return s.scalar(select(func.count()).where(Request.status.in_([QUEUED, RUNNING]))) or 0

    # -- checkpoints -------------------------------------------------------------------------------------------

    def add_checkpoint(
        self,
        owner_id: str,
        model_id: str,
        name: str,
        kind: CheckpointKind,
        storage_path: str,
        *,
        size_bytes: int | None = None,
        ttl_seconds: float | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, Any] | None = None,
        sampler_seq_id: int | None = None,
        completes: tuple[str, str, bytes] | None = None,
    ) -> Checkpoint:
        """Record a checkpoint the engine has written. A live one of the same name -> Conflict unless overwrite.

        In the same transaction: with sampler_seq_id, the model's session gets that sampling session on the new
        checkpoint (save_weights_for_sampler without a path); with completes (request_id, worker_id, result), the
        request that saved it is done. So a save killed half-way leaves no row, and its re-run does not conflict
        with itself."""
        if kind not in _SEGMENT_FOR_KIND:
            raise ValueError(f"checkpoint kind must be one of {sorted(_SEGMENT_FOR_KIND)}, not {kind!r}")
        if not _CHECKPOINT_NAME.fullmatch(name):
            raise ValueError(f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (at most 200)")
        now = utcnow()
        expires = _expiry(now, ttl_seconds)
        path = tinker_path(model_id, kind, name)
        with self._write() as s:
            self._owned(s, Model, owner_id, model_id, "model")
            row = s.scalars(self._lock(select(Checkpoint).where(Checkpoint.tinker_path == path))).first()
            if row is not None and not overwrite and (row.expires_at is None or row.expires_at > now):
                raise Conflict(f"checkpoint {path} already exists")
            if row is None:
                row = Checkpoint(owner_id=owner_id, model_id=model_id, name=name, kind=kind, tinker_path=path)
                s.add(row)
            row.storage_path, row.size_bytes, row.created_at, row.expires_at = storage_path, size_bytes, now, expires
            row.user_metadata = dict(user_metadata or {})
            if sampler_seq_id is not None:
                model = s.get(Model, model_id)
                assert model is not None
                sampler_id = sampling_session_id_for(model.session_id, sampler_seq_id)
                if s.get(SamplingSession, sampler_id) is None:
                    s.add(SamplingSession(
                        id=sampler_id, owner_id=owner_id, session_id=model.session_id,
                        sampling_session_seq_id=sampler_seq_id, base_model=model.base_model, model_path=path,
                        model_id=model_id))
            if completes is not None:
                request_id, worker_id, result = completes
                self._finish_in(s, request_id, DONE, worker_id=worker_id, result=result)
        if completes is not None:
            self._notify()
        return row

    @staticmethod
    def _live(now: dt.datetime) -> Any:
        return or_(Checkpoint.expires_at.is_(None), Checkpoint.expires_at > now)

    def get_checkpoint(self, owner_id: str, path: str) -> Checkpoint:
        """By tinker:// path; expired ones and other owners' read as missing."""
        try:
            parse_tinker_path(path)
        except ValueError as e:
            raise NotFound(f"no checkpoint {path!r}") from e
        with self._read() as s:
            row = s.scalars(
                select(Checkpoint).where(
                    Checkpoint.tinker_path == path, Checkpoint.owner_id == owner_id, self._live(utcnow())
                )
            ).first()
            if row is None:
                raise NotFound(f"no checkpoint {path!r}")
            return row

    def list_checkpoints(
        self, owner_id: str, model_id: str | None = None, *, limit: int = 100, offset: int = 0
    ) -> Page[Checkpoint]:
        """A model's checkpoints (NotFound for another owner's model), or all of the owner's with model_id None."""
        with self._read() as s:
            q = select(Checkpoint).where(Checkpoint.owner_id == owner_id, self._live(utcnow()))
            if model_id is not None:
                self._owned(s, Model, owner_id, model_id, "model")
                q = q.where(Checkpoint.model_id == model_id)
            # Newest first, as the SDK documents its listings (rest_client.py list_user_checkpoints).
            return self._page(s, q, (Checkpoint.created_at.desc(), Checkpoint.id.desc()), limit, offset)

    def delete_checkpoint(self, owner_id: str, path: str) -> Checkpoint:
        """Remove the row and return it, so the caller deletes its files (storage_path)."""
        with self._write() as s:
            row: Checkpoint | None = s.scalars(
                self._lock(select(Checkpoint).where(Checkpoint.tinker_path == path, Checkpoint.owner_id == owner_id))
            ).first()
            if row is None:
                raise NotFound(f"no checkpoint {path!r}")
            s.delete(row)
        return row

    def set_checkpoint_ttl(self, owner_id: str, path: str, ttl_seconds: float | None) -> Checkpoint:
        """Expire a live checkpoint ttl_seconds from now, or never with None."""
        with self._write() as s:
            now = utcnow()
            row: Checkpoint | None = s.scalars(self._lock(select(Checkpoint).where(
                Checkpoint.tinker_path == path, Checkpoint.owner_id == owner_id, self._live(now)))).first()
            if row is None:
                raise NotFound(f"no checkpoint {path!r}")
            row.expires_at = _expiry(now, ttl_seconds)
        return row

    def expired_checkpoints(self, now: dt.datetime | None = None) -> list[Checkpoint]:
        """For the engine's clean-up: every owner's checkpoints whose TTL has passed."""
        with self._read() as s:
            q = select(Checkpoint).where(Checkpoint.expires_at <= (now or utcnow())).order_by(Checkpoint.id)
            return list(s.scalars(q))

    # -- sampling sessions -------------------------------------------------------------------------------------

    def create_sampling_session(
        self,
        owner_id: str,
        session_id: str,
        sampling_session_seq_id: int,
        *,
        base_model: str,
        model_path: str | None = None,
    ) -> SamplingSession:
        """Idempotent per (session, sampling_session_seq_id). A model_path must be a live checkpoint of the owner."""
        sampler_id = sampling_session_id_for(session_id, sampling_session_seq_id)
        model_id = self.get_checkpoint(owner_id, model_path).model_id if model_path is not None else None
        for attempt in range(2):
            try:
                with self._write() as s:
                    self._owned(s, ClientSession, owner_id, session_id, "session")
                    if (row := s.get(SamplingSession, sampler_id)) is not None:
                        return row
                    row = SamplingSession(
                        id=sampler_id, owner_id=owner_id, session_id=session_id,
                        sampling_session_seq_id=sampling_session_seq_id, base_model=base_model,
                        model_path=model_path, model_id=model_id,
                    )
                    s.add(row)
                return row
            except IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get_sampling_session(self, owner_id: str, sampling_session_id: str) -> SamplingSession:
        with self._read() as s:
            return self._owned(s, SamplingSession, owner_id, sampling_session_id, "sampling session")

    def list_sampling_sessions(
        self, owner_id: str, *, session_id: str | None = None, limit: int = 100, offset: int = 0
    ) -> Page[SamplingSession]:
        with self._read() as s:
            q = select(SamplingSession).where(SamplingSession.owner_id == owner_id)
            if session_id is not None:
                q = q.where(SamplingSession.session_id == session_id)
            return self._page(s, q, (SamplingSession.created_at, SamplingSession.id), limit, offset)
