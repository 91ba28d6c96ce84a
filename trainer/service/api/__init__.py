"""The Tinker-compatible HTTP API: what tinker 0.38's ServiceClient, TrainingClient, SamplingClient and RestClient call.

Bodies and answers are the SDK's own pydantic types and protobuf messages (`tinker.types`, `tinker.proto`); the state
is the store's. The request path stays thin: an operation that needs the model (create_model, forward_backward,
optim_step, saves, loads, samples) is stored as a request row (`Store.submit`, idempotent per model seq_id) and
answered at once with a promise; an engine process claims and runs it (`protocol` is the contract) and the SDK
long-polls `retrieve_future` for the result. The rest (sessions, get_info, listings) is answered from the store.

Every route but /api/v1/healthz and the external weights download (`downloads.ROUTE`: its signed URL is the credential)
takes the caller's key (X-API-Key, `auth.authenticate`) and passes its owner id to every store call, so another key's
ids read as missing (404, the same message). Errors: 401 no/invalid/revoked key,
404 unknown id, 400 a request this server refuses, 409 a resubmitted seq_id with a different body, 410 a finished
session. A request that fails in the engine is not an HTTP error: retrieve_future answers {"error", "category"}, which
the SDK raises as tinker.RequestFailedError (tinker 0.38 tinker/lib/api_future_impl.py:496-503). SDK line numbers
below are tinker 0.38.0's.

The package: `create_app` composes one APIRouter per concern (`health`, `sessions`, `models`, `training`, `samplers`,
`futures`, `checkpoints`), each built from a `common.Context` (the store and the config), over what they share:
`config` (ServerConfig and the limits), `common` (the caller's owner, the answer shapes, the refusal bookkeeping),
`errors` (the exception handlers) and `limits` (the body size middleware).
"""

from __future__ import annotations

from typing import Final

from fastapi import FastAPI

from trainer.service import downloads
from trainer.service.api import (
    checkpoints,
    errors,
    futures,
    health,
    models,
    samplers,
    sessions,
    training,
)
from trainer.service.api.common import ORDERED_ROUTES, Context, Owner
from trainer.service.api.config import (
    DEFAULT_LONG_POLL_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_JSON_BYTES,
    DEFAULT_MAX_UNFINISHED,
    LIST_LIMIT_MAX,
    PAUSED_POLL_S,
    SDK_RETRIEVE_TIMEOUT_S,
    BaseModelSpec,
    ServerConfig,
    paused_reason,
)
from trainer.service.api.limits import PROTOBUF_ROUTES, BodyLimit
from trainer.service.store import Store

# In the order the routes were registered in when they were one function (no two of them match one path anyway).
ROUTERS: Final = (health, sessions, models, training, samplers, futures, checkpoints)


def create_app(store: Store, config: ServerConfig) -> FastAPI:
    """The API over `store`, serving `config.base_models`. No docs routes: every route but healthz needs a key."""
    app = FastAPI(title="gke-tpu-rl Tinker-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    downloads.redact_access_log()
    app.add_middleware(BodyLimit, config=config)
    app.state.store = store
    errors.install(app, store)
    ctx = Context(store, config)
    for room in ROUTERS:
        app.include_router(room.make_router(ctx))
    return app


__all__ = [
    "DEFAULT_LONG_POLL_S", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_JSON_BYTES", "DEFAULT_MAX_UNFINISHED",
    "LIST_LIMIT_MAX", "ORDERED_ROUTES", "PAUSED_POLL_S", "PROTOBUF_ROUTES", "SDK_RETRIEVE_TIMEOUT_S", "BaseModelSpec",
    "Context", "Owner", "ServerConfig", "create_app", "paused_reason",
]
