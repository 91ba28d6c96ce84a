"""Analytic FLOPs of the trainer's programs: what they execute (every loop iteration, remat and padded log-prob
chunks included) and the model FLOPs MFU is quoted in. XLA's cost analysis counts each loop body once on TPU, so
the preflight needs these (see trainer/fit/preflight.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.base.config import ModelConfig, TrainConfig


def attention_flops(m: ModelConfig, pairs: float) -> float:
    """One layer's attention matmul FLOPs over `pairs` (query, key) pairs: QK^T and PV, 2 FLOPs per multiply-add."""
    return 4 * m.n_heads * m.head_dim * pairs


def _fwd_flops(m: ModelConfig, tokens: float, pairs: float, logit_rows: float) -> float:
    """Matmul FLOPs of one forward pass of one row: `tokens` through every layer, `pairs` (query, key) pairs of
    attention per layer, `logit_rows` positions through the output head."""
    per_layer = m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + m.n_heads * m.head_dim * m.d_model
    per_layer += 3 * m.d_model * m.d_ff
    return m.n_layers * (2 * per_layer * tokens + attention_flops(m, pairs)) + 2 * m.d_model * m.vocab_size * logit_rows


def rope_flops(m: ModelConfig, tokens: float, dtype: str) -> float:
    """RoPE's rotate_half of q and k as a product with a [E, E] signed permutation (trainer/model/decoder.py: one fused
    pass on TPU), every layer, in the activation dtypes that rotate so: executed work, not model FLOPs."""
    from trainer.model.decoder import rotates_by_product

    if not rotates_by_product(dtype):
        return 0.0
    return m.n_layers * 2 * m.head_dim**2 * (m.n_heads + m.n_kv_heads) * tokens


def param_count(m: ModelConfig) -> int:
    """Without JAX: a plan's grace check (infra/checks/grace.py) calls it, and a plan imports no JAX."""
    from trainer.model.shapes import param_shapes

    def count(tree: Any) -> int:  # dicts of shape tuples
        return math.prod(tree) if isinstance(tree, tuple) else sum(count(v) for v in tree.values())

    return count(param_shapes(m))


@dataclass(frozen=True)
class StepFlops:
    """Per RL step, all devices: executed FLOPs per program, model FLOPs per program, sampler phases per row."""

    executed: dict[str, float]
    model: dict[str, float]
    prefill_row: float  # executed, one row
    decode_row: float  # executed, one row, one decode step


def decode_blocks(cfg: TrainConfig) -> tuple[float, int] | None:
    """The cache blocks a decode step reads (compute.decode_block) on average over a step whose every row generates
    max_new_tokens (token i of every row at slot P + i), and at most; None where it reads the whole cache at once."""
    P, N, block = cfg.prompt_len, cfg.sampling.max_new_tokens, cfg.compute.decode_block
    most = -(-(P + N) // block) if block else 1
    if most <= 1:
        return None
    return sum(min(most, (P + i) // block + 1) for i in range(N)) / N, most


def step_flops(cfg: TrainConfig) -> StepFlops:
    m, B, P, N = cfg.model_cfg, cfg.batch_size, cfg.prompt_len, cfg.sampling.max_new_tokens
    T, S = P + N, P + N
    chunk = min(cfg.compute.logprob_chunk, N)
    n_head = -(-N // chunk) * chunk  # log-prob chunks are padded to whole chunks
    causal = T * (T + 1) / 2
    # The sampler: prefill writes the prompt into an S-slot cache and attends over its own P slots (masked), each
    # decode step runs one token per row against the S slots, or against the cache blocks it reads (on average).
    blocks = decode_blocks(cfg)
    dt = cfg.compute_dtype  # the activations' dtype
    prefill = _fwd_flops(m, P, P * P, 1) + rope_flops(m, P, dt)
    decode = _fwd_flops(m, 1, S if blocks is None else min(S, blocks[0] * cfg.compute.decode_block), 1)
    decode += rope_flops(m, 1, dt)
    fwd = _fwd_flops(m, T, T * T, n_head)  # completion_logprobs: full [T, T] attention, padded head chunks
    head = 2 * m.d_model * m.vocab_size * n_head
    attn = m.n_layers * attention_flops(m, T * T)
    remat = {"none": 0.0, "full": fwd - head, "dots": attn}[cfg.compute.remat]
    rope = rope_flops(m, T, dt)  # its backward is one product too (by the constant transposed); full remat: again
    # Backward = 2x forward; the head chunks are recomputed in the backward (jax.checkpoint), layers per remat.
    train_pass = 3 * fwd + head + remat + rope * (2 + (cfg.compute.remat == "full"))
    fwd += rope
    model_fwd = _fwd_flops(m, T, causal, N)
    executed = {"sample": B * (prefill + N * decode), "ref_logprobs": B * fwd,
                "update": B * cfg.rl.mu_iterations * train_pass}
    model = {"sample": B * model_fwd, "ref_logprobs": B * model_fwd,
             "update": B * cfg.rl.mu_iterations * 3 * model_fwd}
    return StepFlops(executed, model, prefill, decode)
