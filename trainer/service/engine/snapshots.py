"""The engine's snapshot writer: a model's state written off the main loop after every request that changes it other
than forward_backward (`persist`, settled by `settle`), and the directories every save goes to, fresh and renamed
into place when complete (see Storage and Durability in engine/loop.py). The checkpoints a user asks for
(engine/checkpoints.py) are written by the same `read_adapter`/`write_adapter`.

It owns the writer thread, the queue of writes that failed and the record of how long each write took; it reads
the store, the slot table (to keep a slot being written from eviction, and to release a slot whose snapshot failed)
and the device state (a slot's weights, read on the main thread)."""

from __future__ import annotations

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

from trainer.base.config import LoraConfig, ModelConfig
from trainer.model import lora as L
from trainer.model.tensors import read_safetensors, write_safetensors
from trainer.service.device import DeviceState
from trainer.service.engine.common import (
    MAX_SNAPSHOT_ATTEMPTS,
    OPTIMIZER_FILE,
    STATE_FILE,
    STATE_KIND,
    Outcome,
    fail,
    log,
)
from trainer.service.slots import Slot, SlotTable
from trainer.service.store import (
    Request,
    StateUpdate,
    Store,
)

# A slot as read to the host: its adapter, Adam moments, one-slot config, step and the slot as it was then.
HostAdapter = tuple[Any, Any, Any, LoraConfig, int, Slot]


class SnapshotWriter:
    """Writes the models' state snapshots (one thread, in order) and every save's directory; see the module
    docstring. `storage`: the checkpoints' root; `state_root`: the snapshots' (service.state_dir)."""

    def __init__(self, store: Store, slots: SlotTable, state: DeviceState, mcfg: ModelConfig, *, worker_id: str,
                 storage: Path, state_root: Path) -> None:
        self.store = store
        self.slots = slots
        self.state = state
        self.mcfg = mcfg
        self.worker_id = worker_id
        self.storage = storage
        self.state_root = state_root
        # Snapshots being written (self.slots.writing), one thread writing them in order, and the ones that failed,
        # for the main loop to settle.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._failed_writes: queue.Queue[tuple[Request, int, Exception]] = queue.Queue()
        # Observability (tests and logs read it): the seconds of each snapshot write, newest last.
        self.persist_seconds: deque[float] = deque(maxlen=1000)

    def persist(self, row: Request, slot: Slot, result: bytes) -> Outcome:
        """Snapshot the slot's state after `row` and complete `row` with it, the snapshot it replaces deleted after.

        The slot is read to the host now; the files are written and the completion committed by the snapshot thread,
        so the engine goes on with other models meanwhile (the model's own next request waits: its seq_id is not
        claimable before this one completes). Until then the slot is neither evicted nor unloaded. A write that fails
        is handed back to the main loop, which drops the slot (its state ran ahead of the committed one) and queues
        the request again (`settle`)."""
        host = self.read_adapter(slot)
        model_id, index = slot.model_id or "", slot.index
        self.slots.writing[index] = model_id

        def write_and_commit() -> None:
            t0 = time.perf_counter()
            try:
                previous = self.store.model_state(model_id)
                path = self.write_adapter(row, STATE_KIND, f"seq{row.seq_id or 0:08d}", host, with_optimizer=True)
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
                self.remove_files(old, release=False)

        self._writer.submit(write_and_commit)
        return Outcome(completed=True)

    def settle(self) -> None:
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
                fail(self.store, self.worker_id, row, f"saving the model's state failed {row.attempts} times: "
                     f"{error!r}", "server")
            else:
                self.store.requeue(row.request_id, worker_id=self.worker_id)

    def shutdown(self) -> None:
        """Wait for the snapshots in flight: they complete their requests (a failed one stays running for the next
        engine's recover)."""
        self._writer.shutdown(wait=True)

    # -- directories and adapters --------------------------------------------------------------------------------

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

    def remove_files(self, storage_path: str, *, release: bool = True) -> None:
        """Delete a save's directory (never one outside our own storage); with `release`, also empty the slots a
        sampler loaded from it (a device op: the main thread)."""
        path = Path(storage_path)
        if self.storage in path.parents or self.state_root in path.parents:  # never delete outside our own storage
            shutil.rmtree(path, ignore_errors=True)
        if release:  # a sampler slot loaded from these files (main thread only: a device op)
            for slot in list(self.slots.values()):
                if slot.storage_path == storage_path:
                    self.slots.release(slot.index)

    def read_adapter(self, slot: Slot) -> HostAdapter:
        """The slot's weights and Adam moments on the host (a device op: the main thread, before the slot changes)."""
        single, m, v = self.state.read_slot(slot.index, slot.rank, slot.targets)
        return single, m, v, self.slots.single_cfg(slot), slot.step, replace(slot)

    def write_adapter(self, row: Request, kind: str, name: str, host: HostAdapter, *, with_optimizer: bool) -> Path:
        """Write what read_adapter read as a PEFT directory (plus optimizer and state files); any thread."""
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

    def read_moments(self, root: Path, single_cfg: LoraConfig) -> tuple[tuple[Any, Any], int]:
        """The Adam moments and step a save with its optimizer holds (what write_adapter wrote)."""
        tensors = read_safetensors(root / OPTIMIZER_FILE)
        state = json.loads((root / STATE_FILE).read_text())
        moments = tuple(
            jax.tree.map(lambda x: np.asarray(x, np.float32), L.adapter_from_tensors(
                {k[len(prefix):]: tensors[k] for k in tensors if k.startswith(prefix)}, self.mcfg, single_cfg,
                root / OPTIMIZER_FILE))
            for prefix in ("exp_avg.", "exp_avg_sq."))
        return (moments[0], moments[1]), int(state["step"])
