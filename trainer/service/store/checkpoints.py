"""Checkpoints and the sampling sessions on them: the saved states, sampler weights and external weights a model's
saves leave behind (addressed by tinker:// path, with an optional TTL), and the samplers that read a base model or
such weights.

The rows only: the files are the engine's (it writes them before `add_checkpoint`, and deletes them after the API
removed the row and queued their deletion).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Final

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError

from trainer.service.store.connection import Page
from trainer.service.store.errors import Conflict, NotFound
from trainer.service.store.ids import (
    CHECKPOINT_NAME,
    SEGMENT_FOR_KIND,
    CheckpointKind,
    parse_tinker_path,
    sampling_session_id_for,
    tinker_path,
)
from trainer.service.store.queue import RequestQueue
from trainer.service.store.schema import DONE, Checkpoint, ClientSession, Model, SamplingSession, utcnow

# The SDK documents checkpoint TTLs from 1 hour to 10 years; far beyond, a datetime overflows.
MAX_TTL_S: Final = 10 * 366 * 86400


def _expiry(now: dt.datetime, ttl_seconds: float | None) -> dt.datetime | None:
    if ttl_seconds is None:
        return None
    if ttl_seconds > MAX_TTL_S:
        raise ValueError(f"ttl_seconds must be at most {MAX_TTL_S} (10 years), or none (no expiry); got {ttl_seconds}")
    return now + dt.timedelta(seconds=ttl_seconds)


class Checkpoints(RequestQueue):
    """Checkpoints and sampling sessions (see the module docstring). Above the queue: a save completes its request
    in the transaction that records its checkpoint."""

    def add_checkpoint(
        self,
        owner_id: str,
        model_id: str,
        name: str,
        kind: CheckpointKind,
        storage_path: str,
        *,
        size_bytes: int | None = None,
        ttl_seconds: float | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, Any] | None = None,
        sampler_seq_id: int | None = None,
        completes: tuple[str, str, bytes] | None = None,
    ) -> Checkpoint:
        """Record a checkpoint the engine has written. A live one of the same name -> Conflict unless overwrite.

        In the same transaction: with sampler_seq_id, the model's session gets that sampling session on the new
        checkpoint (save_weights_for_sampler without a path); with completes (request_id, worker_id, result), the
        request that saved it is done. So a save killed half-way leaves no row, and its re-run does not conflict
        with itself."""
        if kind not in SEGMENT_FOR_KIND:
            raise ValueError(f"checkpoint kind must be one of {sorted(SEGMENT_FOR_KIND)}, not {kind!r}")
        if not CHECKPOINT_NAME.fullmatch(name):
            raise ValueError(f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (at most 200)")
        now = utcnow()
        expires = _expiry(now, ttl_seconds)
        path = tinker_path(model_id, kind, name)
        with self._write() as s:
            self._owned(s, Model, owner_id, model_id, "model")
            row = s.scalars(self._lock(select(Checkpoint).where(Checkpoint.tinker_path == path))).first()
            if row is not None and not overwrite and (row.expires_at is None or row.expires_at > now):
                raise Conflict(f"checkpoint {path} already exists")
            if row is None:
                row = Checkpoint(owner_id=owner_id, model_id=model_id, name=name, kind=kind, tinker_path=path)
                s.add(row)
            row.storage_path, row.size_bytes, row.created_at, row.expires_at = storage_path, size_bytes, now, expires
            row.user_metadata = dict(user_metadata or {})
            if sampler_seq_id is not None:
                model = s.get(Model, model_id)
                assert model is not None
                sampler_id = sampling_session_id_for(model.session_id, sampler_seq_id)
                if s.get(SamplingSession, sampler_id) is None:
                    s.add(SamplingSession(
                        id=sampler_id, owner_id=owner_id, session_id=model.session_id,
                        sampling_session_seq_id=sampler_seq_id, base_model=model.base_model, model_path=path,
                        model_id=model_id))
            if completes is not None:
                request_id, worker_id, result = completes
                self._finish_in(s, request_id, DONE, worker_id=worker_id, result=result)
        if completes is not None:
            self._notify()
        return row

    @staticmethod
    def _live(now: dt.datetime) -> Any:
        return or_(Checkpoint.expires_at.is_(None), Checkpoint.expires_at > now)

    def get_checkpoint(self, owner_id: str, path: str) -> Checkpoint:
        """By tinker:// path; expired ones and other owners' read as missing."""
        try:
            parse_tinker_path(path)
        except ValueError as e:
            raise NotFound(f"no checkpoint {path!r}") from e
        with self._read() as s:
            row = s.scalars(
                select(Checkpoint).where(
                    Checkpoint.tinker_path == path, Checkpoint.owner_id == owner_id, self._live(utcnow())
                )
            ).first()
            if row is None:
                raise NotFound(f"no checkpoint {path!r}")
            return row

    def list_checkpoints(
        self, owner_id: str, model_id: str | None = None, *, limit: int = 100, offset: int = 0
    ) -> Page[Checkpoint]:
        """A model's checkpoints (NotFound for another owner's model), or all of the owner's with model_id None."""
        with self._read() as s:
            q = select(Checkpoint).where(Checkpoint.owner_id == owner_id, self._live(utcnow()))
            if model_id is not None:
                self._owned(s, Model, owner_id, model_id, "model")
                q = q.where(Checkpoint.model_id == model_id)
            # Newest first, as the SDK documents its listings (rest_client.py list_user_checkpoints).
            return self._page(s, q, (Checkpoint.created_at.desc(), Checkpoint.id.desc()), limit, offset)

    def delete_checkpoint(self, owner_id: str, path: str) -> Checkpoint:
        """Remove the row and return it, so the caller deletes its files (storage_path)."""
        with self._write() as s:
            row: Checkpoint | None = s.scalars(
                self._lock(select(Checkpoint).where(Checkpoint.tinker_path == path, Checkpoint.owner_id == owner_id))
            ).first()
            if row is None:
                raise NotFound(f"no checkpoint {path!r}")
            s.delete(row)
        return row

    def set_checkpoint_ttl(self, owner_id: str, path: str, ttl_seconds: float | None) -> Checkpoint:
        """Expire a live checkpoint ttl_seconds from now, or never with None."""
        with self._write() as s:
            now = utcnow()
            row: Checkpoint | None = s.scalars(self._lock(select(Checkpoint).where(
                Checkpoint.tinker_path == path, Checkpoint.owner_id == owner_id, self._live(now)))).first()
            if row is None:
                raise NotFound(f"no checkpoint {path!r}")
            row.expires_at = _expiry(now, ttl_seconds)
        return row

    def expired_checkpoints(self, now: dt.datetime | None = None) -> list[Checkpoint]:
        """For the engine's clean-up: every owner's checkpoints whose TTL has passed."""
        with self._read() as s:
            q = select(Checkpoint).where(Checkpoint.expires_at <= (now or utcnow())).order_by(Checkpoint.id)
            return list(s.scalars(q))

    # -- sampling sessions -------------------------------------------------------------------------------------------

    def create_sampling_session(
        self,
        owner_id: str,
        session_id: str,
        sampling_session_seq_id: int,
        *,
        base_model: str,
        model_path: str | None = None,
    ) -> SamplingSession:
        """Idempotent per (session, sampling_session_seq_id). A model_path must be a live checkpoint of the owner."""
        sampler_id = sampling_session_id_for(session_id, sampling_session_seq_id)
        model_id = self.get_checkpoint(owner_id, model_path).model_id if model_path is not None else None
        for attempt in range(2):
            try:
                with self._write() as s:
                    self._owned(s, ClientSession, owner_id, session_id, "session")
                    if (row := s.get(SamplingSession, sampler_id)) is not None:
                        return row
                    row = SamplingSession(
                        id=sampler_id, owner_id=owner_id, session_id=session_id,
                        sampling_session_seq_id=sampling_session_seq_id, base_model=base_model,
                        model_path=model_path, model_id=model_id,
                    )
                    s.add(row)
                return row
            except IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get_sampling_session(self, owner_id: str, sampling_session_id: str) -> SamplingSession:
        with self._read() as s:
            return self._owned(s, SamplingSession, owner_id, sampling_session_id, "sampling session")

    def list_sampling_sessions(
        self, owner_id: str, *, session_id: str | None = None, limit: int = 100, offset: int = 0
    ) -> Page[SamplingSession]:
        with self._read() as s:
            q = select(SamplingSession).where(SamplingSession.owner_id == owner_id)
            if session_id is not None:
                q = q.where(SamplingSession.session_id == session_id)
            return self._page(s, q, (SamplingSession.created_at, SamplingSession.id), limit, offset)
