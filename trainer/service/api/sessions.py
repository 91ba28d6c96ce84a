"""Sessions: a ServiceClient's create_session, heartbeat, finish, and the session listings."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
from fastapi import APIRouter, Query
from tinker import types

from trainer.service.api.common import Context, Owner, str_dict
from trainer.service.api.config import LIST_LIMIT_MAX


class _FinishBody(pydantic.BaseModel):
    # ServiceClient.close posts {"reason": {"type": status}, "detail": detail} (lib/public_interfaces/
    # service_client.py:825-830).
    reason: Annotated[
        types.ClientSessionFinishSuccess | types.ClientSessionFinishErrored | types.ClientSessionFinishInterrupted,
        pydantic.Field(discriminator="type"),
    ]
    detail: str | None = None


def make_router(ctx: Context) -> APIRouter:
    """The session routes."""
    router = APIRouter()
    store = ctx.store

    @router.post("/api/v1/create_session")
    def create_session(req: types.CreateSessionRequest, owner: Owner) -> dict[str, Any]:
        row = store.create_session(owner, tags=req.tags, user_metadata=req.user_metadata, sdk_version=req.sdk_version)
        return types.CreateSessionResponse(session_id=row.id).model_dump(mode="json", exclude_none=True)

    @router.post("/api/v1/session_heartbeat")
    def session_heartbeat(req: types.SessionHeartbeatRequest, owner: Owner) -> dict[str, Any]:
        # SessionFinished -> 410, which ends the SDK's heartbeat loop (lib/internal_client_holder.py:583).
        store.heartbeat(owner, req.session_id)
        return types.SessionHeartbeatResponse().model_dump(mode="json")

    @router.post("/api/v1/sessions/{session_id}/finish")
    def finish_session(session_id: str, req: _FinishBody, owner: Owner) -> dict[str, Any]:
        store.finish_session(owner, session_id, req.reason.type, req.detail)
        return {}

    @router.get("/api/v1/sessions")
    def list_sessions(
        owner: Owner, limit: Annotated[int, Query(ge=0)] = 20, offset: Annotated[int, Query(ge=0)] = 0
    ) -> dict[str, Any]:
        page = store.list_sessions(owner, limit=min(limit, LIST_LIMIT_MAX), offset=offset)
        return types.ListSessionsResponse(sessions=[s.id for s in page.items]).model_dump(mode="json")

    @router.get("/api/v1/sessions/{session_id}")
    def get_session(session_id: str, owner: Owner) -> dict[str, Any]:
        row = store.get_session(owner, session_id)
        models = store.list_models(owner, session_id=session_id, limit=LIST_LIMIT_MAX)
        samplers = store.list_sampling_sessions(owner, session_id=session_id, limit=LIST_LIMIT_MAX)
        return types.GetSessionResponse(
            training_run_ids=[m.id for m in models.items],
            sampler_ids=[s.id for s in samplers.items],
            user_metadata=str_dict(row.user_metadata),
        ).model_dump(mode="json", exclude_none=True)

    return router
