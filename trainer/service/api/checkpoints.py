"""Checkpoints: the listings, deletion and TTL of a model's checkpoints, their weights' info, and the signed download
URLs of external weights (downloads.py) with the route that serves them."""

from __future__ import annotations

import datetime as dt
import functools
import time
from pathlib import Path
from typing import Annotated, Any

import pydantic
from fastapi import APIRouter, HTTPException, Query
from fastapi import Request as HttpRequest
from fastapi.responses import FileResponse, Response
from tinker import types

from trainer.service import downloads, protocol
from trainer.service.api.common import Context, Owner, cursor, sdk_checkpoint
from trainer.service.api.config import LIST_LIMIT_MAX
from trainer.service.store import NotFound, rest_tinker_path, tinker_path


class _WeightsInfoBody(pydantic.BaseModel):
    # RestClient.get_weights_info_by_tinker_path posts a bare dict (tinker has no request type for it).
    tinker_path: str


class _TtlBody(pydantic.BaseModel):
    # RestClient.set_checkpoint_ttl_from_tinker_path puts {"ttl_seconds": int | None} (rest_client.py:829-832).
    ttl_seconds: int | None


def make_router(ctx: Context) -> APIRouter:
    """The checkpoint and weights routes."""
    router = APIRouter()
    store, config = ctx.store, ctx.config

    def checkpoints_page(owner: str, model_id: str | None, limit: int, offset: int) -> dict[str, Any]:
        """A model's checkpoints, or (model_id None) all of the owner's, as the SDK's CheckpointsListResponse."""
        page = store.list_checkpoints(owner, model_id, limit=min(limit, LIST_LIMIT_MAX), offset=offset)
        return types.CheckpointsListResponse(
            checkpoints=[sdk_checkpoint(c) for c in page.items], cursor=cursor(page)
        ).model_dump(mode="json", exclude_none=True)

    @router.get("/api/v1/training_runs/{model_id}/checkpoints")
    def list_checkpoints(
        model_id: str, owner: Owner, limit: Annotated[int, Query(ge=0)] = LIST_LIMIT_MAX,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict[str, Any]:
        return checkpoints_page(owner, model_id, limit, offset)

    @router.get("/api/v1/checkpoints")
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

    @router.delete("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}", status_code=204)
    def delete_checkpoint(model_id: str, segment: str, name: str, owner: Owner) -> Response:
        row = store.delete_checkpoint(owner, route_path(model_id, segment, name))
        # The row is gone now (the client sees it deleted); the files are the engine's, so it removes them.
        files = protocol.DeleteCheckpointFiles(tinker_path=row.tinker_path, storage_path=row.storage_path)
        store.submit(owner, protocol.DELETE_CHECKPOINT, protocol.canonical_json(files))
        return Response(status_code=204)

    @router.put("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/ttl")
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

    @router.get("/api/v1/training_runs/{model_id}/checkpoints/{segment}/{name}/external_weights_urls")
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

    @router.get(downloads.ROUTE + "/{owner_id}/{model_id}/{name}/{file:path}")
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

    @router.post("/api/v1/weights_info")
    def weights_info(req: _WeightsInfoBody, owner: Owner) -> dict[str, Any]:
        model = store.get_model(owner, store.get_checkpoint(owner, req.tinker_path).model_id)
        lora = model.lora_config
        return types.WeightsInfoResponse(
            base_model=model.base_model, is_lora=True, lora_rank=lora.get("rank"),
            train_unembed=lora.get("train_unembed"), train_mlp=lora.get("train_mlp"),
            train_attn=lora.get("train_attn"),
        ).model_dump(mode="json", exclude_none=True)

    return router
