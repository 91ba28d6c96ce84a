"""Batched autoregressive sampling: one prefill, then a `lax.while_loop` of single-token decode steps on a KV cache.

Prompts may be left- or right-padded (any layout, given a validity mask): they are moved to left padding first
so every row writes the same cache slot each step, and RoPE positions count real tokens only.

The returned log-probs are log softmax(logits / temperature) of the sampled tokens, before top-k/top-p
truncation (temperature 0 = greedy, log-probs at temperature 1). That is exactly what
`model.completion_logprobs` computes at the same temperature, so the first RL iteration has ratio 1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer.config import ModelConfig
from trainer.model import KVCache, Params, forward, init_cache, logits, logprobs_and_entropy


class Samples(NamedTuple):
    tokens_BN: jax.Array  # sampled tokens, pad after EOS
    logprobs_BN: jax.Array  # 0 where mask is 0
    mask_BN: jax.Array  # 1 for generated tokens up to and including EOS


class _Carry(NamedTuple):
    """Decode-loop state: step i, the logits that pick token i, the cache, and the outputs so far."""

    i: jax.Array
    logits_BV: jax.Array
    cache: KVCache
    done_B: jax.Array
    tokens_BN: jax.Array
    logprobs_BN: jax.Array
    mask_BN: jax.Array


def to_left_padding(tokens_BT: jax.Array, valid_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stable-move the valid tokens of each row to its end (pads first, order kept)."""
    order_BT = jnp.argsort(valid_BT.astype(jnp.int32), axis=1, stable=True)
    return jnp.take_along_axis(tokens_BT, order_BT, axis=1), jnp.take_along_axis(valid_BT, order_BT, axis=1)


def filter_logits(logits_BV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Mask (to -inf) everything outside the top-k set and the top-p nucleus."""
    neg = jnp.finfo(logits_BV.dtype).min
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, neg, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # Keep a token if the mass strictly before it is < top_p (so the top token always stays).
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, neg, logits_BV)
    return logits_BV


def choose(key: jax.Array, logits_BV: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits_BV / temperature, top_k, top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def sample(
    params: Params,
    cfg: ModelConfig,
    prompt_BP: jax.Array,
    prompt_valid_BP: jax.Array,
    key: jax.Array,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Samples:
    """Sample `max_new_tokens` per row (stopping a row at EOS, and the loop once every row stopped)."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    prompt_BP, valid_BP = to_left_padding(prompt_BP, prompt_valid_BP.astype(bool))
    n_prompt_B = jnp.sum(valid_BP.astype(jnp.int32), axis=1)
    cache = init_cache(cfg, B, P + N)
    x_BPD, cache = forward(params, cfg, prompt_BP, valid_BP, cache=cache, index=0)
    logits_BV = logits(params, cfg, x_BPD[:, -1:])[:, 0]

    def cond(c: _Carry) -> jax.Array:
        return (c.i < N) & ~jnp.all(c.done_B)

    def body(c: _Carry) -> _Carry:
        tok_B = choose(jax.random.fold_in(key, c.i), c.logits_BV, temperature, top_k, top_p)
        logp_B, _ = logprobs_and_entropy(c.logits_BV, tok_B, temperature)
        live_B = ~c.done_B
        tok_B = jnp.where(live_B, tok_B, pad_id)
        tokens_BN = c.tokens_BN.at[:, c.i].set(tok_B)
        logprobs_BN = c.logprobs_BN.at[:, c.i].set(jnp.where(live_B, logp_B, 0.0))
        mask_BN = c.mask_BN.at[:, c.i].set(live_B.astype(jnp.int32))
        done_B = c.done_B | (tok_B == eos_id)
        # Feed the token back; a finished row's pad is marked invalid so nothing attends to it.
        x_B1D, cache = forward(
            params, cfg, tok_B[:, None], live_B[:, None], (n_prompt_B + c.i)[:, None], cache=c.cache, index=P + c.i
        )
        next_logits = logits(params, cfg, x_B1D)[:, 0]
        return _Carry(c.i + 1, next_logits, cache, done_B, tokens_BN, logprobs_BN, mask_BN)

    init = _Carry(
        i=jnp.zeros((), jnp.int32),
        logits_BV=logits_BV,
        cache=cache,
        done_B=jnp.zeros((B,), bool),
        tokens_BN=jnp.full((B, N), pad_id, jnp.int32),
        logprobs_BN=jnp.zeros((B, N), jnp.float32),
        mask_BN=jnp.zeros((B, N), jnp.int32),
    )
    out = jax.lax.while_loop(cond, body, init)
    return Samples(out.tokens_BN, out.logprobs_BN, out.mask_BN)
