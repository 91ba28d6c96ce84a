"""The request body limits: a body over its route's limit is refused before any route reads it."""

from __future__ import annotations

from typing import Any, Final

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from trainer.service.api.config import ServerConfig

PROTOBUF_ROUTES: Final = frozenset({"/api/v1/forward_backward"})


class BodyLimit:
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

