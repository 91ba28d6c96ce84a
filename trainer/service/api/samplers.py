"""Sampling: sampling sessions (a base model, or a checkpoint's sampler weights) and asample."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from tinker import types

from trainer.service import protocol, sampling
from trainer.service.api.common import Context, Owner, promise


def make_router(ctx: Context) -> APIRouter:
    """The sampling routes."""
    router = APIRouter()
    store, config, live_session = ctx.store, ctx.config, ctx.live_session

    @router.post("/api/v1/create_sampling_session")
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

    @router.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str, owner: Owner) -> dict[str, Any]:
        row = store.get_sampling_session(owner, sampler_id)
        return types.GetSamplerResponse(
            sampler_id=row.id, base_model=row.base_model, model_path=row.model_path
        ).model_dump(mode="json")

    @router.post("/api/v1/asample")
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
        return promise(row, sample_count=req.num_samples)

    return router
