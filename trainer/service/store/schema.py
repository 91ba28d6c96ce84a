"""The store's schema: the tables, their column types, the request lifecycle's states, the schema version and its
migrations.

Everything the service accepts is a row of one of these tables (see the package's docstring). A schema change bumps
SCHEMA_VERSION and teaches `migrate` to bring the previous version up to date: the API and the engine may run
different releases against one database for a while, and an older one refuses a newer schema.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Final, Literal, cast

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
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    insert,
    select,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainer.service.store.errors import StoreError
from trainer.service.store.ids import SEGMENT_FOR_KIND

# Bump with every schema change, and teach migrate() to migrate from the previous version.
SCHEMA_VERSION: Final = 2
_SCHEMA_LOCK: Final = 0x6B7470757273  # PostgreSQL advisory lock key for create_schema: any constant, same everywhere

# Request lifecycle.
QUEUED: Final = "queued"
RUNNING: Final = "running"
DONE: Final = "done"
FAILED: Final = "failed"
FINISHED: Final = frozenset({DONE, FAILED})
ErrorCategory = Literal["user", "server"]


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
        # kind holds a CheckpointKind (the column is a plain string).
        return f"{SEGMENT_FOR_KIND[self.kind]}/{self.name}"  # type: ignore[index]


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


def create_schema(conn: Connection, *, postgres: bool, owner_role: str | None) -> None:
    """Create the tables if missing; refuse a database written by a newer schema; migrate an older one. In one
    transaction (`conn`) that the caller began as a writer: safe to race, the API and the engine processes may start
    at the same moment (PostgreSQL: an advisory lock; sqlite: the write lock). owner_role: the role that owns the
    tables on Cloud SQL (`connection.CLOUDSQL_OWNER_ROLE`), or None."""
    if postgres:
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK})
    if owner_role is not None:
        conn.execute(text(f'SET LOCAL ROLE "{owner_role}"'))
    Base.metadata.create_all(conn)
    found = conn.scalar(select(Meta.value).where(Meta.key == "schema_version"))
    if found is None:
        conn.execute(insert(Meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
    elif int(found) > SCHEMA_VERSION:
        raise StoreError(f"database schema version {found} is newer than this code's ({SCHEMA_VERSION})")
    elif int(found) < SCHEMA_VERSION:
        migrate(conn, int(found))


def migrate(conn: Connection, found: int) -> None:
    """Bring an older schema up to date (create_all above already added the new tables)."""
    if found < 2:  # 2: workers.base_model; the model_states table is new
        conn.execute(text("ALTER TABLE workers ADD COLUMN base_model VARCHAR(500)"))
    meta = cast(Table, Meta.__table__)  # a declarative class's table (typed as any FromClause)
    conn.execute(meta.update().where(Meta.key == "schema_version").values(value=str(SCHEMA_VERSION)))
