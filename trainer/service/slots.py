"""The engine's adapter slots: which model or sampler occupies each slot of the adapter stack, the rank and scale
policy of a slot (in one place), and which slot gives way when every one is taken.

A `SlotTable` is the table the engine's parts read like a dict (slot index -> `Slot`), with the two sets that keep a
slot from being evicted: the slots a batch being assembled uses (`pinned`) and those whose snapshot is being written
(`writing`). A slot is filled (`occupy`) and emptied (`release`) only here, each with its device write
(`DeviceState.write_slot`), so the table and the device never disagree and a freed slot serves nothing.

The rank and scale policy is here too, in one place: a slot holds an adapter of rank at most lora.rank
(`rank_refused`); a new adapter gets the stack's alpha and rsLoRA at its own rank (`new_config`, `scale`); a loaded
one keeps the scale its files say (its own alpha), and its saved config carries that scale back (`single_cfg`).
"""

from __future__ import annotations

import logging
import time
from collections import UserDict
from dataclasses import dataclass, field
from typing import Any

from trainer.base.config import LoraConfig, lora_alpha, lora_scale
from trainer.service.device import DeviceState

log = logging.getLogger(__name__)


class SlotsFull(Exception):
    """Every slot is in use by the batch being assembled or a snapshot being written: none can be given up."""


@dataclass
class Slot:
    """What occupies an adapter slot: a client's model, or a sampler checkpoint loaded for sampling."""

    index: int
    rank: int
    targets: tuple[str, ...]
    scale: float
    model_id: str | None = None  # a training model
    owner_id: str | None = None
    session_id: str | None = None
    step: int = 0  # AdamW steps taken
    storage_path: str | None = None  # a sampler checkpoint
    last_used: float = field(default_factory=time.monotonic)


class SlotTable(UserDict[int, Slot]):
    """The occupied slots of one adapter stack (`stack`: its slot count, largest rank, alpha and rsLoRA), by index."""

    def __init__(self, state: DeviceState, stack: LoraConfig) -> None:
        super().__init__()
        self.state = state
        self.stack = stack
        self.pinned: set[int] = set()  # slots a batch being assembled uses: never evicted for another model
        # Slots whose snapshot is being written (slot -> model id): never evicted or unloaded meanwhile.
        self.writing: dict[int, str] = {}

    def find(self, model_id: str) -> Slot | None:
        """The model's slot (now its most recently used), or None."""
        for slot in self.values():
            if slot.model_id == model_id:
                slot.last_used = time.monotonic()
                return slot
        return None

    def free(self) -> int:
        """A free slot; else one taken from a sampler, then from the least recently used training model (its state
        is saved, so it comes back on its next request), never a pinned one or one being written."""
        for i in range(self.stack.slots):
            if i not in self:
                return i
        for training in (False, True):
            victims = [s for s in self.values() if (s.model_id is not None) == training
                       and s.index not in self.pinned and s.index not in self.writing]
            if victims:
                victim = min(victims, key=lambda s: s.last_used)
                log.info("evicting %s from slot %d", victim.model_id or victim.storage_path, victim.index)
                self.release(victim.index)
                return victim.index
        raise SlotsFull(f"all {self.stack.slots} adapter slots of this server are in use by this batch (lora.slots)")

    def occupy(self, slot: Slot, single: Any, single_cfg: LoraConfig, moments: tuple[Any, Any] | None = None) -> Slot:
        """Put `slot` in the table, its adapter (`single`, a one-slot adapter of `single_cfg`, NumPy) and AdamW moments
        (or zeros) written to the device at the slot's scale (a device op: the main thread)."""
        self.state.write_slot(slot.index, slot.scale, single, single_cfg, moments)
        self[slot.index] = slot
        return slot

    def release(self, index: int) -> None:
        """Empty slot `index`, zeroed on the device (a device op: the main thread)."""
        self.pop(index, None)
        self.state.write_slot(index, 0.0, {}, LoraConfig(rank=1, slots=1))

    # -- the rank and scale policy ------------------------------------------------------------------------------

    def rank_refused(self, rank: int) -> str | None:
        """Why a slot cannot hold an adapter of this rank, or None."""
        if not 0 < rank <= self.stack.rank:
            return (f"LoRA rank {rank} is not supported: this server's adapters have rank at most "
                    f"{self.stack.rank} (lora.rank)")
        return None

    def scale(self, rank: int) -> float:
        """The scale of a new adapter of this rank: the stack's alpha (and rsLoRA) at that rank."""
        return lora_scale(self.stack.alpha, rank, self.stack.rslora)

    def new_config(self, rank: int, targets: tuple[str, ...]) -> LoraConfig:
        """The one-slot config of a new adapter of this rank and these targets (its scale is `scale(rank)`)."""
        return LoraConfig(rank=rank, alpha=self.stack.alpha, targets=list(targets), rslora=self.stack.rslora, slots=1)

    def single_cfg(self, slot: Slot) -> LoraConfig:
        """The one-slot config of what `slot` holds (its rank, targets and scale, as an alpha)."""
        return LoraConfig(rank=slot.rank, alpha=lora_alpha(slot.scale, slot.rank, self.stack.rslora),
                          targets=list(slot.targets), rslora=self.stack.rslora, slots=1)
