"""Training requests (futures): forward_backward, optim_step, the saves and load_weights, each stored as a request
and answered with a promise at once."""

from __future__ import annotations

import io
from contextlib import nullcontext
from typing import Any

import zstandard
from fastapi import APIRouter, HTTPException
from fastapi import Request as HttpRequest
from google.protobuf.message import DecodeError
from starlette.concurrency import run_in_threadpool
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from trainer.service import protocol
from trainer.service.api.common import Context, Owner, checkpoint_name, promise, require_seq_id
from trainer.service.protocol import PROTOBUF


async def read_body(request: HttpRequest, limit: int) -> bytes:
    buf = io.BytesIO()
    async for chunk in request.stream():
        buf.write(chunk)
        if buf.tell() > limit:
            raise HTTPException(413, f"request body over {limit} bytes")
    return buf.getvalue()


def decode_forward_backward(raw: bytes, encoding: str | None, limit: int) -> tuple[Any, bytes]:
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


def make_router(ctx: Context) -> APIRouter:
    """The training request routes."""
    router = APIRouter()
    store, config = ctx.store, ctx.config
    refusing, live_session = ctx.refusing, ctx.live_session

    @router.post("/api/v1/forward_backward")
    async def forward_backward(request: HttpRequest, owner: Owner) -> dict[str, Any]:
        # Protobuf only, as tinker 0.38 sends it (resources/training.py:36-49), also for forward() (forward_only=True);
        # zstd when client/config asks for it (training.py:40).
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise HTTPException(415, f"forward_backward takes a protobuf ForwardBackwardRequest ({PROTOBUF})")
        raw = await read_body(request, config.max_body_bytes)
        msg, body = await run_in_threadpool(
            decode_forward_backward, raw, request.headers.get("content-encoding"), config.max_body_bytes
        )
        kind = protocol.FORWARD if msg.forward_only else protocol.FORWARD_BACKWARD
        with refusing(owner, kind, msg.model_id, msg.seq_id):
            seq_id = require_seq_id(msg.seq_id)
        row = await run_in_threadpool(store.submit, owner, kind, body, model_id=msg.model_id, seq_id=seq_id)
        return promise(row)

    @router.post("/api/v1/optim_step")
    def optim_step(req: types.OptimStepRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.OPTIM_STEP, req.model_id, req.seq_id):
            seq_id = require_seq_id(req.seq_id)
        row = store.submit(owner, protocol.OPTIM_STEP, protocol.canonical_json(req), model_id=req.model_id,
                           seq_id=seq_id)
        return promise(row)

    @router.post("/api/v1/save_weights")
    def save_weights(req: types.SaveWeightsRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.SAVE_WEIGHTS, req.model_id, req.seq_id):
            seq_id = require_seq_id(req.seq_id)
            checkpoint_name(req.model_id, "training", req.path)
        row = store.submit(owner, protocol.SAVE_WEIGHTS, protocol.canonical_json(req), model_id=req.model_id,
                           seq_id=seq_id)
        return promise(row)

    @router.post("/api/v1/save_weights_for_sampler")
    def save_weights_for_sampler(req: types.SaveWeightsForSamplerRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.SAVE_WEIGHTS_FOR_SAMPLER, req.model_id, req.seq_id):
            seq_id = require_seq_id(req.seq_id)
            if req.path is not None:
                checkpoint_name(req.model_id, "sampler", req.path)
            elif req.sampling_session_seq_id is None:
                raise HTTPException(400, "save_weights_for_sampler needs a path (a name) or a sampling_session_seq_id")
        row = store.submit(owner, protocol.SAVE_WEIGHTS_FOR_SAMPLER, protocol.canonical_json(req),
                           model_id=req.model_id, seq_id=seq_id)
        return promise(row)

    @router.post("/api/v1/save_weights_external")
    def save_weights_external(req: types.SaveWeightsExternalRequest, owner: Owner) -> dict[str, Any]:
        with refusing(owner, protocol.SAVE_WEIGHTS_EXTERNAL, req.model_id, req.seq_id):
            seq_id = require_seq_id(req.seq_id)
            checkpoint_name(req.model_id, "external", req.path)
            if req.age_encryption_recipients:
                # Refused rather than ignored: the caller asked for the files never to be stored in the clear.
                raise HTTPException(400, "age_encryption_recipients: this server cannot encrypt external weights "
                                    "(no age implementation); save without it and encrypt the downloaded files")
        row = store.submit(owner, protocol.SAVE_WEIGHTS_EXTERNAL, protocol.canonical_json(req), model_id=req.model_id,
                           seq_id=seq_id)
        return promise(row)

    @router.post("/api/v1/load_weights")
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
                seq_id = require_seq_id(req.seq_id)
            row = store.submit(owner, protocol.LOAD_WEIGHTS, body, model_id=req.model_id, seq_id=seq_id)
            return promise(row)
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
        return promise(row)

    return router
