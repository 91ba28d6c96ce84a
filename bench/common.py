"""Shared bench helpers: timing, the machine's measured matmul peak, a machine description, model FLOPs."""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from trainer.base.config import ModelConfig


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Best-of-`repeats` wall seconds of `fn()` (blocked until its outputs are ready), after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak_flops(
    sizes: tuple[int, ...] = (1024, 2048, 3072, 4096), rounds: int = 2, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """Measured FLOP/s of a square jitted jnp.dot (2 n^3 FLOPs) over a few sizes and rounds.

    The peak is the best of all; on a small shared CPU VM single measurements swing by 2x (XLA's thread
    pool does not always spread one dot over both cores), so the spread is reported too."""
    seen: list[tuple[int, float]] = []
    for _ in range(rounds):
        for n in sizes:
            ka, kb = jax.random.split(jax.random.key(n))
            a = jax.random.normal(ka, (n, n), dtype)
            b = jax.random.normal(kb, (n, n), dtype)
            f = jax.jit(jnp.dot)
            reps = min(20, max(3, int(2e10 // (2 * n**3))))
            seen.append((n, 2 * n**3 / timed(functools.partial(f, a, b), repeats=reps)))
    best_n, best = max(seen, key=lambda x: x[1])
    return {"peak_flops": best, "best_n": best_n, "min_flops": min(f for _, f in seen), "dtype": str(jnp.dtype(dtype))}


def machine() -> str:
    dev = jax.devices()[0]
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    # Other work on the box skews every figure; the load average says whether the run had it to itself.
    load = os.getloadavg()[0]
    return (
        f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores; "
        f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}), {jax.device_count()} device(s); "
        f"load average at start {load:.2f}"
    )


def layer_params(cfg: ModelConfig) -> int:
    """Matmul parameters of the decoder layers (attention + SwiGLU), excluding embedding and LM head."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    return cfg.n_layers * (attn + 3 * cfg.d_model * cfg.d_ff)


def update_flops(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of one RL update (forward + backward = 3x forward) on [batch, prompt_len + new_tokens]:
    6 N per token for the layers, the attention term 12 L H Dh T per token (PaLM appendix B; full T x T,
    not halved for the causal mask), and 6 V D only on the completion positions, the only ones the loss
    computes logits for."""
    seq = prompt_len + new_tokens
    tokens = batch * seq
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq
    return tokens * (6 * layer_params(cfg) + attention) + 6 * cfg.vocab_size * cfg.d_model * batch * new_tokens


def bench_config() -> ModelConfig:
    """The model both benches use: ~3.2M params, GQA, char vocab (large enough to be matmul-bound on CPU)."""
    return ModelConfig(
        vocab_size=100,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        d_ff=768,
        max_seq_len=512,
        tie_embeddings=True,
        param_dtype="float32",
    )
