"""retrieve_future: the SDK's long-poll for a request's result, answered from the store as the engine finishes it."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from sqlalchemy import select
from sqlalchemy.orm import Session as DbSession
from starlette.concurrency import run_in_threadpool
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from trainer.service import protocol
from trainer.service.api.common import Context, Owner
from trainer.service.api.config import PAUSED_POLL_S, paused_reason
from trainer.service.store import FAILED, FINISHED, Request, Store

log = logging.getLogger(__name__)


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


def make_router(ctx: Context) -> APIRouter:
    """The retrieve_future route, with its one watcher of finishing requests."""
    router = APIRouter()
    store, config = ctx.store, ctx.config
    watcher = _FinishWatcher(store, config.poll_interval_s)

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

    @router.post("/api/v1/retrieve_future")
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

    return router
