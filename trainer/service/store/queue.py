"""The request queue: requests (the SDK's futures) from submit to done or failed, and the engines (workers) that
claim and run them.

Ordering: a model's requests carry the client's `seq_id` and run strictly in that order: request N is claimable only
once every seq_id below N of that model is done or failed (`Model.next_seq_id` is that frontier). The request that
creates a model is its seq_id 0 (the SDK numbers a TrainingClient's own requests from 1). Requests without a model
or without a seq_id run in arrival order.

Claims: on PostgreSQL claiming uses SELECT ... FOR UPDATE SKIP LOCKED, so concurrent engines never take the same row
and do not block each other; on sqlite the writing transaction's BEGIN IMMEDIATE (`connection`) makes the
read-then-update claim atomic. The engine-side calls (`claim`, `complete`, `fail`, `recover`) are trusted and not
owner-scoped; a model's state (`ModelState`) changes in the transaction that completes its request.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import case, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

from trainer.service.store.errors import Conflict, NotFound, StaleClaim
from trainer.service.store.ids import body_hash, new_id
from trainer.service.store.schema import (
    DONE,
    FAILED,
    FINISHED,
    QUEUED,
    RUNNING,
    ErrorCategory,
    Model,
    ModelState,
    Request,
    SamplingSession,
    Worker,
    utcnow,
)
from trainer.service.store.sessions import Sessions

# An engine whose heartbeat is older than this is taken for gone (it beats every ENGINE_HEARTBEAT_S from a thread of
# its own, so a long compile or device op does not silence it).
ENGINE_HEARTBEAT_S: Final = 2.0
ENGINE_GONE_AFTER_S: Final = 10.0

# What `recover()` puts back in the queue when their process died mid-flight: they change no state (a forward pass
# reads the weights, a sample draws from them), so running them again gives the client what it asked for. Anything
# else (forward_backward accumulates gradients, optim_step updates weights and Adam moments, saves/loads write files
# and rows) may already have taken effect, and nothing in the database can tell, so it fails instead.
RERUNNABLE_KINDS: Final = frozenset({"forward", "sample", "compute_logprobs"})
SERVER_RESTARTED: Final = (
    "the server restarted while this request was running, so it did not finish; it was not run again because it "
    "may already have changed the model (a forward_backward or optim_step must not be applied twice). Check the "
    "model's state (or restore a checkpoint) and resubmit it."
)
# A rerunnable request that was running when the engine died this many times is failed instead of queued again: it is
# likely what killed it (memory, a crash in the device code), and running it forever would keep every other request
# of the engine from being served.
MAX_RUNS: Final = 3
CRASHED_ENGINE: Final = (
    "the server stopped while running this request {n} times, so it is not run again (it may be what stops the "
    "server); check its size and inputs and resubmit it."
)


@dataclass(frozen=True)
class StateUpdate:
    """The model state a request leaves behind, committed with its completion."""

    model_id: str
    seq_id: int
    step: int
    storage_path: str | None


@dataclass(frozen=True)
class Recovery:
    """What `recover()` did: request ids put back in the queue and failed with SERVER_RESTARTED."""

    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class RequestQueue(Sessions):
    """Requests and the workers that run them (see the module docstring)."""

    # -- requests (futures) ------------------------------------------------------------------------------------------

    def submit(
        self,
        owner_id: str,
        kind: str,
        body: bytes,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        sampling_session_id: str | None = None,
        dedup_key: str | None = None,
    ) -> Request:
        """Accept a request (committed before this returns). Idempotent: the same (model_id, seq_id), or the same
        dedup_key, with the same kind and body gives back the first submission's row; a different body -> Conflict.

        A seq_id needs a model_id (the pair orders it). Hash the canonical body (decompressed) so a client's
        retry with other transport encoding still matches.
        """
        if seq_id is not None and model_id is None and dedup_key is None:
            raise ValueError("a seq_id without a model_id needs a dedup_key (e.g. sample:<sampling session>:<seq>)")
        if seq_id is not None and seq_id < 0:
            raise ValueError("seq_id must be >= 0")
        digest = body_hash(kind, body)
        for attempt in range(2):
            try:
                with self._write() as s:
                    model = self._owned(s, Model, owner_id, model_id, "model") if model_id is not None else None
                    if sampling_session_id is not None:
                        self._owned(s, SamplingSession, owner_id, sampling_session_id, "sampling session")
                    existing = self._find_duplicate(s, owner_id, model_id, seq_id, dedup_key)
                    if existing is not None:
                        if existing.body_hash != digest:
                            raise Conflict(
                                f"request {self._describe(model_id, seq_id, dedup_key)} was already submitted with a "
                                f"different body (request_id {existing.request_id})"
                            )
                        return existing
                    if model is not None:
                        model.last_request_at = utcnow()
                    row = Request(
                        request_id=new_id(), owner_id=owner_id, kind=kind, model_id=model_id, seq_id=seq_id,
                        sampling_session_id=sampling_session_id, dedup_key=dedup_key, body=body, body_hash=digest,
                    )
                    s.add(row)
                return row
            except IntegrityError:  # a concurrent twin was inserted first (PostgreSQL): the retry finds it
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def refuse(self, owner_id: str, kind: str, model_id: str | None, seq_id: int | None, message: str) -> bool:
        """Record a request the API refused at submit (a 4xx) as failed, in its place in the model's order.

        The SDK numbers a training client's requests before sending them and runs them in that order; a number the
        API refused would otherwise never reach the database, and every later request of the client would wait
        behind the gap for good. Only for the caller's own model and a number nothing holds yet (a request already
        there answers for that number). True when a row was written.
        """
        if model_id is None or seq_id is None or seq_id < 1:
            return False
        try:
            with self._write() as s:
                self._owned(s, Model, owner_id, model_id, "model")
                if self._find_duplicate(s, owner_id, model_id, seq_id, None) is not None:
                    return False
                now = utcnow()
                row = Request(
                    request_id=new_id(), owner_id=owner_id, kind=kind, model_id=model_id, seq_id=seq_id, body=b"",
                    body_hash=body_hash(kind, b""), status=FAILED, finished_at=now, error_message=message,
                    error_category="user",
                )
                s.add(row)
                self._advance(s, row)
        except (NotFound, IntegrityError):  # not the caller's model, or a concurrent submit took the number
            return False
        self._notify()
        return True

    @staticmethod
    def _describe(model_id: str | None, seq_id: int | None, dedup_key: str | None) -> str:
        return f"seq_id {seq_id} of model {model_id!r}" if model_id is not None and seq_id is not None else repr(
            dedup_key
        )

    @staticmethod
    def _find_duplicate(
        s: Session, owner_id: str, model_id: str | None, seq_id: int | None, dedup_key: str | None
    ) -> Request | None:
        if model_id is not None and seq_id is not None:
            return s.scalars(select(Request).where(Request.model_id == model_id, Request.seq_id == seq_id)).first()
        if dedup_key is not None:
            return s.scalars(
                select(Request).where(Request.owner_id == owner_id, Request.dedup_key == dedup_key)
            ).first()
        return None

    def get_request(self, owner_id: str, request_id: str) -> Request:
        with self._read() as s:
            row = s.scalars(
                select(Request).where(Request.request_id == request_id, Request.owner_id == owner_id)
            ).first()
            if row is None:
                raise NotFound(f"no request {request_id!r}")
            return row

    def requests_with_session(self, owner_id: str, kind: str, request_ids: Collection[str]
                              ) -> dict[str, tuple[Request, str]]:
        """This owner's requests of `kind` among `request_ids`, each with the session of its sampling session, in one
        read (what a stable_reinforce request's provenance names; ids not found are left out)."""
        if not request_ids:
            return {}
        with self._read() as s:
            rows = s.execute(
                select(Request, SamplingSession.session_id)
                .join(SamplingSession, Request.sampling_session_id == SamplingSession.id)
                .where(Request.owner_id == owner_id, Request.kind == kind, Request.request_id.in_(list(request_ids)))
            ).all()
            return {row.request_id: (row, session_id) for row, session_id in rows}

    def wait(self, owner_id: str, request_id: str, timeout_s: float) -> Request:
        """The request once done or failed, or as it stands after timeout_s (queued/running): for long-polling."""
        deadline = time.monotonic() + timeout_s
        while True:
            # Poll the status alone: the body (up to a few MB of forward_backward data) is read once, at the end.
            with self._read() as s:
                status = s.scalar(
                    select(Request.status).where(Request.request_id == request_id, Request.owner_id == owner_id)
                )
            if status is None:
                raise NotFound(f"no request {request_id!r}")
            left = deadline - time.monotonic()
            if status in FINISHED or left <= 0:
                return self.get_request(owner_id, request_id)
            with self._finished:
                self._finished.wait(min(self.poll_interval_s, left))

    def _notify(self) -> None:
        with self._finished:
            self._finished.notify_all()

    # -- the engine's side -------------------------------------------------------------------------------------------

    def register_worker(self, name: str | None = None, *, base_model: str | None = None) -> str:
        worker_id = name or f"{socket.gethostname()}:{os.getpid()}:{new_id()[:8]}"
        with self._write() as s:
            s.merge(Worker(id=worker_id, host=socket.gethostname(), pid=os.getpid(), base_model=base_model,
                           heartbeat_at=utcnow()))
        return worker_id

    def retire_worker(self, worker_id: str) -> None:
        """An engine that stops on purpose says so: the API reports no engine at once, not 30 s later."""
        with self._write() as s:
            if (row := s.get(Worker, worker_id)) is not None:
                s.delete(row)

    def unfinished(self, owner_id: str, kind: str) -> int:
        """The owner's requests of `kind` queued or running (samples: each finishes or fails, so the count drains;
        an ordered request can wait behind a gap for good). Reads through the (status, id) index: few rows are
        queued or running at once."""
        with self._read() as s:
            return int(s.scalar(select(func.count()).select_from(Request).where(
                Request.status.in_([QUEUED, RUNNING]), Request.kind == kind, Request.owner_id == owner_id)) or 0)

    def engine_up(self, base_model: str | None, *, within_s: float = ENGINE_GONE_AFTER_S) -> bool:
        """Whether an engine serving `base_model` (any engine, with None) has beaten its heart within `within_s`."""
        cutoff = utcnow() - dt.timedelta(seconds=within_s)
        with self._read() as s:
            q = select(func.count()).select_from(Worker).where(Worker.heartbeat_at >= cutoff)
            if base_model is not None:
                q = q.where(or_(Worker.base_model.is_(None), Worker.base_model == base_model))
            return bool(s.scalar(q))

    def request_base_model(self, request: Request) -> str | None:
        """The base model a request runs on (its model's or its sampler's), None for model-less work."""
        with self._read() as s:
            if request.model_id is not None:
                return s.scalar(select(Model.base_model).where(Model.id == request.model_id))
            if request.sampling_session_id is not None:
                return s.scalar(select(SamplingSession.base_model).where(
                    SamplingSession.id == request.sampling_session_id))
        return None

    def worker_heartbeat(self, worker_id: str) -> None:
        with self._write() as s:
            if (row := s.get(Worker, worker_id)) is None:
                raise NotFound(f"no worker {worker_id!r}")
            row.heartbeat_at = utcnow()

    def claim(
        self,
        worker_id: str,
        *,
        kinds: Collection[str] | None = None,
        max_batch: int = 1,
        base_model: str | None = None,
        owner_order: Sequence[str] = (),
        batch_unordered: bool = True,
    ) -> list[Request]:
        """Mark the next runnable request running for this worker and return it ([] when nothing is runnable).

        With base_model, only requests on that base model (their model's or their sampler's) and those on none: an
        engine serves one base model, and an API may list several, each with its own engine.

        Runnable: queued, and either unordered (no model or no seq_id) or its model's next seq_id. Oldest first;
        with owner_order (owners served lately, the least recent first) the fair share: owners not in it first, then
        the one served longest ago, so one owner's backlog never keeps another's request waiting behind all of it.
        With max_batch > 1 the batch grows with further requests of the same kind that are runnable once the first
        one is (the model's following seq_ids without a gap, or, unless batch_unordered is False, further unordered
        requests), e.g. the consecutive forward_backward chunks before an optim_step; report each with
        complete()/fail().
        """
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        with self._write() as s:
            q = (
                select(Request)
                .outerjoin(Model, Request.model_id == Model.id)
                .where(
                    Request.status == QUEUED,
                    or_(Request.model_id.is_(None), Request.seq_id.is_(None), Request.seq_id == Model.next_seq_id),
                )
                .order_by(*self._owner_rank(owner_order), Request.id)
                .limit(1)
            )
            if kinds is not None:
                q = q.where(Request.kind.in_(list(kinds)))
            if base_model is not None:
                q = self._on_base_model(q, base_model)
            if not self.is_sqlite:
                q = q.with_for_update(of=Request, skip_locked=True)
            first = s.scalars(q).first()
            if first is None:
                return []
            batch = [first]
            if max_batch > 1 and (batch_unordered or first.ordered):
                batch += self._batch_after(s, first, max_batch - 1, base_model)
            now = utcnow()
            for row in batch:
                row.status, row.worker_id, row.started_at, row.attempts = RUNNING, worker_id, now, row.attempts + 1
            if (worker := s.get(Worker, worker_id)) is not None:
                worker.heartbeat_at = now
        return batch

    @staticmethod
    def _owner_rank(owner_order: Sequence[str]) -> list[Any]:
        """ORDER BY terms putting owners not in owner_order first, then owner_order's own order."""
        if not owner_order:
            return []
        return [case({owner: i for i, owner in enumerate(owner_order)}, value=Request.owner_id, else_=-1)]

    @staticmethod
    def _on_base_model(q: Select[Any], base_model: str) -> Select[Any]:
        """Requests of q (joined with Model) on `base_model`, or on no base model at all (e.g. a file deletion)."""
        sampler_base = select(SamplingSession.base_model).where(
            SamplingSession.id == Request.sampling_session_id).scalar_subquery()
        return q.where(or_(
            Model.base_model == base_model,
            Request.model_id.is_(None) & Request.sampling_session_id.is_(None),
            Request.model_id.is_(None) & (sampler_base == base_model),
        ))

    def _batch_after(self, s: Session, first: Request, more: int, base_model: str | None = None) -> list[Request]:
        base = select(Request).where(Request.status == QUEUED, Request.kind == first.kind)
        if first.ordered:
            q = base.where(
                Request.model_id == first.model_id,
                Request.seq_id > first.seq_id,
                Request.seq_id <= first.seq_id + more,  # type: ignore[operator]  # an ordered request has a seq_id
            ).order_by(Request.seq_id)
            taken: list[Request] = []
            expected = first.seq_id + 1  # type: ignore[operator]  # an ordered request has a seq_id
            for row in s.scalars(self._lock(q, skip_locked=True)):
                if row.seq_id != expected:  # a gap (not yet submitted, or another kind): the batch stops there
                    break
                taken.append(row)
                expected += 1
            return taken
        q = base.where(or_(Request.model_id.is_(None), Request.seq_id.is_(None)), Request.id > first.id)
        q = q.order_by(Request.id).limit(more)
        if base_model is not None:
            q = self._on_base_model(q.outerjoin(Model, Request.model_id == Model.id), base_model)
            # PostgreSQL locks no row of the nullable side of an outer join: lock the requests only.
            return list(s.scalars(q if self.is_sqlite else q.with_for_update(of=Request, skip_locked=True)))
        return list(s.scalars(self._lock(q, skip_locked=True)))

    def complete(self, request_id: str, result: bytes, *, worker_id: str, state: StateUpdate | None = None) -> Request:
        """Done, with its result; `state` (the model's state after it) is committed in the same transaction."""
        return self._finish(request_id, DONE, worker_id=worker_id, result=result, state=state)

    def requeue(self, request_id: str, *, worker_id: str) -> Request:
        """Put a request this worker is running back in the queue, in its place in its model's order."""
        with self._write() as s:
            row: Request | None = s.scalars(self._lock(select(Request).where(Request.request_id == request_id))).first()
            if row is None:
                raise NotFound(f"no request {request_id!r}")
            if row.status != RUNNING or row.worker_id != worker_id:
                raise StaleClaim(f"request {request_id} is {row.status} (worker {row.worker_id}), not running for "
                                 f"{worker_id}")
            row.status, row.worker_id, row.started_at = QUEUED, None, None
        return row

    def replay_log(self, model_id: str, after_seq_id: int, kinds: Collection[str]) -> list[Request]:
        """The model's completed requests of these kinds after `after_seq_id`, in seq_id order: what the engine
        runs again on top of a restored state (forward_backward: the gradients accumulated since)."""
        with self._read() as s:
            q = select(Request).where(Request.model_id == model_id, Request.seq_id > after_seq_id,
                                      Request.status == DONE, Request.kind.in_(list(kinds))).order_by(Request.seq_id)
            return list(s.scalars(q))

    def fail(
        self, request_id: str, message: str, *, category: ErrorCategory = "server", worker_id: str | None = None
    ) -> Request:
        """Fail a running request (or a queued one, with worker_id None: e.g. an engine giving up on a model)."""
        if category not in ("user", "server"):
            raise ValueError(f"category must be 'user' or 'server', not {category!r}")
        return self._finish(request_id, FAILED, worker_id=worker_id, message=message, category=category)

    def _finish(self, request_id: str, status: str, **how: Any) -> Request:
        """_finish_in in a transaction of its own, then wake this process's waiters."""
        with self._write() as s:
            row = self._finish_in(s, request_id, status, **how)
        self._notify()
        return row

    def _finish_in(
        self,
        s: Session,
        request_id: str,
        status: str,
        *,
        worker_id: str | None,
        result: bytes | None = None,
        message: str | None = None,
        category: str | None = None,
        state: StateUpdate | None = None,
    ) -> Request:
        row: Request | None = s.scalars(self._lock(select(Request).where(Request.request_id == request_id))).first()
        if row is None:
            raise NotFound(f"no request {request_id!r}")
        allowed = {RUNNING} if worker_id is not None or status == DONE else {RUNNING, QUEUED}
        if row.status not in allowed or (worker_id is not None and row.worker_id != worker_id):
            raise StaleClaim(
                f"request {request_id} is {row.status} (worker {row.worker_id}), not running for {worker_id}"
            )
        row.status, row.finished_at = status, utcnow()
        row.result, row.error_message, row.error_category = result, message, category
        self._advance(s, row)
        if state is not None:
            s.merge(ModelState(model_id=state.model_id, seq_id=state.seq_id, step=state.step,
                               storage_path=state.storage_path, updated_at=utcnow()))
        return row

    def _advance(self, s: Session, row: Request) -> None:
        """Move the model's next_seq_id past every finished seq_id (a batch may finish out of order)."""
        if not row.ordered:
            return
        model = s.scalars(self._lock(select(Model).where(Model.id == row.model_id))).one()
        s.flush()
        while True:
            status = s.scalar(
                select(Request.status).where(Request.model_id == model.id, Request.seq_id == model.next_seq_id)
            )
            if status not in FINISHED:
                return
            model.next_seq_id += 1

    def fail_queued(self, model_id: str, message: str, *, category: ErrorCategory = "server") -> list[str]:
        """Fail every queued request of a model (e.g. its in-memory state is gone and cannot be restored)."""
        with self._write() as s:
            q = select(Request).where(Request.model_id == model_id, Request.status == QUEUED).order_by(Request.id)
            rows = list(s.scalars(self._lock(q)))
            now = utcnow()
            for row in rows:
                row.status, row.finished_at, row.error_message, row.error_category = FAILED, now, message, category
            for row in rows:
                self._advance(s, row)
        self._notify()
        return [r.request_id for r in rows]

    def recover(
        self, *, stale_after_s: float | None = None, rerunnable_kinds: Collection[str] = RERUNNABLE_KINDS
    ) -> Recovery:
        """Settle the requests that a dead engine left running. Call it at start-up.

        Decision: a request of a kind in `rerunnable_kinds` (pure reads: forward, sample) is queued again, in its
        place in its model's order, unless it has been claimed MAX_RUNS times (then it fails with CRASHED_ENGINE);
        every other one fails with SERVER_RESTARTED (category server). The database
        cannot tell whether a killed forward_backward/optim_step/save had already taken effect (weights updated in
        memory, a file written) and running it again could apply it twice, so the client is told instead and
        decides. Queued requests stay queued: nothing has run them.

        stale_after_s None: every running request is orphaned (the single-server start-up, no other engine alive).
        Otherwise only those claimed by workers with no heartbeat for that long (several engines on one database).
        """
        with self._write() as s:
            q = select(Request).where(Request.status == RUNNING).order_by(Request.id)
            if stale_after_s is not None:
                cutoff = utcnow() - dt.timedelta(seconds=stale_after_s)
                live = select(Worker.id).where(Worker.heartbeat_at >= cutoff)
                q = q.where(or_(Request.worker_id.is_(None), Request.worker_id.not_in(live)))
            rows = list(s.scalars(self._lock(q)))
            report = Recovery()
            now = utcnow()
            for row in rows:
                if row.kind in rerunnable_kinds and row.attempts >= MAX_RUNS:
                    row.status, row.finished_at = FAILED, now
                    row.error_message, row.error_category = CRASHED_ENGINE.format(n=row.attempts), "server"
                    report.failed.append(row.request_id)
                elif row.kind in rerunnable_kinds:
                    row.status, row.worker_id, row.started_at = QUEUED, None, None
                    report.requeued.append(row.request_id)
                else:
                    row.status, row.finished_at = FAILED, now
                    row.error_message, row.error_category = SERVER_RESTARTED, "server"
                    report.failed.append(row.request_id)
            for row in rows:
                if row.status == FAILED:
                    self._advance(s, row)
        self._notify()
        return report

    def pending_count(self) -> int:
        with self._read() as s:
            return s.scalar(select(func.count()).where(Request.status.in_([QUEUED, RUNNING]))) or 0
