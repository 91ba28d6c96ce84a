"""The engine's slot table (trainer/service/slots.py) on its own, over a device state that records its writes: the
rank and scale policy, filling and emptying a slot with its device write, and which slot gives way when all are
taken. No programs run: the engine tests (test_engine.py) run the same table on the device."""

from __future__ import annotations

import math
from typing import Any

import pytest

from trainer.base.config import LoraConfig
from trainer.service.slots import Slot, SlotsFull, SlotTable


class _Device:
    """Stands in for DeviceState: records each write_slot (index, scale, the adapter, its config, the moments)."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, float, Any, LoraConfig, Any]] = []

    def write_slot(self, index: int, scale: float, single: Any, single_cfg: LoraConfig,
                   moments: tuple[Any, Any] | None = None) -> None:
        self.writes.append((index, scale, single, single_cfg, moments))


def _table(*, slots: int = 3, rank: int = 8, alpha: float = 32.0, rslora: bool = False) -> tuple[SlotTable, _Device]:
    device = _Device()
    return SlotTable(device, LoraConfig(rank=rank, alpha=alpha, slots=slots, rslora=rslora)), device  # type: ignore[arg-type]


@pytest.mark.parametrize("rslora", [False, True])
def test_a_new_adapter_gets_the_stacks_alpha_at_its_own_rank_and_its_saved_config_gives_the_scale_back(
        rslora: bool) -> None:
    table, _ = _table(alpha=32.0, rslora=rslora)
    for rank in (1, 4, 8):
        want = 32.0 / (math.sqrt(rank) if rslora else rank)
        assert table.scale(rank) == pytest.approx(want)
        cfg = table.new_config(rank, ("q_proj", "v_proj"))
        assert (cfg.rank, tuple(cfg.targets), cfg.rslora, cfg.slots) == (rank, ("q_proj", "v_proj"), rslora, 1)
        assert cfg.scale == pytest.approx(table.scale(rank))
        # A slot at any scale (a loaded adapter keeps its own) is saved with an alpha that gives that scale back.
        for scale in (want, 0.75):
            saved = table.single_cfg(Slot(0, rank, ("q_proj",), scale))
            assert (saved.rank, tuple(saved.targets), saved.rslora) == (rank, ("q_proj",), rslora)
            assert saved.scale == pytest.approx(scale)


def test_ranks_above_the_stacks_are_refused_naming_the_limit() -> None:
    table, _ = _table(rank=8)
    assert table.rank_refused(1) is None and table.rank_refused(8) is None
    for rank in (0, 9, 16):
        why = table.rank_refused(rank)
        assert why is not None and f"LoRA rank {rank} is not supported" in why and "at most 8 (lora.rank)" in why


def test_a_slot_is_filled_and_emptied_with_its_device_write() -> None:
    table, device = _table()
    cfg = table.new_config(4, ("q_proj",))
    slot = Slot(1, 4, ("q_proj",), table.scale(4), model_id="m1")
    moments = ({"m": 1}, {"v": 2})
    assert table.occupy(slot, {"w": 0}, cfg, moments) is slot
    assert table[1] is slot and table.find("m1") is slot and table.find("m2") is None
    assert device.writes == [(1, slot.scale, {"w": 0}, cfg, moments)]
    table.release(1)
    assert 1 not in table and not table
    index, scale, single, _, written_moments = device.writes[-1]
    assert (index, scale, single, written_moments) == (1, 0.0, {}, None)  # zeroed: a freed slot serves nothing


def test_a_full_table_gives_up_a_sampler_first_then_the_least_recently_used_model_never_a_pinned_or_written_one(
        ) -> None:
    table, device = _table(slots=3)
    cfg = table.new_config(2, ("q_proj",))
    for i, (model, path, used) in enumerate([("old", None, 1.0), (None, "ckpt", 5.0), ("new", None, 3.0)]):
        table.occupy(Slot(i, 2, ("q_proj",), 1.0, model_id=model, storage_path=path, last_used=used), {}, cfg)
    assert table.free() == 1  # the sampler checkpoint, though used last
    assert 1 not in table and device.writes[-1][:2] == (1, 0.0)
    table.occupy(Slot(1, 2, ("q_proj",), 1.0, model_id="newest", last_used=9.0), {}, cfg)
    table.pinned.add(0)  # the least recently used model is in the batch being assembled
    assert table.free() == 2  # so the next least recently used goes
    table.occupy(Slot(2, 2, ("q_proj",), 1.0, model_id="again", last_used=10.0), {}, cfg)
    table.writing[1] = "newest"
    table.writing[2] = "again"
    with pytest.raises(SlotsFull, match=r"all 3 adapter slots of this server are in use by this batch \(lora.slots\)"):
        table.free()
    table.pinned.clear()
    assert table.free() == 0
