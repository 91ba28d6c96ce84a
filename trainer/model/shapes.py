"""The decoder's weight shapes, from the model config alone: trainer/model/decoder.py initialises, casts and shards
these, and trainer/fit/flops.py counts them without importing JAX (a plan's grace check counts a model's parameters,
and a plan never imports JAX: 2-3 CPU-s a process)."""

from __future__ import annotations

from typing import Any

from trainer.base.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    L, D, H, K, E, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                           cfg.vocab_size)
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (L, D),
        "wq": (L, D, H, E),
        "wk": (L, D, K, E),
        "wv": (L, D, K, E),
        "wo": (L, H, E, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if cfg.qk_norm:
        layers["q_norm"] = (L, E)
        layers["k_norm"] = (L, E)
    if cfg.qkv_bias:
        layers["bq"] = (L, H, E)
        layers["bk"] = (L, K, E)
        layers["bv"] = (L, K, E)
    shapes: dict[str, Any] = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes
