"""AdamW (or Adafactor) with linear warmup + cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import optax

from trainer.base.config import OptimConfig


def make_schedule(cfg: OptimConfig, total_updates: int, updates_per_step: int = 1) -> optax.Schedule:
    """Schedule over optimizer updates; warmup is given in training steps (each = updates_per_step updates)."""
    warmup = cfg.warmup_steps * updates_per_step
    decay = max(total_updates, warmup + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=decay,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int, updates_per_step: int = 1,
                   clip: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
    """The optimizer after a gradient clip: `clip`, by default the global-norm clip to cfg.clip_norm."""
    schedule = make_schedule(cfg, total_steps * updates_per_step, updates_per_step)
    if cfg.name == "adafactor":
        # clipping_threshold=None: the global-norm clip below is the one clip, as for AdamW.
        inner = optax.adafactor(schedule, multiply_by_parameter_scale=False, clipping_threshold=None,
                                momentum=None, weight_decay_rate=cfg.weight_decay or None)
    else:
        inner = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    return optax.chain(clip or optax.clip_by_global_norm(cfg.clip_norm), inner)
