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

The package, by concern (each module over the one before it; `Store` is the last class of the chain, and every name
callers use is re-exported here, so `from trainer.service.store import Store, ...` is the one door):
- `ids`: model, sampler, checkpoint and request ids and tinker:// paths (no database);
- `errors`: the typed errors the API maps to HTTP statuses;
- `schema`: the tables, the request lifecycle's states, the schema version and its migrations;
- `connection`: the database URL, the Cloud SQL connector, `retry_database`, and `Database` (pool, transactions);
- `sessions`: API keys, sessions, models, server secrets;
- `queue`: requests from submit to done, ordering, claims, recovery, the workers;
- `checkpoints`: checkpoints (with their TTLs) and the sampling sessions on them.
"""


from __future__ import annotations

from trainer.service.store.checkpoints import MAX_TTL_S, Checkpoints
from trainer.service.store.connection import (
    CLOUDSQL_ADMIN_ENDPOINT_ENV,
    CLOUDSQL_CREDENTIALS_ENV,
    CLOUDSQL_DATABASE_ENV,
    CLOUDSQL_INSTANCE_ENV,
    CLOUDSQL_IP_TYPE_ENV,
    CLOUDSQL_OWNER_ROLE,
    CLOUDSQL_USER_ENV,
    DATA_DIR_ENV,
    DB_ENV,
    DB_RETRY_FIRST_S,
    DB_RETRY_MAX_S,
    CloudSqlSettings,
    Database,
    Page,
    cloudsql_settings,
    default_data_dir,
    default_db_url,
    is_database_unavailable,
    normalize_url,
    retry_database,
)
from trainer.service.store.errors import (
    Conflict,
    DatabaseUnavailable,
    NotFound,
    SessionFinished,
    StaleClaim,
    StoreError,
)
from trainer.service.store.ids import (
    CheckpointKind,
    body_hash,
    model_id_for,
    parse_tinker_path,
    rest_tinker_path,
    sampling_session_id_for,
    tinker_path,
)
from trainer.service.store.queue import (
    CRASHED_ENGINE,
    ENGINE_GONE_AFTER_S,
    ENGINE_HEARTBEAT_S,
    MAX_RUNS,
    RERUNNABLE_KINDS,
    SERVER_RESTARTED,
    Recovery,
    StateUpdate,
)
from trainer.service.store.schema import (
    DONE,
    FAILED,
    FINISHED,
    QUEUED,
    RUNNING,
    SCHEMA_VERSION,
    ApiKey,
    Base,
    Checkpoint,
    ClientSession,
    ErrorCategory,
    Meta,
    Model,
    ModelState,
    Request,
    SamplingSession,
    UTCDateTime,
    Worker,
    utcnow,
)


class Store(Checkpoints):
    """The database behind the service. Thread-safe; any number of processes may open the same database.

    Returned rows are detached snapshots (read them freely, change state only through these methods). The methods
    live with their concern (see the package docstring); this class only closes the chain.
    """


__all__ = [
    "CLOUDSQL_ADMIN_ENDPOINT_ENV", "CLOUDSQL_CREDENTIALS_ENV", "CLOUDSQL_DATABASE_ENV", "CLOUDSQL_INSTANCE_ENV",
    "CLOUDSQL_IP_TYPE_ENV", "CLOUDSQL_OWNER_ROLE", "CLOUDSQL_USER_ENV", "CRASHED_ENGINE", "DATA_DIR_ENV", "DB_ENV",
    "DB_RETRY_FIRST_S", "DB_RETRY_MAX_S", "DONE", "ENGINE_GONE_AFTER_S", "ENGINE_HEARTBEAT_S", "FAILED", "FINISHED",
    "MAX_RUNS", "MAX_TTL_S", "QUEUED", "RERUNNABLE_KINDS", "RUNNING", "SCHEMA_VERSION", "SERVER_RESTARTED",
    "ApiKey", "Base", "Checkpoint", "CheckpointKind", "ClientSession", "CloudSqlSettings", "Conflict", "Database",
    "DatabaseUnavailable", "ErrorCategory", "Meta", "Model", "ModelState", "NotFound", "Page", "Recovery", "Request",
    "SamplingSession", "SessionFinished", "StaleClaim", "StateUpdate", "Store", "StoreError", "UTCDateTime", "Worker",
    "body_hash", "cloudsql_settings", "default_data_dir", "default_db_url", "is_database_unavailable",
    "model_id_for", "normalize_url", "parse_tinker_path", "rest_tinker_path", "retry_database",
    "sampling_session_id_for", "tinker_path", "utcnow",
]
