"""The engine's checkpoints: save_weights (the PEFT adapter with its optimizer), for a sampler, external, and
delete_checkpoint. Each save reads the model's slot (rebuilt first if it is in none: `Models.slot`), writes a fresh
directory through the snapshot writer and adds its checkpoint row in the transaction that completes the request
(see Storage in engine/loop.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tinker import types

from trainer.service import protocol
from trainer.service.engine.common import (
    Outcome,
    UserError,
    _dir_size,
)
from trainer.service.engine.models import Models
from trainer.service.engine.snapshots import SnapshotWriter
from trainer.service.store import (
    CheckpointKind,
    Conflict,
    NotFound,
    Request,
    Store,
    sampling_session_id_for,
    tinker_path,
)


class Checkpoints:
    """The checkpoint requests' handlers: they hold no state of their own, only what they read (the store, the
    models, the snapshot writer)."""

    def __init__(self, store: Store, models: Models, snapshots: SnapshotWriter, *, worker_id: str) -> None:
        self.store = store
        self.models = models
        self.snapshots = snapshots
        self.worker_id = worker_id

    def save_weights(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        name = req.path or f"step{self.models.slot(row.model_id or '').step:06d}"
        path = self._save_adapter(row, "weights", name, with_optimizer=True)
        result = protocol.json_result(types.SaveWeightsResponse(path=tinker_path(row.model_id or "", "training",
                                                                                 name)))
        return self._record(row, name, "training", path, req, result)

    def save_weights_for_sampler(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        model_id = row.model_id or ""
        if req.path is not None:
            path = self._save_adapter(row, "sampler_weights", req.path, with_optimizer=False)
            result = protocol.json_result({"path": tinker_path(model_id, "sampler", req.path)})
            return self._record(row, req.path, "sampler", path, req, result)
        if req.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a path or a sampling_session_seq_id")
        name = protocol.ephemeral_sampler_name(req.sampling_session_seq_id, row.seq_id or 0)
        path = self._save_adapter(row, "sampler_weights", name, with_optimizer=False)
        model = self.store.get_model(row.owner_id, model_id)
        sampler_id = sampling_session_id_for(model.session_id, req.sampling_session_seq_id)
        result = protocol.json_result({"sampling_session_id": sampler_id,
                                       "path": tinker_path(model_id, "sampler", name)})
        return self._record(row, name, "sampler", path, req, result, sampler_seq_id=req.sampling_session_seq_id)

    def save_weights_external(self, row: Request) -> Outcome:
        # The PEFT adapter alone, as for sampler weights: the HF format the SDK documents for external weights.
        req = protocol.decode_json(row.kind, row.body)
        path = self._save_adapter(row, "external_weights", req.path, with_optimizer=False)
        result = protocol.json_result(types.SaveWeightsExternalResponseInternal(
            path=tinker_path(row.model_id or "", "external", req.path), size_bytes=_dir_size(path)))
        return self._record(row, req.path, "external", path, req, result)

    def delete_checkpoint(self, row: Request) -> bytes:
        req = protocol.decode_json(row.kind, row.body)
        self.snapshots.remove_files(req.storage_path)
        return protocol.json_result({})

    def _save_adapter(self, row: Request, kind: str, name: str, *, with_optimizer: bool) -> Path:
        slot = self.models.slot(row.model_id or "")
        return self.snapshots.write_adapter(row, kind, name, self.snapshots.read_adapter(slot),
                                            with_optimizer=with_optimizer)

    def _record(self, row: Request, name: str, kind: CheckpointKind, path: Path, req: Any, result: bytes,
                sampler_seq_id: int | None = None) -> Outcome:
        """Add the checkpoint row and complete the request in one transaction; on overwrite the files it replaces are
        deleted, on a conflict ours are."""
        previous = None
        with contextlib.suppress(NotFound):
            previous = self.store.get_checkpoint(row.owner_id, tinker_path(row.model_id or "", kind, name))
        try:
            ckpt = self.store.add_checkpoint(
                row.owner_id, row.model_id or "", name, kind, str(path), size_bytes=_dir_size(path),
                ttl_seconds=req.ttl_seconds, overwrite=getattr(req, "overwrite", False),
                user_metadata=getattr(req, "user_metadata", None), sampler_seq_id=sampler_seq_id,
                completes=(row.request_id, self.worker_id, result))
        except Conflict as e:
            self.snapshots.remove_files(str(path))
            raise UserError(f"{e}; pass overwrite=True to replace it") from None
        except ValueError:
            self.snapshots.remove_files(str(path))
            raise
        assert ckpt.tinker_path == tinker_path(row.model_id or "", kind, name)
        then = None
        if previous is not None and previous.storage_path != str(path):
            then = lambda: self.snapshots.remove_files(previous.storage_path)  # noqa: E731
        return Outcome(completed=True, then=then)
