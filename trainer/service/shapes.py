"""The engine's shapes as plain Python (no JAX), shared by the engine's programs and by `fit`'s estimate: which LoRA
targets the slot stack holds, the sequence-length buckets and the row buckets of a pass."""

from __future__ import annotations

from trainer.base.config import LORA_LINEAR_TARGETS, LoraConfig, TrainConfig

ALL_TARGETS: tuple[str, ...] = (*LORA_LINEAR_TARGETS, "lm_head")
ATTN_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")


def stack_config(cfg: TrainConfig) -> LoraConfig:
    """The slot stack: every target (a client picks its own subset), lora.rank columns, lora.slots slots."""
    assert cfg.lora is not None
    return LoraConfig(rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=list(ALL_TARGETS), rslora=cfg.lora.rslora,
                      slots=cfg.lora.slots)


def tinker_targets(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    """A Tinker LoraConfig's train_* flags as PEFT target module names."""
    out = (ATTN_TARGETS if train_attn else ()) + (MLP_TARGETS if train_mlp else ())
    return out + (("lm_head",) if train_unembed else ())


def bucket(n: int, smallest: int, largest: int) -> int:
    """`smallest` x a power of two >= n, capped at `largest` (one compiled program per bucket)."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, largest)


def rows(n: int, data_parallel: int) -> int:
    """The row bucket for n rows: a power of two, rounded up to a multiple of the data-parallel size (each device
    takes whole rows)."""
    b = 1
    while b < n:
        b *= 2
    return -(-b // data_parallel) * data_parallel
