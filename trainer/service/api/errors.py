"""How the API answers the store's errors, a refused key and an invalid body: HTTP statuses the SDK does not retry
(x-should-retry: false), and for an ordered request's invalid body the same bookkeeping as `Context.refusing`."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from trainer.service import auth
from trainer.service.api.common import ORDERED_ROUTES
from trainer.service.store import Conflict, NotFound, SessionFinished, Store, StoreError

log = logging.getLogger(__name__)


def install(app: FastAPI, store: Store) -> None:
    """The exception handlers on `app` (FastAPI's routers cannot hold them)."""

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

