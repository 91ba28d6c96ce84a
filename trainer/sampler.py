"""Batched autoregressive sampling: one prefill, then a `lax.while_loop` of single-token decode steps on a KV cache.

Prompts may be left- or right-padded (any layout, given a validity mask): they are moved to left padding first
so every row writes the same cache slot each step, and RoPE positions count real tokens only.

Randomness is per row (the key folded with the row's index in the whole batch, then with the decode step), so
sampling the batch in chunks of `max_num_sequences` rows gives exactly the tokens of sampling it at once.

The returned log-probs are log softmax(logits / temperature) of the sampled tokens, before top-k/top-p
truncation (temperature 0 = greedy, log-probs at temperature 1). That is exactly what
`model.completion_logprobs` computes at the same temperature, so the first RL iteration has ratio 1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer.config import ComputeConfig, ModelConfig
from trainer.model import DEFAULT_COMPUTE, Adapter, KVCache, Params, forward, init_cache, logits, logprobs_and_entropy
from trainer.sharding import join_strided, split_strided


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


def choose(keys_B: jax.Array, logits_BV: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """One token per row, each row drawn with its own key."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits_BV / temperature, top_k, top_p)
    return jax.vmap(jax.random.categorical)(keys_B, filtered).astype(jnp.int32)


def sample(
    params: Params,
    cfg: ModelConfig,
    prompt_BP: jax.Array,
    prompt_valid_BP: jax.Array,
    key: jax.Array,
    *,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    cc: ComputeConfig = DEFAULT_COMPUTE,
    max_num_sequences: int | None = None,
    adapter: Adapter | None = None,
) -> Samples:
    """Sample `max_new_tokens` per row (stopping a row at EOS, or any of several stop ids given as a tuple, and the
    loop once every row stopped).

    With `max_num_sequences` < B the rows are generated in B / max_num_sequences sequential chunks, so the KV
    cache holds one chunk. Chunk k takes rows k, k + n, k + 2n, ... (n chunks): with the batch sharded in
    contiguous blocks over the data devices, every chunk is spread over all of them. With an adapter, each row
    decodes with its own LoRA slot (its gate row travels with it into its chunk).
    """
    B, P = prompt_BP.shape
    kw = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature, top_k=top_k,
              top_p=top_p, cc=cc)
    rows_B = jnp.arange(B, dtype=jnp.int32)
    c = min(max_num_sequences or B, B)
    gate_BS = None if adapter is None else adapter.gate_BS
    if c == B:
        return _sample_rows(params, cfg, prompt_BP, prompt_valid_BP, rows_B, key, adapter, **kw)  # type: ignore[arg-type]
    if B % c:
        raise ValueError(f"max_num_sequences={c} must divide the batch of {B} rows")
    n = B // c

    def one(xs: tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]) -> Samples:
        prompt, valid, rows, gate = xs
        chunk_adapter = None if adapter is None else Adapter(adapter.weights, gate)  # type: ignore[arg-type]
        return _sample_rows(params, cfg, prompt, valid, rows, key, chunk_adapter, **kw)  # type: ignore[arg-type]

    gate_n = None if gate_BS is None else split_strided(gate_BS, n)
    out = jax.lax.map(one, (*(split_strided(x, n) for x in (prompt_BP, prompt_valid_BP, rows_B)), gate_n))
    return Samples(*(join_strided(x) for x in out))


def _sample_rows(
    params: Params,
    cfg: ModelConfig,
    prompt_BP: jax.Array,
    prompt_valid_BP: jax.Array,
    rows_B: jax.Array,
    key: jax.Array,
    adapter: Adapter | None,
    *,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    cc: ComputeConfig,
) -> Samples:
    """`sample` for one set of rows; `rows_B` are their indices in the whole batch (their random streams)."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    prompt_BP, valid_BP = to_left_padding(prompt_BP, prompt_valid_BP.astype(bool))
    n_prompt_B = jnp.sum(valid_BP.astype(jnp.int32), axis=1)
    row_keys_B = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows_B)
    cache = init_cache(cfg, B, P + N, cc)
    x_BPD, cache = forward(params, cfg, prompt_BP, valid_BP, cache=cache, index=0, cc=cc, adapter=adapter)
    logits_BV = logits(params, cfg, x_BPD[:, -1:], adapter)[:, 0]

    def cond(c: _Carry) -> jax.Array:
        return (c.i < N) & ~jnp.all(c.done_B)

    def body(c: _Carry) -> _Carry:
        keys_B = jax.vmap(lambda k: jax.random.fold_in(k, c.i))(row_keys_B)
        tok_B = choose(keys_B, c.logits_BV, temperature, top_k, top_p)
        logp_B, _ = logprobs_and_entropy(c.logits_BV, tok_B, temperature)
        live_B = ~c.done_B
        tok_B = jnp.where(live_B, tok_B, pad_id)
        tokens_BN = c.tokens_BN.at[:, c.i].set(tok_B)
        logprobs_BN = c.logprobs_BN.at[:, c.i].set(jnp.where(live_B, logp_B, 0.0))
        mask_BN = c.mask_BN.at[:, c.i].set(live_B.astype(jnp.int32))
        done_B = c.done_B | jnp.isin(tok_B, jnp.asarray(eos_id, jnp.int32))
        # Feed the token back; a finished row's pad is marked invalid so nothing attends to it.
        x_B1D, cache = forward(
            params, cfg, tok_B[:, None], live_B[:, None], (n_prompt_B + c.i)[:, None], cache=c.cache, index=P + c.i,
            cc=cc, adapter=adapter,
        )
        next_logits = logits(params, cfg, x_B1D, adapter)[:, 0]
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
