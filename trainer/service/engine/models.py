"""The engine's models: their slots (found, rebuilt from the saved state, or a free one), create_model, the restore
after a restart or an eviction (the snapshot, then the forward_backward requests since), load_weights and optim_step.

`Models` owns the record of the restores it ran (observability). It reads the store, the slot table (which holds
the rank and scale policy), the device state, the snapshot writer (a changed model's state is persisted; a saved
one's moments are read back) and the passes (a restore replays the forward_backward requests since the snapshot)."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
from tinker import types

from trainer.base.config import ModelConfig, ServiceConfig
from trainer.model import lora as L
from trainer.service import programs as P
from trainer.service import protocol
from trainer.service.device import DeviceState
from trainer.service.engine.batches import Passes
from trainer.service.engine.common import (
    MODEL_STATE_LOST,
    OPTIMIZER_FILE,
    Outcome,
    UserError,
    _stable_int,
    log,
)
from trainer.service.engine.snapshots import SnapshotWriter
from trainer.service.shapes import tinker_targets
from trainer.service.slots import Slot, SlotsFull, SlotTable
from trainer.service.store import (
    Model,
    Request,
    StateUpdate,
    Store,
)


class Models:
    """The client models on the adapter stack (see the module docstring): `slot` finds or rebuilds one; the
    request handlers create, load and step one."""

    def __init__(self, store: Store, slots: SlotTable, state: DeviceState, mcfg: ModelConfig, service: ServiceConfig,
                 *, snapshots: SnapshotWriter, passes: Passes) -> None:
        self.store = store
        self.slots = slots
        self.state = state
        self.mcfg = mcfg
        self.service = service
        self.snapshots = snapshots
        self.passes = passes
        # Observability (tests and logs read it): (model id, forward_backward requests replayed, seconds), newest last.
        self.restores: list[tuple[str, int, float]] = []

    # -- slots ---------------------------------------------------------------------------------------------------

    def slot(self, model_id: str) -> Slot:
        """The model's slot, rebuilt from its saved state if it is not in one (see Durability in engine/loop.py)."""
        return self.slots.find(model_id) or self._restore(model_id)

    def free_slot(self) -> int:
        """A free slot (SlotTable.free: maybe another model's, evicted), or the request fails as the caller's."""
        try:
            return self.slots.free()
        except SlotsFull as e:
            raise UserError(str(e)) from None

    def check_rank(self, rank: int) -> None:
        """The request fails as the caller's when a slot cannot hold an adapter of this rank."""
        if (why := self.slots.rank_refused(rank)) is not None:
            raise UserError(why)

    def served(self, base_model: str) -> None:
        """The request fails as the caller's unless this engine serves `base_model`."""
        # One engine serves one base model; an API that lists more needs an engine for each (issue 19 routes them).
        if base_model != self.service.base_model:
            raise UserError(f"base model {base_model!r} is not served by this engine (it serves "
                            f"{self.service.base_model!r})")

    # -- models --------------------------------------------------------------------------------------------------

    def create_model(self, row: Request) -> Outcome:
        model = self.store.get_model(row.owner_id, row.model_id or "")
        self.served(model.base_model)
        if (old := self.slots.find(model.id)) is not None:  # a re-run after a restart that restored it
            self.slots.release(old.index)
        self._init_adapter(model, self.free_slot())
        state = StateUpdate(model.id, row.seq_id or 0, 0, None)
        return Outcome(protocol.json_result(types.CreateModelResponse(model_id=model.id)), state)

    def _init_adapter(self, model: Model, index: int) -> Slot:
        """The model's initial adapter (its lora_config and seed) in slot `index`: create_model, and its restore."""
        lc = types.LoraConfig.model_validate(model.lora_config or {"rank": 32})
        self.check_rank(lc.rank)
        targets = tinker_targets(lc.train_attn, lc.train_mlp, lc.train_unembed)
        if not targets:
            raise UserError("lora_config trains nothing: set train_attn, train_mlp or train_unembed")
        scale = self.slots.scale(lc.rank)
        single_cfg = self.slots.new_config(lc.rank, targets)
        seed = lc.seed if lc.seed is not None else _stable_int(model.id)
        single = jax.device_get(L.init_lora(self.mcfg, single_cfg, jax.random.PRNGKey(seed)))
        single = jax.tree.map(lambda x: np.asarray(x, np.float32), single)
        slot = Slot(index, lc.rank, targets, scale, model_id=model.id, owner_id=model.owner_id,
                    session_id=model.session_id)
        return self.slots.occupy(slot, single, single_cfg)

    def _restore(self, model_id: str) -> Slot:
        """Rebuild a model that is in no slot: its saved state, then the forward_backward requests done since."""
        t0 = time.perf_counter()
        state = self.store.model_state(model_id)
        if state is None:
            raise UserError(MODEL_STATE_LOST)
        model = self.store.model(model_id)
        self.served(model.base_model)
        index = self.free_slot()
        if state.storage_path is None:
            slot = self._init_adapter(model, index)
        else:
            slot = self._load_dir(model, index, Path(state.storage_path), with_optimizer=True)
        slot.step = state.step
        replay = self.store.replay_log(model_id, state.seq_id, (protocol.FORWARD_BACKWARD,))
        if replay:
            self.slots.pinned.add(index)
            try:
                self.passes.replay(replay, index)
            finally:
                self.slots.pinned.discard(index)
        seconds = time.perf_counter() - t0
        self.restores.append((model_id, len(replay), seconds))
        log.info("restored %s at step %d (after seq %d) and replayed %d forward_backward in %.2f s", model_id,
                 state.step, state.seq_id, len(replay), seconds)
        return slot

    def _load_dir(self, model: Model, index: int, root: Path, *, with_optimizer: bool) -> Slot:
        """A saved adapter (and its Adam moments and step) into slot `index` for `model`."""
        single, single_cfg = L.import_peft(root, self.mcfg)
        self.check_rank(single_cfg.rank)
        moments, step = self.snapshots.read_moments(root, single_cfg) if with_optimizer else (None, 0)
        scale = single_cfg.scale  # a saved adapter keeps its own scale (the alpha its files say)
        slot = Slot(index, single_cfg.rank, tuple(single_cfg.targets), scale, model_id=model.id,
                    owner_id=model.owner_id, session_id=model.session_id, step=step)
        return self.slots.occupy(slot, jax.tree.map(lambda x: np.asarray(x, np.float32), single), single_cfg, moments)

    def load_weights(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        ckpt = self.store.get_checkpoint(row.owner_id, req.path)
        root = Path(ckpt.storage_path)
        if req.optimizer and not (root / OPTIMIZER_FILE).is_file():
            raise UserError(f"{req.path} holds no optimizer state (a sampler checkpoint); load it without the "
                            "optimizer")
        model = self.store.get_model(row.owner_id, row.model_id or "")
        self.served(model.base_model)
        # The load replaces the whole state: no need to rebuild the old one first.
        old = self.slots.find(model.id)
        slot = self._load_dir(model, old.index if old is not None else self.free_slot(), root,
                              with_optimizer=req.optimizer)
        # A copy of its own as the model's state: the user may delete the checkpoint it came from.
        return self.snapshots.persist(row, slot, protocol.json_result(
            types.LoadWeightsResponse(path=req.path, model_id=model.id)))

    def optim_step(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        p = req.optim_params
        if not isinstance(p, types.AdamParams):
            raise UserError(f"optimizer {getattr(p, 'type', type(p).__name__)!r} is not supported; use AdamParams")
        if not (p.learning_rate >= 0 and 0 <= p.beta1 < 1 and 0 <= p.beta2 < 1 and p.eps > 0
                and p.weight_decay >= 0 and p.grad_clip_norm >= 0):
            raise UserError(f"AdamParams out of range: {p.model_dump()}")
        slot = self.slot(row.model_id or "")
        slot.step += 1
        hyper = P.AdamHyper(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
        norm = self.state.optim(slot.index, slot.step, hyper.array())
        metrics = {"grad_norm:mean": norm, "learning_rate:mean": p.learning_rate}
        return self.snapshots.persist(row, slot, protocol.json_result(types.OptimStepResponse(metrics=metrics)))
