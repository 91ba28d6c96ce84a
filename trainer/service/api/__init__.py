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
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import io
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final

import pydantic
import zstandard
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi import Request as HttpRequest
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from google.protobuf.message import DecodeError
from sqlalchemy import select
from sqlalchemy.orm import Session as DbSession
from starlette.concurrency import run_in_threadpool
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.try_again_response import TryAgainResponse

from trainer.service import auth, downloads, protocol, sampling
from trainer.service.protocol import PROTOBUF
from trainer.service.store import (
    FAILED,
    FINISHED,
    Checkpoint,
    CheckpointKind,
    Conflict,
    Model,
    NotFound,
    Request,
    SessionFinished,
    Store,
    StoreError,
    parse_tinker_path,
    rest_tinker_path,
    tinker_path,
)

log = logging.getLogger(__name__)

# The SDK polls retrieve_future with a 45 s HTTP timeout (tinker/lib/api_future_impl.py:467): a long-poll must
# answer try_again before that.
SDK_RETRIEVE_TIMEOUT_S: Final = 45.0
DEFAULT_LONG_POLL_S: Final = 40.0
# Decompressed forward_backward body cap. The SDK splits data into chunks of at most fwdbwd_max_chunk_bytes_count
# (5 MB by default, which /client/config keeps) before protobuf encoding, so this leaves ample headroom.
DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Every other route takes JSON: a sample's prompt of 128k tokens is under 1 MiB; user_metadata and names are small.
DEFAULT_MAX_JSON_BYTES: Final = 4 * 1024 * 1024
PROTOBUF_ROUTES: Final = frozenset({"/api/v1/forward_backward"})
# A key with this many samples queued or running gets a 429 for its next one (tinker 0.38's SamplingClient retries a
# 429 with its own back-off, without limit, so it waits rather than fails); training requests are never refused for it
# (the SDK has numbered them: a refusal would leave a gap).
DEFAULT_MAX_UNFINISHED: Final = 1024
LIST_LIMIT_MAX: Final = 1000
# How long a retrieve_future waits before it answers paused_capacity while no engine runs.
PAUSED_POLL_S: Final = 5.0


def paused_reason(base_model: str | None) -> str:
    what = f"base model {base_model}" if base_model else "this request"
    return (f"no engine is running for {what} (its TPU slice is starting, preempted or suspended); the request is "
            "queued and runs in order when the engine is back")


@dataclass(frozen=True)
class BaseModelSpec:
    """A base model this server serves: the name clients pass as base_model, and the tokenizer get_info names
    (the SDK's get_tokenizer() loads it with transformers; default: the model name itself)."""

    name: str
    tokenizer_id: str | None = None
    max_context_length: int | None = None


@dataclass(frozen=True)
class ServerConfig:
    base_models: Sequence[BaseModelSpec]
    long_poll_s: float = DEFAULT_LONG_POLL_S
    poll_interval_s: float = 0.05
    # Asks the SDK to zstd the forward_backward body (client/config proto_compress_fwdbwd): >10x smaller on the wire.
    proto_compress_fwdbwd: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_unfinished_samples: int = DEFAULT_MAX_UNFINISHED
    # How long the external weights download URLs live (downloads.py).
    download_url_ttl_s: int = downloads.DEFAULT_URL_TTL_S
    _by_name: dict[str, BaseModelSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_models", tuple(self.base_models))
        if not self.base_models:
            raise ValueError("the server needs at least one base model")
        if not 0 < self.long_poll_s < SDK_RETRIEVE_TIMEOUT_S:
            raise ValueError(f"long_poll_s must be in (0, {SDK_RETRIEVE_TIMEOUT_S}) (the SDK's retrieve timeout)")
        object.__setattr__(self, "_by_name", {m.name: m for m in self.base_models})
        if len(self._by_name) != len(self.base_models):
            raise ValueError("base model names must be unique")
        if self.download_url_ttl_s < downloads.MIN_URL_TTL_S:
            raise ValueError(f"download_url_ttl_s must be >= {downloads.MIN_URL_TTL_S} (the CLI signs again 5 minutes "
                             "before the expiry)")

    def base_model(self, name: str) -> BaseModelSpec:
        if (spec := self._by_name.get(name)) is None:
            served = ", ".join(sorted(self._by_name))
            raise HTTPException(400, f"base model {name!r} is not served here; this server serves: {served}")
        return spec

    def tokenizer_id(self, name: str) -> str:
        spec = self._by_name.get(name)
        return (spec.tokenizer_id if spec is not None else None) or name


class _WeightsInfoBody(pydantic.BaseModel):
    # RestClient.get_weights_info_by_tinker_path posts a bare dict (tinker has no request type for it).
    tinker_path: str


class _TtlBody(pydantic.BaseModel):
    # RestClient.set_checkpoint_ttl_from_tinker_path puts {"ttl_seconds": int | None} (rest_client.py:829-832).
    ttl_seconds: int | None


class _FinishBody(pydantic.BaseModel):
    # ServiceClient.close posts {"reason": {"type": status}, "detail": detail} (lib/public_interfaces/
    # service_client.py:825-830).
    reason: Annotated[
        types.ClientSessionFinishSuccess | types.ClientSessionFinishErrored | types.ClientSessionFinishInterrupted,
        pydantic.Field(discriminator="type"),
    ]
    detail: str | None = None


def _finished_among(store: Store, request_ids: list[str]) -> list[str]:
    """Which of these requests are done or failed: one query for every waiting long-poll (not owner-scoped: the
    caller checked ownership when the poll began)."""
    found: list[str] = []
    with DbSession(store.engine) as s:
        for i in range(0, len(request_ids), 500):
            chunk = request_ids[i : i + 500]
            q = select(Request.request_id).where(Request.request_id.in_(chunk), Request.status.in_(FINISHED))
            found.extend(s.scalars(q))
    return found


class _FinishWatcher:
    """Wakes retrieve_future long-polls when their request finishes.

    One asyncio task polls the database for all waiting ids at once, so a thousand in-flight samples cost one query
    per tick and no threads; blocking `Store.wait` in the threadpool would pin one of its 40 threads per waiting
    client and starve every other route. (Results come from the engine, another process, so there is nothing to be
    notified of in-process.)
    """

    def __init__(self, store: Store, interval_s: float) -> None:
        self._store = store
        self._interval_s = interval_s
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None

    async def wait(self, request_id: str, timeout_s: float) -> bool:
        """True once the request has finished, False after timeout_s."""
        event = asyncio.Event()
        self._waiters.setdefault(request_id, set()).add(event)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            waiting = self._waiters.get(request_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[request_id]

    async def _run(self) -> None:
        while self._waiters:
            try:
                done = await run_in_threadpool(_finished_among, self._store, list(self._waiters))
            except Exception:  # a database hiccup must not end the watcher; the waiters retry on the next tick
                log.exception("polling request states failed")
                done = []
            for request_id in done:
                for event in self._waiters.get(request_id, ()):
                    event.set()
            await asyncio.sleep(self._interval_s)


def _promise(row: Request, *, sample_count: int | None = None) -> dict[str, Any]:
    future = types.UntypedAPIFuture(
        request_id=row.request_id,
        model_id=row.model_id,
        sample_sequence_ids=protocol.sequence_ids(row.request_id, sample_count) if sample_count is not None else None,
    )
    return future.model_dump(mode="json", exclude_none=True)


def _seq_id(seq_id: int | None) -> int:
    # A model's seq 0 is its creation (create_model / load_weights); the SDK numbers the rest from 1
    # (lib/public_interfaces/training_client.py:420, 822: seq_id=request_id + 1). Without one the request would
    # escape the model's order.
    if seq_id is None or seq_id < 1:
        raise HTTPException(400, f"seq_id must be an integer >= 1 (got {seq_id!r}): requests run in seq_id order")
    return seq_id


def _checkpoint_name(model_id: str, kind: CheckpointKind, name: str | None) -> str:
    if name is None:
        raise HTTPException(400, "path (the checkpoint name) is required")
    try:
        parse_tinker_path(tinker_path(model_id, kind, name))
    except ValueError:
        raise HTTPException(
            400, f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (at most 200 characters)"
        ) from None
    return name


def _str_dict(d: dict[str, Any] | None) -> dict[str, str] | None:
    return {k: v if isinstance(v, str) else str(v) for k, v in d.items()} if d else None


def _checkpoint(row: Checkpoint) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=row.checkpoint_id,
        checkpoint_type=row.kind,  # type: ignore[arg-type]
        time=row.created_at,
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        user_metadata=_str_dict(row.user_metadata),
        expires_at=row.expires_at,
    )


def _cursor(page: Any) -> types.Cursor:
    return types.Cursor(offset=page.offset, limit=page.limit, total_count=page.total)


async def _read_body(request: HttpRequest, limit: int) -> bytes:
    buf = io.BytesIO()
    async for chunk in request.stream():
        buf.write(chunk)
        if buf.tell() > limit:
            raise HTTPException(413, f"request body over {limit} bytes")
    return buf.getvalue()


def _decode_forward_backward(raw: bytes, encoding: str | None, limit: int) -> tuple[Any, bytes]:
    if encoding and encoding.strip().lower() != "identity":
        if encoding.strip().lower() != "zstd":
            raise HTTPException(415, f"Content-Encoding {encoding!r}: only zstd is accepted")
        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as reader:
                out = io.BytesIO()
                while chunk := reader.read(1 << 20):
                    out.write(chunk)
                    if out.tell() > limit:  # a small compressed body may inflate without bound
                        raise HTTPException(413, f"decompressed request body over {limit} bytes")
            raw = out.getvalue()
        except zstandard.ZstdError as e:
            raise HTTPException(400, f"the zstd body does not decompress: {e}") from None
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        raise HTTPException(400, f"not a ForwardBackwardRequest protobuf: {e}") from None
    return msg, protocol.canonical_forward_backward(msg)


# The routes of requests that run in their model's seq_id order, and their kinds (for `refusing` and the 422 handler).
ORDERED_ROUTES: Final = {
    "/api/v1/optim_step": protocol.OPTIM_STEP,
    "/api/v1/save_weights": protocol.SAVE_WEIGHTS,
    "/api/v1/save_weights_for_sampler": protocol.SAVE_WEIGHTS_FOR_SAMPLER,
    "/api/v1/save_weights_external": protocol.SAVE_WEIGHTS_EXTERNAL,
    "/api/v1/load_weights": protocol.LOAD_WEIGHTS,
}


def _owner(request: HttpRequest) -> str:
    return auth.authenticate(request.app.state.store, request.headers.get("X-API-Key"))


# Module level: FastAPI resolves the route signatures' (string) annotations in this module's namespace.
Owner = Annotated[str, Depends(_owner)]


class _BodyLimit:
    """A request body over its route's limit (protobuf routes: max_body_bytes; the rest: max_json_bytes) is answered
    413 before any route holds it: by its Content-Length at once, else as the stream passes the limit (raised from
    receive(), so FastAPI answers it as any HTTPException). FastAPI would otherwise read and parse a JSON body of any
    size, and the store keep it (30 MiB of user_metadata was stored)."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.config.max_body_bytes if scope["path"] in PROTOBUF_ROUTES else self.config.max_json_bytes
        message = f"request body over {limit} bytes (this route's limit)"
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await JSONResponse({"detail": message}, status_code=413, headers={"x-should-retry": "false"})(
                scope, receive, send)
            return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, message, headers={"x-should-retry": "false"})
            return msg

        await self.app(scope, limited, send)


def create_app(store: Store, config: ServerConfig) -> FastAPI:
    """The API over `store`, serving `config.base_models`. No docs routes: every route but healthz needs a key."""
    app = FastAPI(title="gke-tpu-rl Tinker-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    downloads.redact_access_log()
    app.add_middleware(_BodyLimit, config=config)
    app.state.store = store
    watcher = _FinishWatcher(store, config.poll_interval_s)

    def error(status: int, message: str) -> JSONResponse:
        # x-should-retry: the SDK's transport would otherwise retry a 409 on its own (tinker/_base_client.py:711-731);
        # these answers do not change on a retry.
        return JSONResponse({"detail": message}, status_code=status, headers={"x-should-retry": "false"})

    @app.exception_handler(auth.AuthError)
    async def _auth_error(_: HttpRequest, e: auth.AuthError) -> JSONResponse:
        return error(401, f"{e} (send a key made with `python -m trainer.service keys create NAME` as X-API-Key; a "
                          "key a script already has, such as a walkthrough's tml-dummy, is let in on a development "
                          "server with `python -m trainer.service keys import NAME KEY --allow-weak`)")

    @app.exception_handler(NotFound)
    async def _not_found(_: HttpRequest, e: NotFound) -> JSONResponse:
        return error(404, str(e))

    @app.exception_handler(Conflict)
    async def _conflict(_: HttpRequest, e: Conflict) -> JSONResponse:
        return error(409, str(e))

    @app.exception_handler(SessionFinished)
    async def _finished(_: HttpRequest, e: SessionFinished) -> JSONResponse:
        return error(410, str(e))

    @app.exception_handler(StoreError)
    async def _store_error(_: HttpRequest, e: StoreError) -> JSONResponse:
        log.error("store error: %s", e)
        return JSONResponse({"detail": f"store error: {e}"}, status_code=500)

    @contextmanager
    def refusing(owner: str, kind: str, model_id: str | None, seq_id: int | None) -> Iterator[None]:
        """An ordered request refused here (a 4xx) still takes its number in its model's order, failed with the
        refusal's message (Store.refuse): the SDK has numbered it already, and would hold every later request of the
        training client behind the gap."""
        try:
            yield
        except HTTPException as e:
            if 400 <= e.status_code < 500:
                store.refuse(owner, kind, model_id, seq_id, str(e.detail))
            raise
        except NotFound as e:  # e.g. the checkpoint a load names (the model's own absence refuses nothing)
            store.refuse(owner, kind, model_id, seq_id, str(e))
            raise

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, e: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 answer, after the same bookkeeping as `refusing` for a body that names its model and seq.
        kind = ORDERED_ROUTES.get(request.url.path)
        body = e.body if isinstance(e.body, dict) else {}
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if kind is not None and isinstance(model_id, str) and isinstance(seq_id, int):
            try:
                owner = auth.authenticate(store, request.headers.get("X-API-Key"))
            except auth.AuthError:
                owner = None
            if owner is not None:
                message = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
                await run_in_threadpool(store.refuse, owner, kind, model_id, seq_id, message)
        return JSONResponse({"detail": jsonable_encoder(e.errors())}, status_code=422)

    def live_session(owner: str, session_id: str) -> None:
        # "Further operations against it will be rejected" (ServiceClient.close docstring): no new models/samplers.
        if store.get_session(owner, session_id).finished_at is not None:
            raise SessionFinished(f"session {session_id!r} is finished: start a new ServiceClient")

    # -- health, config, telemetry --------------------------------------------------------------------------------

    @app.get("/api/v1/healthz")
    def healthz() -> dict[str, str]:
        return types.HealthResponse(status="ok").model_dump(mode="json")

    @app.post("/api/v1/client/config")
    def client_config(_: types.ClientConfigRequest, owner: Owner) -> dict[str, Any]:
        # pjwt off: the SDK then sends the API key itself on every call (lib/internal_client_holder.py:343-350).
        # The session poller, server-side custom losses and join_sampling_session stay off: not implemented here.
        return types.ClientConfigResponse(
            pjwt_auth_enabled=False,
            proto_compress_fwdbwd=config.proto_compress_fwdbwd,
            sample_use_retrieve_futures=False,
            custom_loss_server_side=False,
            sample_join_sampling_session=False,
        ).model_dump(mode="json")

    @app.post("/api/v1/client/dynamic_config")
    def client_dynamic_config(_: types.ClientConfigRequest, owner: Owner) -> dict[str, Any]:
        return types.ClientDynamicConfigResponse(sample_cancel_enabled=False).model_dump(mode="json")

    @app.post("/api/v1/telemetry")
    def telemetry(owner: Owner) -> dict[str, str]:
        return types.TelemetryResponse(status="accepted").model_dump(mode="json")  # accepted and dropped

    @app.get("/api/v1/get_server_capabilities")
    def get_server_capabilities(owner: Owner) -> dict[str, Any]:
        models = [
            types.SupportedModel(
                model_name=m.name, max_context_length=m.max_context_length, trainable=True, sampleable=True
            )
            for m in config.base_models
        ]
        return types.GetServerCapabilitiesResponse(supported_models=models).model_dump(mode="json", exclude_none=True)

    # -- sessions -------------------------------------------------------------------------------------------------

    @app.post("/api/v1/create_session")
    def create_session(req: types.CreateSessionRequest, owner: Owner) -> dict[str, Any]:
        row = store.create_session(owner, tags=req.tags, user_metadata=req.user_metadata, sdk_version=req.sdk_version)
        return types.CreateSessionResponse(session_id=row.id).model_dump(mode="json", exclude_none=True)

    @app.post("/api/v1/session_heartbeat")
    def session_heartbeat(req: types.SessionHeartbeatRequest, owner: Owner) -> dict[str, Any]:
        # SessionFinished -> 410, which ends the SDK's heartbeat loop (lib/internal_client_holder.py:583).
        store.heartbeat(owner, req.session_id)
        return types.SessionHeartbeatResponse().model_dump(mode="json")

    @app.post("/api/v1/sessions/{session_id}/finish")
    def finish_session(session_id: str, req: _FinishBody, owner: Owner) -> dict[str, Any]:
        store.finish_session(owner, session_id, req.reason.type, req.detail)
        return {}

    @app.get("/api/v1/sessions")
    def list_sessions(
        owner: Owner, limit: Annotated[int, Query(ge=0)] = 20, offset: Annotated[int, Query(ge=0)] = 0
    ) -> dict[str, Any]:
        page = store.list_sessions(owner, limit=min(limit, LIST_LIMIT_MAX), offset=offset)
        return types.ListSessionsResponse(sessions=[s.id for s in page.items]).model_dump(mode="json")

    @app.get("/api/v1/sessions/{session_id}")
    def get_session(session_id: str, owner: Owner) -> dict[str, Any]:
        row = store.get_session(owner, session_id)
        models = store.list_models(owner, session_id=session_id, limit=LIST_LIMIT_MAX)
        samplers = store.list_sampling_sessions(owner, session_id=session_id, limit=LIST_LIMIT_MAX)
        return types.GetSessionResponse(
            training_run_ids=[m.id for m in models.items],
            sampler_ids=[s.id for s in samplers.items],
            user_metadata=_str_dict(row.user_metadata),
        ).model_dump(mode="json", exclude_none=True)

    # -- models -----------------------------------------------------------------------------------------------------

    @app.post("/api/v1/create_model")
    def create_model(req: types.CreateModelRequest, owner: Owner) -> dict[str, Any]:
        config.base_model(req.base_model)
        if req.lora_config is None:
            raise HTTPException(400, "this server trains LoRA adapters only: pass a lora_config")
        if req.lora_config.rank < 1:
            raise HTTPException(400, f"LoRA rank must be >= 1, not {req.lora_config.rank}")
        if req.optimizer_config.type != "adamw":
            raise HTTPException(400, f"optimizer {req.optimizer_config.type!r}: this server trains with AdamW only")
        live_session(owner, req.session_id)
        # The model row first (its id is the SDK's own `<session>:train:<n>`), then its creation as request seq 0,
        # so the client's seq 1, 2, ... wait for it. Both are idempotent: a resubmission finds the same rows.
        model = store.create_model(
            owner, req.session_id, req.model_seq_id, req.base_model, req.lora_config.model_dump(mode="json"),
            user_metadata=req.user_metadata, first_seq_id=0,
        )
        row = store.submit(owner, protocol.CREATE_MODEL, protocol.canonical_json(req), model_id=model.id, seq_id=0)
        return _promise(row)

    def training_run(owner: str, model: Model) -> types.TrainingRun:
        checkpoints = store.list_checkpoints(owner, model.id, limit=LIST_LIMIT_MAX).items
        last = {kind: max((c for c in checkpoints if c.kind == kind), key=lambda c: c.created_at, default=None)
                for kind in ("training", "sampler")}
        return types.TrainingRun(
            training_run_id=model.id,
            base_model=model.base_model,
            model_owner=model.owner_id,
            is_lora=True,
            lora_rank=model.lora_config.get("rank"),
            last_request_time=model.last_request_at,
            last_checkpoint=_checkpoint(last["training"]) if last["training"] else None,
            last_sampler_checkpoint=_checkpoint(last["sampler"]) if last["sampler"] else None,
            user_metadata=_str_dict(model.user_metadata),
        )

    @app.post("/api/v1/get_info")
    def get_info(req: types.GetInfoRequest, owner: Owner) -> dict[str, Any]:
        model = store.get_model(owner, req.model_id)
        # tokenizer_id set explicitly: otherwise the SDK derives one from the model name with heuristics that mangle
        # some names (lib/public_interfaces/training_client.py:1315; "/data/tiny" becomes "/data").
        return types.GetInfoResponse(
            model_id=model.id,
            model_data=types.ModelData(model_name=model.base_model, tokenizer_id=config.tokenizer_id(model.base_model)),
            is_lora=True,
            lora_rank=model.lora_config.get("rank"),
            model_name=model.base_model,
        ).model_dump(mode="json", exclude_none=True)

    @app.get("/api/v1/training_runs")
    def list_training_runs(
        owner: Owner, limit: Annotated[int, Query(ge=0)] = 20, offset: Annotated[int, Query(ge=0)] = 0
    ) -> dict[str, Any]:
        page = store.list_models(owner, limit=min(limit, LIST_LIMIT_MAX), offset=offset)
        return types.TrainingRunsResponse(
            training_runs=[training_run(owner, m) for m in page.items], cursor=_cursor(page)
        ).model_dump(mode="json", exclude_none=True)

    @app.get("/api/v1/training_runs/{model_id}")
    def get_training_run(model_id: str, owner: Owner) -> dict[str, Any]:
        return training_run(owner, store.get_model(owner, model_id)).model_dump(mode="json", exclude_none=True)

    # -- training requests (futures) --------------------------------------------------------------------------------

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: HttpRequest, owner: Owner) -> dict[str, Any]:
        # Protobuf only, as tinker 0.38 sends it (resources/training.py:36-49), also for forward() (forward_only=True);
        # zstd when client/config asks for it (training.py:40).
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise HTTPException(415, f"forward_backward takes a protobuf ForwardBackwardRequest ({PROTOBUF})")
        raw = await _read_body(request, config.max_body_bytes)
        msg, body = await run_in_threadpool(
            _decode_forward_backward, raw, request.headers.get("content-encoding"), config.max_body_bytes
        )
        kind = protocol.FORWARD if msg.forward_only else protocol.FORWARD_BACKWARD
        with refusing(owner, kind, msg.model_id, msg.seq_id):
            seq_id = _seq_id(msg.seq_id)
        row = await run_in_threadpool(store.submit, owner, kind, body, model_id=msg.model_id, seq_id=seq_id)
        return _promise(row)

    @app.post("/api/v1/optim_step")
    def optim_step(req: types.OptimStepRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.OPTIM_STEP, req.model_id, req.seq_id):
            seq_id = _seq_id(req.seq_id)
        row = store.submit(owner, protocol.OPTIM_STEP, protocol.canonical_json(req), model_id=req.model_id,
                           seq_id=seq_id)
        return _promise(row)

    @app.post("/api/v1/save_weights")
    def save_weights(req: types.SaveWeightsRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.SAVE_WEIGHTS, req.model_id, req.seq_id):
            seq_id = _seq_id(req.seq_id)
            _checkpoint_name(req.model_id, "training", req.path)
        row = store.submit(owner, protocol.SAVE_WEIGHTS, protocol.canonical_json(req), model_id=req.model_id,
                           seq_id=seq_id)
        return _promise(row)

    @app.post("/api/v1/save_weights_for_sampler")
    def save_weights_for_sampler(req: types.SaveWeightsForSamplerRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.SAVE_WEIGHTS_FOR_SAMPLER, req.model_id, req.seq_id):
            seq_id = _seq_id(req.seq_id)
            if req.path is not None:
                _checkpoint_name(req.model_id, "sampler", req.path)
            elif req.sampling_session_seq_id is None:
                raise HTTPException(400, "save_weights_for_sampler needs a path (a name) or a sampling_session_seq_id")
        row = store.submit(owner, protocol.SAVE_WEIGHTS_FOR_SAMPLER, protocol.canonical_json(req),
                           model_id=req.model_id, seq_id=seq_id)
        return _promise(row)

    @app.post("/api/v1/save_weights_external")
    def save_weights_external(req: types.SaveWeightsExternalRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.SAVE_WEIGHTS_EXTERNAL, req.model_id, req.seq_id):
            seq_id = _seq_id(req.seq_id)
            _checkpoint_name(req.model_id, "external", req.path)
            if req.age_encryption_recipients:
                # Refused rather than ignored: the caller asked for the files never to be stored in the clear.
                raise HTTPException(400, "age_encryption_recipients: this server cannot encrypt external weights "
                                    "(no age implementation); save without it and encrypt the downloaded files")
        row = store.submit(owner, protocol.SAVE_WEIGHTS_EXTERNAL, protocol.canonical_json(req), model_id=req.model_id,
                           seq_id=seq_id)
        return _promise(row)

    @app.post("/api/v1/load_weights")
    def load_weights(req: types.LoadWeightsRequest, owner: Owner) -> dict[str, Any]:
        into_model = req.session_id is None and req.model_seq_id is None
        with refusing(owner, protocol.LOAD_WEIGHTS, req.model_id, req.seq_id) if into_model else nullcontext():
            checkpoint = store.get_checkpoint(owner, req.path)  # 404 now rather than a failed future later
        # Cross-account loading is not offered, and the token has no business in the database.
        body = protocol.canonical_json(req.model_copy(update={"weights_access_token": None}))
        if req.session_id is None and req.model_seq_id is None:
            # Into an existing model (TrainingClient.load_state*, lib/public_interfaces/training_client.py:962-971).
            if req.model_id is None:
                raise HTTPException(400, "load_weights needs model_id and seq_id, or session_id and model_seq_id")
            with refusing(owner, protocol.LOAD_WEIGHTS, req.model_id, req.seq_id):
                seq_id = _seq_id(req.seq_id)
            row = store.submit(owner, protocol.LOAD_WEIGHTS, body, model_id=req.model_id, seq_id=seq_id)
            return _promise(row)
        # Creates the model (ServiceClient.create_training_client_from_state*, lib/public_interfaces/
        # service_client.py:397-418; the SDK expects the id <session>:train:<n>, :400): the load is its seq 0, the
        # LoRA config is the checkpoint's model's.
        if req.session_id is None or req.model_seq_id is None or req.model_id is not None:
            raise HTTPException(400, "load_weights that creates a model needs session_id and model_seq_id (only)")
        source = store.get_model(owner, checkpoint.model_id)
        base_model = req.base_model or source.base_model
        config.base_model(base_model)
        live_session(owner, req.session_id)
        model = store.create_model(
            owner, req.session_id, req.model_seq_id, base_model, source.lora_config, user_metadata=req.user_metadata,
            first_seq_id=0,
        )
        row = store.submit(owner, protocol.LOAD_WEIGHTS, body, model_id=model.id, seq_id=0)
        return _promise(row)

    # -- sampling ---------------------------------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    def create_sampling_session(req: types.CreateSamplingSessionRequest, owner: Owner) -> dict[str, Any]:
        if req.model_path is not None:
            # The sampler's base model is its checkpoint's (CreateSamplingSessionRequest: "inferred from model_path").
            base_model = store.get_model(owner, store.get_checkpoint(owner, req.model_path).model_id).base_model
        elif req.base_model is not None:
            base_model = config.base_model(req.base_model).name
        else:
            raise HTTPException(400, "create_sampling_session needs a base_model or a model_path")
        live_session(owner, req.session_id)
        row = store.create_sampling_session(
            owner, req.session_id, req.sampling_session_seq_id, base_model=base_model, model_path=req.model_path
        )
        return types.CreateSamplingSessionResponse(sampling_session_id=row.id).model_dump(mode="json")

    @app.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str, owner: Owner) -> dict[str, Any]:
        row = store.get_sampling_session(owner, sampler_id)
        return types.GetSamplerResponse(
            sampler_id=row.id, base_model=row.base_model, model_path=row.model_path
        ).model_dump(mode="json")

    @app.post("/api/v1/asample")
    def asample(req: types.SampleRequest, owner: Owner) -> dict[str, Any]:
        # tinker 0.38's SamplingClient always names its session and numbers its samples (lib/public_interfaces/
        # sampling_client.py:347-349); the base_model/model_path-only form is not offered.
        if req.sampling_session_id is None or req.seq_id is None:
            raise HTTPException(400, "asample needs a sampling_session_id and a seq_id (use create_sampling_session)")
        if wrong := sampling.problems(req.sampling_params, req.num_samples, None):
            raise HTTPException(400, "; ".join(wrong))
        if store.unfinished(owner, protocol.SAMPLE) >= config.max_unfinished_samples:
            raise HTTPException(429, f"this key has {config.max_unfinished_samples} or more samples queued or running "
                                "(the server's limit per key); retry once some finish", headers={"Retry-After": "1"})
        row = store.submit(
            owner, protocol.SAMPLE, protocol.canonical_json(req), sampling_session_id=req.sampling_session_id,
            seq_id=req.seq_id, dedup_key=f"sample:{req.sampling_session_id}:{req.seq_id}",
        )
        # The promise must carry one sequence id per sample, or every 0.38 sample() asserts
        # (lib/public_interfaces/sampling_client.py:80).
        return _promise(row, sample_count=req.num_samples)

    # -- futures ----------------------------------------------------------------------------------------------------

    def outcome(row: Request) -> Response:
        if row.status == FAILED:
            # The SDK's failure shape (lib/api_future_impl.py:496-503 -> RequestFailedError at :558); a bare HTTP 400
            # would be retried three times and then raised as ValueError (:178-179, :402-409).
            return JSONResponse(
                types.RequestFailedResponse(
                    error=row.error_message or "the request failed",
                    category=types.RequestErrorCategory(row.error_category or "unknown"),
                ).model_dump(mode="json")
            )
        spec = protocol.KINDS.get(row.kind)
        # Verbatim: protobuf for forward/forward_backward/sample (0.38 rejects JSON for those, lib/api_future_impl.py:
        # 482-483, 591-596), JSON otherwise.
        return Response(content=row.result or b"", media_type=spec.result_content_type if spec else protocol.JSON)

    def engine_state(row: Request) -> tuple[bool, str | None]:
        base_model = store.request_base_model(row)
        return store.engine_up(base_model), base_model

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(req: types.FutureRetrieveRequest, owner: Owner) -> Response:
        row = await run_in_threadpool(store.get_request, owner, req.request_id)
        if row.status not in FINISHED:
            up, base_model = await run_in_threadpool(engine_state, row)
            # Without an engine the answer comes sooner, so the client learns why it waits.
            wait_s = config.long_poll_s if up else min(config.long_poll_s, PAUSED_POLL_S)
            if not await watcher.wait(row.request_id, wait_s):
                if not up:
                    up, base_model = await run_in_threadpool(engine_state, row)
                # Not an HTTP error: the SDK polls again at once (lib/api_future_impl.py:487-493) and shows a paused
                # queue_state with its queue_state_reason (:488-493, lib/queue_state_logger.py).
                body = TryAgainResponse(request_id=row.request_id, queue_state="active" if up else "paused_capacity")
                answer = body.model_dump(mode="json")
                if not up:
                    answer["queue_state_reason"] = paused_reason(base_model)
                return JSONResponse(answer)
            row = await run_in_threadpool(store.get_request, owner, req.request_id)
        return outcome(row)

    # -- checkpoints --------------------------------------------------------------------------------------------

    def checkpoints_page(owner: str, model_id: str | None, limit: int, offset: int) -> dict[str, Any]:
        """A model's checkpoints, or (model_id None) all of the owner's, as the SDK's CheckpointsListResponse."""
        page = store.list_checkpoints(owner, model_id, limit=min(limit, LIST_LIMIT_MAX), offset=offset)
        return types.CheckpointsListResponse(
            checkpoints=[_checkpoint(c) for c in page.items], cursor=_cursor(page)
        ).model_dump(mode="json", exclude_none=True)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    def list_checkpoints(
        model_id: str, owner: Owner, limit: Annotated[int, Query(ge=0)] = LIST_LIMIT_MAX,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict[str, Any]:
        return checkpoints_page(owner, model_id, limit, offset)

    @app.get("/api/v1/checkpoints")
    def list_user_checkpoints(
        owner: Owner, limit: Annotated[int, Query(ge=0)] = 100, offset: Annotated[int, Query(ge=0)] = 0
    ) -> dict[str, Any]:
        return checkpoints_page(owner, None, limit, offset)

    def route_path(model_id: str, segment: str, name: str) -> str:
        # The SDK puts the checkpoint id ("weights/<name>", ...) in the path as is, so it spans two segments.
        try:
            return rest_tinker_path(model_id, f"{segment}/{name}")
        except ValueError:
            raise NotFound(f"no checkpoint {model_id}/{segment}/{name}") from None

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}", status_code=204)
    def delete_checkpoint(model_id: str, segment: str, name: str, owner: Owner) -> Response:
        row = store.delete_checkpoint(owner, route_path(model_id, segment, name))
        # The row is gone now (the client sees it deleted); the files are the engine's, so it removes them.
        files = protocol.DeleteCheckpointFiles(tinker_path=row.tinker_path, storage_path=row.storage_path)
        store.submit(owner, protocol.DELETE_CHECKPOINT, protocol.canonical_json(files))
        return Response(status_code=204)

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/ttl")
    def set_checkpoint_ttl(model_id: str, segment: str, name: str, req: _TtlBody, owner: Owner) -> dict[str, Any]:
        # `tinker checkpoint download` of a training checkpoint keeps its temporary export alive with it.
        if req.ttl_seconds is not None and req.ttl_seconds < 1:
            raise HTTPException(400, f"ttl_seconds must be >= 1, or null for no expiry (got {req.ttl_seconds})")
        try:
            store.set_checkpoint_ttl(owner, route_path(model_id, segment, name), req.ttl_seconds)
        except ValueError as e:  # beyond the SDK's documented 10 years
            raise HTTPException(400, str(e)) from None
        return {}

    # -- external weights downloads (downloads.py) ----------------------------------------------------------------

    @functools.cache
    def url_key() -> bytes:
        return store.secret(downloads.SECRET_NAME)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/external_weights_urls")
    def external_weights_urls(model_id: str, segment: str, name: str, request: HttpRequest,
                              owner: Owner) -> dict[str, Any]:
        ckpt = store.get_checkpoint(owner, route_path(model_id, segment, name))  # another owner's: 404
        if ckpt.kind != "external":
            raise HTTPException(400, f"{ckpt.tinker_path} is not external weights: only a save_weights_external "
                                "checkpoint has download URLs (`tinker checkpoint download` exports a training one)")
        names = downloads.files(Path(ckpt.storage_path))
        if not names:
            # A 4xx, not a 5xx the SDK would retry for 5 minutes: this does not pass with time.
            raise HTTPException(400, f"the files of {ckpt.tinker_path} cannot be read by this API server (its "
                                "checkpoint storage is not mounted here; see docs/service.md, Downloading weights)")
        expires = int(time.time()) + config.download_url_ttl_s
        # The base URL the client reached us at (scheme and Host header), so the URLs work from where it stands.
        urls = {f: downloads.url(str(request.base_url), url_key(), ckpt, f, expires) for f in names}
        return types.ExternalWeightsUrlsResponse(
            urls=urls, expires=dt.datetime.fromtimestamp(expires, dt.UTC)
        ).model_dump(mode="json")

    @app.get(downloads.ROUTE + "/{owner_id}/{model_id}/{name}/{file:path}")
    def download_external_weights(owner_id: str, model_id: str, name: str, file: str,
                                  expires: int, signature: str) -> FileResponse:
        # No API key: the signed URL is the credential (downloads.py). A missing checkpoint, a bad signature and a
        # revoked key read alike, so a caller without a URL learns nothing about which checkpoints exist.
        invalid = HTTPException(403, downloads.INVALID)
        try:
            ckpt = store.get_checkpoint(owner_id, tinker_path(model_id, "external", name))
        except (NotFound, ValueError):
            raise invalid from None
        if (why := downloads.refusal(url_key(), ckpt, file, expires, signature, time.time())) is not None:
            raise HTTPException(403, why)
        key = store.get_api_key(owner_id)
        if key is None or key.revoked_at is not None:
            raise invalid
        if (path := downloads.file_path(ckpt, file)) is None:
            raise HTTPException(404, f"{file} of {ckpt.tinker_path} is gone from storage")
        return FileResponse(path, filename=path.name, headers={"Cache-Control": "private, no-store"})

    @app.post("/api/v1/weights_info")
    def weights_info(req: _WeightsInfoBody, owner: Owner) -> dict[str, Any]:
        model = store.get_model(owner, store.get_checkpoint(owner, req.tinker_path).model_id)
        lora = model.lora_config
        return types.WeightsInfoResponse(
            base_model=model.base_model, is_lora=True, lora_rank=lora.get("rank"),
            train_unembed=lora.get("train_unembed"), train_mlp=lora.get("train_mlp"),
            train_attn=lora.get("train_attn"),
        ).model_dump(mode="json", exclude_none=True)

    return app
