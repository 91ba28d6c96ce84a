"""Models (the SDK's training runs): create_model, get_info and the training run listings."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from tinker import types

from trainer.service import protocol
from trainer.service.api.common import Context, Owner, cursor, promise, sdk_checkpoint, str_dict
from trainer.service.api.config import LIST_LIMIT_MAX
from trainer.service.store import Model


def make_router(ctx: Context) -> APIRouter:
    """The model routes: creating one is its request seq 0, the rest reads the store."""
    router = APIRouter()
    store, config, live_session = ctx.store, ctx.config, ctx.live_session

    @router.post("/api/v1/create_model")
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
        return promise(row)

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
            last_checkpoint=sdk_checkpoint(last["training"]) if last["training"] else None,
            last_sampler_checkpoint=sdk_checkpoint(last["sampler"]) if last["sampler"] else None,
            user_metadata=str_dict(model.user_metadata),
        )

    @router.post("/api/v1/get_info")
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

    @router.get("/api/v1/training_runs")
    def list_training_runs(
        owner: Owner, limit: Annotated[int, Query(ge=0)] = 20, offset: Annotated[int, Query(ge=0)] = 0
    ) -> dict[str, Any]:
        page = store.list_models(owner, limit=min(limit, LIST_LIMIT_MAX), offset=offset)
        return types.TrainingRunsResponse(
            training_runs=[training_run(owner, m) for m in page.items], cursor=cursor(page)
        ).model_dump(mode="json", exclude_none=True)

    @router.get("/api/v1/training_runs/{model_id}")
    def get_training_run(model_id: str, owner: Owner) -> dict[str, Any]:
        return training_run(owner, store.get_model(owner, model_id)).model_dump(mode="json", exclude_none=True)

    return router
