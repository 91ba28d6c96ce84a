"""The engine's snapshot writer: model state snapshots written off the main loop (`_persist`, settled by
`_settle_writes`) and the checkpoints (save_weights, for a sampler, external; delete), in fresh directories renamed
into place (see Storage and Durability in engine/loop.py)."""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tinker import types

from trainer.base.config import LoraConfig
from trainer.model import lora as L
from trainer.model.tensors import read_safetensors, write_safetensors
from trainer.service import protocol
from trainer.service.engine.common import (
    MAX_SNAPSHOT_ATTEMPTS,
    OPTIMIZER_FILE,
    STATE_FILE,
    STATE_KIND,
    EnginePart,
    Outcome,
    UserError,
    _dir_size,
    log,
)
from trainer.service.slots import Slot
from trainer.service.store import (
    Conflict,
    NotFound,
    Request,
    StateUpdate,
    sampling_session_id_for,
    tinker_path,
)


class SnapshotWriter(EnginePart):
    """Part of the Engine (engine/loop.py): the state it reads (store, slots, storage, the writer thread) is the
    engine's."""

    # The rest of the engine's state this part reads (set in Engine.__init__, engine/loop.py).
    worker_id: str
    storage: Path
    state_root: Path
    persist_seconds: deque[float]
    _writer: ThreadPoolExecutor
    _failed_writes: queue.Queue[tuple[Request, int, Exception]]

    def _persist(self, row: Request, slot: Slot, result: bytes) -> Outcome:
        """Snapshot the slot's state after `row` and complete `row` with it, the snapshot it replaces deleted after.

        The slot is read to the host now; the files are written and the completion committed by the snapshot thread,
        so the engine goes on with other models meanwhile (the model's own next request waits: its seq_id is not
        claimable before this one completes). Until then the slot is neither evicted nor unloaded. A write that fails
        is handed back to the main loop, which drops the slot (its state ran ahead of the committed one) and queues
        the request again (`_settle_writes`)."""
        host = self._read_adapter(slot)
        model_id, index = slot.model_id or "", slot.index
        self.slots.writing[index] = model_id

        def write_and_commit() -> None:
            t0 = time.perf_counter()
            try:
                previous = self.store.model_state(model_id)
                path = self._write_adapter(row, STATE_KIND, f"seq{row.seq_id or 0:08d}", host, with_optimizer=True)
                self.store.complete(row.request_id, result, worker_id=self.worker_id,
                                    state=StateUpdate(model_id, row.seq_id or 0, host[4], str(path)))
            except Exception as e:  # noqa: BLE001 - e.g. the bucket or the database unreachable for a moment
                log.exception("snapshot of %s after seq %s failed", model_id, row.seq_id)
                self._failed_writes.put((row, index, e))
                return
            finally:
                self.persist_seconds.append(time.perf_counter() - t0)
                self.slots.writing.pop(index, None)
            old = previous.storage_path if previous is not None else None
            if old and self.state_root in Path(old).parents:
                self._remove_files(old, release=False)

        self._writer.submit(write_and_commit)
        return Outcome(completed=True)

    def _settle_writes(self) -> None:
        """On the main loop: requests whose snapshot failed run again on the model rebuilt from its committed state."""
        while True:
            try:
                row, index, error = self._failed_writes.get_nowait()
            except queue.Empty:
                return
            slot = self.slots.get(index)
            if slot is not None and slot.model_id == row.model_id:
                self.slots.release(index)
            if row.attempts >= MAX_SNAPSHOT_ATTEMPTS:
                self._fail(row, f"saving the model's state failed {row.attempts} times: {error!r}", "server")
            else:
                self.store.requeue(row.request_id, worker_id=self.worker_id)


    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _write_dir(self, owner_id: str, model_id: str, kind: str, name: str, write: Callable[[Path], None]) -> Path:
        """A fresh directory for one save, filled by `write` under a temporary name and renamed into place."""
        model_dir = Path(owner_id) / model_id.replace(":", "_")
        # Snapshots have a root of their own (service.state_dir): the stack puts it on a bucket that keeps no old
        # versions, as one is replaced at every optim_step.
        where = self.state_root / model_dir if kind == STATE_KIND else self.storage / model_dir / kind
        final = where / f"{name}-{uuid.uuid4().hex[:12]}"
        tmp = final.with_name(final.name + ".partial")
        tmp.mkdir(parents=True)
        try:
            write(tmp)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _remove_files(self, storage_path: str, *, release: bool = True) -> None:
        path = Path(storage_path)
        if self.storage in path.parents or self.state_root in path.parents:  # never delete outside our own storage
            shutil.rmtree(path, ignore_errors=True)
        if release:  # a sampler slot loaded from these files (main thread only: a device op)
            for slot in list(self.slots.values()):
                if slot.storage_path == storage_path:
                    self.slots.release(slot.index)

    def _record(self, row: Request, name: str, kind: str, path: Path, req: Any, result: bytes,
                sampler_seq_id: int | None = None) -> Outcome:
        """Add the checkpoint row and complete the request in one transaction; on overwrite the files it replaces are
        deleted, on a conflict ours are."""
        previous = None
        with contextlib.suppress(NotFound):
            previous = self.store.get_checkpoint(row.owner_id, tinker_path(row.model_id or "", kind, name))  # type: ignore[arg-type]
        try:
            ckpt = self.store.add_checkpoint(
                row.owner_id, row.model_id or "", name, kind, str(path), size_bytes=_dir_size(path),  # type: ignore[arg-type]
                ttl_seconds=req.ttl_seconds, overwrite=getattr(req, "overwrite", False),
                user_metadata=getattr(req, "user_metadata", None), sampler_seq_id=sampler_seq_id,
                completes=(row.request_id, self.worker_id, result))
        except Conflict as e:
            self._remove_files(str(path))
            raise UserError(f"{e}; pass overwrite=True to replace it") from None
        except ValueError:
            self._remove_files(str(path))
            raise
        assert ckpt.tinker_path == tinker_path(row.model_id or "", kind, name)  # type: ignore[arg-type]
        then = None
        if previous is not None and previous.storage_path != str(path):
            then = lambda: self._remove_files(previous.storage_path)  # noqa: E731
        return Outcome(completed=True, then=then)

    def _save_adapter(self, row: Request, kind: str, name: str, *, with_optimizer: bool) -> Path:
        return self._write_adapter(row, kind, name, self._read_adapter(self._model_slot(row.model_id or "")),
                                   with_optimizer=with_optimizer)

    def _read_adapter(self, slot: Slot) -> tuple[Any, Any, Any, LoraConfig, int, Slot]:
        """The slot's weights and Adam moments on the host (a device op: the main thread, before the slot changes)."""
        single, m, v = self.state.read_slot(slot.index, slot.rank, slot.targets)
        return single, m, v, self.slots.single_cfg(slot), slot.step, replace(slot)

    def _write_adapter(self, row: Request, kind: str, name: str, host: tuple[Any, Any, Any, LoraConfig, int, Slot], *,
                       with_optimizer: bool) -> Path:
        """Write what _read_adapter read as a PEFT directory (plus optimizer and state files); any thread."""
        single, m, v, single_cfg, step, slot = host
        base = self.store.get_model(row.owner_id, row.model_id or "").base_model

        def write(d: Path) -> None:
            L.export_peft(single, single_cfg, d, base_model_name_or_path=base)
            if with_optimizer:
                tensors = {f"exp_avg.{k}": t for k, t in L.peft_tensors(m).items()}
                tensors |= {f"exp_avg_sq.{k}": t for k, t in L.peft_tensors(v).items()}
                write_safetensors(d / OPTIMIZER_FILE, tensors, {"format": "pt"})
                state = {"step": step, "rank": slot.rank, "targets": list(slot.targets), "scale": slot.scale}
                (d / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

        return self._write_dir(row.owner_id, row.model_id or "", kind, name, write)

    def _read_moments(self, root: Path, single_cfg: LoraConfig) -> tuple[tuple[Any, Any], int]:
        tensors = read_safetensors(root / OPTIMIZER_FILE)
        state = json.loads((root / STATE_FILE).read_text())
        moments = tuple(
            jax.tree.map(lambda x: np.asarray(x, np.float32), L.adapter_from_tensors(
                {k[len(prefix):]: tensors[k] for k in tensors if k.startswith(prefix)}, self.mcfg, single_cfg,
                root / OPTIMIZER_FILE))
            for prefix in ("exp_avg.", "exp_avg_sq."))
        return (moments[0], moments[1]), int(state["step"])

    def _save_weights(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        name = req.path or f"step{self._model_slot(row.model_id or '').step:06d}"
        path = self._save_adapter(row, "weights", name, with_optimizer=True)
        result = protocol.json_result(types.SaveWeightsResponse(path=tinker_path(row.model_id or "", "training",
                                                                                 name)))
        return self._record(row, name, "training", path, req, result)

    def _save_weights_for_sampler(self, row: Request) -> Outcome:
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

    def _save_weights_external(self, row: Request) -> Outcome:
        # The PEFT adapter alone, as for sampler weights: the HF format the SDK documents for external weights.
        req = protocol.decode_json(row.kind, row.body)
        path = self._save_adapter(row, "external_weights", req.path, with_optimizer=False)
        result = protocol.json_result(types.SaveWeightsExternalResponseInternal(
            path=tinker_path(row.model_id or "", "external", req.path), size_bytes=_dir_size(path)))
        return self._record(row, req.path, "external", path, req, result)

    def _delete_checkpoint(self, row: Request) -> bytes:
        req = protocol.decode_json(row.kind, row.body)
        self._remove_files(req.storage_path)
        return protocol.json_result({})
