"""Health, the client's configuration, telemetry and the server's capabilities: what the SDK asks before any work."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from tinker import types

from trainer.service.api.common import Context, Owner


def make_router(ctx: Context) -> APIRouter:
    """/api/v1/healthz, client/config, client/dynamic_config, telemetry, get_server_capabilities."""
    router = APIRouter()
    config = ctx.config

    @router.get("/api/v1/healthz")
    def healthz() -> dict[str, str]:
        return types.HealthResponse(status="ok").model_dump(mode="json")

    @router.post("/api/v1/client/config")
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

    @router.post("/api/v1/client/dynamic_config")
    def client_dynamic_config(_: types.ClientConfigRequest, owner: Owner) -> dict[str, Any]:
        return types.ClientDynamicConfigResponse(sample_cancel_enabled=False).model_dump(mode="json")

    @router.post("/api/v1/telemetry")
    def telemetry(owner: Owner) -> dict[str, str]:
        return types.TelemetryResponse(status="accepted").model_dump(mode="json")  # accepted and dropped

    @router.get("/api/v1/get_server_capabilities")
    def get_server_capabilities(owner: Owner) -> dict[str, Any]:
        models = [
            types.SupportedModel(
                model_name=m.name, max_context_length=m.max_context_length, trainable=True, sampleable=True
            )
            for m in config.base_models
        ]
        return types.GetServerCapabilitiesResponse(supported_models=models).model_dump(mode="json", exclude_none=True)

    return router
