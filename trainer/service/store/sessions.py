"""What a client opens and owns, apart from its requests and checkpoints: API keys, sessions and models; and the
server secrets kept beside the schema version (`Meta`).

Every user-facing call takes the caller's owner id and reads another owner's row as a missing one (`NotFound`,
same message); `model`, `model_state` and `live_models` are the engine's trusted, unscoped reads.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from trainer.service.store.connection import Database, Page
from trainer.service.store.errors import NotFound, SessionFinished
from trainer.service.store.ids import model_id_for
from trainer.service.store.schema import ApiKey, ClientSession, Meta, Model, ModelState, utcnow


class Sessions(Database):
    """API keys, sessions, models and server secrets (see the module docstring)."""

    def secret(self, name: str) -> bytes:
        """A random 256-bit server secret kept in the database (made on first use), so every API replica and every
        restart shares it: e.g. the key that signs download URLs (downloads.py)."""
        key = f"secret:{name}"
        with self._read() as s:
            found = s.scalar(select(Meta.value).where(Meta.key == key))
        if found is None:
            # IntegrityError: another process made it first (PostgreSQL): read theirs.
            with suppress(IntegrityError), self._write() as s:
                if s.get(Meta, key) is None:
                    s.add(Meta(key=key, value=os.urandom(32).hex()))
            with self._read() as s:
                found = s.scalar(select(Meta.value).where(Meta.key == key))
        assert found is not None
        return bytes.fromhex(found)

    # -- API keys (the rows; generation, hashing and verification live in auth.py) --------------------------------

    def add_api_key(self, key_id: str, name: str, key_hash: str) -> ApiKey:
        with self._write() as s:
            row = ApiKey(id=key_id, name=name, key_hash=key_hash)
            s.add(row)
        return row

    def get_api_key(self, key_id: str) -> ApiKey | None:
        with self._read() as s:
            return s.get(ApiKey, key_id)

    def list_api_keys(self) -> list[ApiKey]:
        with self._read() as s:
            return list(s.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))

    def revoke_api_key(self, key_id: str) -> ApiKey:
        """Idempotent: revoking a revoked key keeps its first revocation time."""
        with self._write() as s:
            row = s.get(ApiKey, key_id)
            if row is None:
                raise NotFound(f"no API key {key_id!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
        return row

    # -- sessions -------------------------------------------------------------------------------------------------

    def create_session(
        self,
        owner_id: str,
        *,
        tags: Sequence[str] = (),
        user_metadata: dict[str, Any] | None = None,
        sdk_version: str | None = None,
    ) -> ClientSession:
        with self._write() as s:
            row = ClientSession(
                id=str(uuid.uuid4()), owner_id=owner_id, tags=list(tags), user_metadata=dict(user_metadata or {}),
                sdk_version=sdk_version,
            )
            s.add(row)
        return row

    def get_session(self, owner_id: str, session_id: str) -> ClientSession:
        with self._read() as s:
            return self._owned(s, ClientSession, owner_id, session_id, "session")

    def heartbeat(self, owner_id: str, session_id: str) -> ClientSession:
        with self._write() as s:
            row = self._owned(s, ClientSession, owner_id, session_id, "session", lock=True)
            if row.finished_at is not None:
                raise SessionFinished(f"session {session_id!r} is finished")
            row.heartbeat_at = utcnow()
        return row

    def finish_session(self, owner_id: str, session_id: str, reason: str, detail: str | None = None) -> ClientSession:
        """Idempotent: the first finish wins."""
        with self._write() as s:
            row = self._owned(s, ClientSession, owner_id, session_id, "session", lock=True)
            if row.finished_at is None:
                row.finished_at, row.finish_reason, row.finish_detail = utcnow(), reason, detail
        return row

    def list_sessions(self, owner_id: str, *, limit: int = 100, offset: int = 0) -> Page[ClientSession]:
        with self._read() as s:
            q = select(ClientSession).where(ClientSession.owner_id == owner_id)
            return self._page(s, q, (ClientSession.created_at, ClientSession.id), limit, offset)

    # -- models ---------------------------------------------------------------------------------------------------

    def create_model(
        self,
        owner_id: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        *,
        user_metadata: dict[str, Any] | None = None,
        first_seq_id: int = 0,
    ) -> Model:
        """Idempotent per (session, model_seq_id): a resubmission returns the model created the first time.

        `first_seq_id` is the seq_id of the model's first request: 0 when the API queues the creation itself as
        the model's request 0 (so the client's requests 1, 2, ... wait for it), 1 when it builds the model inline.
        """
        model_id = model_id_for(session_id, model_seq_id)
        for attempt in range(2):
            try:
                with self._write() as s:
                    self._owned(s, ClientSession, owner_id, session_id, "session")
                    if (row := s.get(Model, model_id)) is not None:
                        return row
                    row = Model(
                        id=model_id, owner_id=owner_id, session_id=session_id, model_seq_id=model_seq_id,
                        base_model=base_model, lora_config=dict(lora_config or {}),
                        user_metadata=dict(user_metadata or {}), next_seq_id=first_seq_id,
                    )
                    s.add(row)
                return row
            except IntegrityError:  # a concurrent identical create won the insert (PostgreSQL): read it back
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get_model(self, owner_id: str, model_id: str) -> Model:
        with self._read() as s:
            return self._owned(s, Model, owner_id, model_id, "model")

    def list_models(
        self, owner_id: str, *, session_id: str | None = None, limit: int = 100, offset: int = 0
    ) -> Page[Model]:
        with self._read() as s:
            q = select(Model).where(Model.owner_id == owner_id)
            if session_id is not None:
                q = q.where(Model.session_id == session_id)
            return self._page(s, q, (Model.created_at, Model.id), limit, offset)

    def model(self, model_id: str) -> Model:
        """A model by id alone, for the engine (trusted, not owner-scoped, like the other engine-side calls)."""
        with self._read() as s:
            if (row := s.get(Model, model_id)) is None:
                raise NotFound(f"no model {model_id!r}")
            return row

    def model_state(self, model_id: str) -> ModelState | None:
        with self._read() as s:
            return s.get(ModelState, model_id)

    def live_models(self, *, quiet_s: float) -> list[Model]:
        """Models with a saved state whose session is open and has beaten within quiet_s (what an engine restores
        when it starts), most recently used first."""
        cutoff = utcnow() - dt.timedelta(seconds=quiet_s)
        with self._read() as s:
            q = (select(Model).join(ClientSession, Model.session_id == ClientSession.id)
                 .join(ModelState, ModelState.model_id == Model.id)
                 .where(ClientSession.finished_at.is_(None), ClientSession.heartbeat_at >= cutoff)
                 .order_by(Model.last_request_at.desc()))
            return list(s.scalars(q))
