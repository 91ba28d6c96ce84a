"""What every router of the API shares: the caller's owner (its key), the request's shape checks, the SDK's answer
shapes, and `Context` (the store and the config, with the bookkeeping of a refused ordered request)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Final

from fastapi import Depends, HTTPException
from fastapi import Request as HttpRequest
from tinker import types

from trainer.service import auth, protocol
from trainer.service.api.config import ServerConfig
from trainer.service.store import (
    Checkpoint,
    CheckpointKind,
    NotFound,
    Request,
    SessionFinished,
    Store,
    parse_tinker_path,
    tinker_path,
)

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


# Module level, and imported by every router module: FastAPI resolves a route signature's (string) annotations in
# the namespace of the route's module.
Owner = Annotated[str, Depends(_owner)]


def promise(row: Request, *, sample_count: int | None = None) -> dict[str, Any]:
    future = types.UntypedAPIFuture(
        request_id=row.request_id,
        model_id=row.model_id,
        sample_sequence_ids=protocol.sequence_ids(row.request_id, sample_count) if sample_count is not None else None,
    )
    return future.model_dump(mode="json", exclude_none=True)


def require_seq_id(seq_id: int | None) -> int:
    # A model's seq 0 is its creation (create_model / load_weights); the SDK numbers the rest from 1
    # (lib/public_interfaces/training_client.py:420, 822: seq_id=request_id + 1). Without one the request would
    # escape the model's order.
    if seq_id is None or seq_id < 1:
        raise HTTPException(400, f"seq_id must be an integer >= 1 (got {seq_id!r}): requests run in seq_id order")
    return seq_id


def checkpoint_name(model_id: str, kind: CheckpointKind, name: str | None) -> str:
    if name is None:
        raise HTTPException(400, "path (the checkpoint name) is required")
    try:
        parse_tinker_path(tinker_path(model_id, kind, name))
    except ValueError:
        raise HTTPException(
            400, f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (at most 200 characters)"
        ) from None
    return name


def str_dict(d: dict[str, Any] | None) -> dict[str, str] | None:
    return {k: v if isinstance(v, str) else str(v) for k, v in d.items()} if d else None


def sdk_checkpoint(row: Checkpoint) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=row.checkpoint_id,
        checkpoint_type=row.kind,
        time=row.created_at,
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        user_metadata=str_dict(row.user_metadata),
        expires_at=row.expires_at,
    )


def cursor(page: Any) -> types.Cursor:
    return types.Cursor(offset=page.offset, limit=page.limit, total_count=page.total)


@dataclass(frozen=True)
class Context:
    """What the routers serve from: the store, the config, and two checks several of them make."""

    store: Store
    config: ServerConfig

    @contextmanager
    def refusing(self, owner: str, kind: str, model_id: str | None, seq_id: int | None) -> Iterator[None]:
        """An ordered request refused here (a 4xx) still takes its number in its model's order, failed with the
        refusal's message (Store.refuse): the SDK has numbered it already, and would hold every later request of the
        training client behind the gap."""
        try:
            yield
        except HTTPException as e:
            if 400 <= e.status_code < 500:
                self.store.refuse(owner, kind, model_id, seq_id, str(e.detail))
            raise
        except NotFound as e:  # e.g. the checkpoint a load names (the model's own absence refuses nothing)
            self.store.refuse(owner, kind, model_id, seq_id, str(e))
            raise

    def live_session(self, owner: str, session_id: str) -> None:
        # "Further operations against it will be rejected" (ServiceClient.close docstring): no new models/samplers.
        if self.store.get_session(owner, session_id).finished_at is not None:
            raise SessionFinished(f"session {session_id!r} is finished: start a new ServiceClient")
