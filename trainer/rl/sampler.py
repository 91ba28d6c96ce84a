"""Batched autoregressive sampling: one prefill, then a `lax.while_loop` of single-token decode steps on a KV cache.

Prompts may be left- or right-padded (any layout, given a validity mask): they are moved to left padding first
so every row writes the same cache slot each step, and RoPE positions count real tokens only.

Randomness is per row (the key folded with the row's index in the whole batch, then with the token's position in its
completion), so the tokens do not depend on how rows are scheduled: sampling the batch at once, in chunks of
`max_num_sequences` rows, or continuously batched (a slot whose sequence ended takes the next pending one) gives the
same tokens.

The returned log-probs are log softmax(logits / temperature) of the sampled tokens, before top-k/top-p
truncation (temperature 0 = greedy, log-probs at temperature 1). That is exactly what
`model.completion_logprobs` computes at the same temperature, so the first RL iteration has ratio 1.

The settings are static (Python values: one program per value, what the trainer's fixed config wants) or, as
`RowSettings`, per-row arrays that one program serves whatever their values (the service's many users).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from trainer.base.config import ComputeConfig, ModelConfig
from trainer.model.attention import live_blocks, static_blocks, static_decode_blocks
from trainer.model.decoder import (
    DEFAULT_COMPUTE,
    Adapter,
    KVCache,
    Params,
    forward,
    init_cache,
    logits,
    logprobs_and_entropy,
)
from trainer.model.sharding import constrain, join_strided, split_strided


class Samples(NamedTuple):
    tokens_BN: jax.Array  # sampled tokens, pad after EOS
    logprobs_BN: jax.Array  # 0 where mask is 0
    mask_BN: jax.Array  # 1 for generated tokens up to and including EOS
    steps: jax.Array  # decode steps run, summed over chunks (int32 scalar): slot efficiency = tokens / (steps x slots)


class RowSettings(NamedTuple):
    """Per-row sampling settings as traced data, so one compiled program serves any values: temperature (0 =
    greedy), top-k (0 = off) and top-p (1 = off) as `pick` takes them, the row's stop ids (-1 = unused) and its own
    token limit (at most the program's max_new_tokens)."""

    temperature_B: jax.Array  # float32
    top_k_B: jax.Array  # int32
    top_p_B: jax.Array  # float32
    stop_BS: jax.Array  # int32
    max_new_B: jax.Array  # int32

    def take(self, rows: jax.Array) -> RowSettings:
        return RowSettings(*(x[rows] for x in self))


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


def filter_logits_rows(logits_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """`filter_logits` with each row's own top_k and top_p as traced values: the k-th largest is read off one sort
    (the same value lax.top_k gives, ties kept alike) and the nucleus is cut on that sort with the top-k mask
    applied, which is the sort of the top-k-masked logits that `filter_logits` makes."""
    neg = jnp.finfo(logits_BV.dtype).min
    V = logits_BV.shape[-1]
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    k_on_B1 = ((top_k_B > 0) & (top_k_B < V))[:, None]
    kth_B1 = jnp.take_along_axis(sorted_BV, jnp.clip(top_k_B - 1, 0, V - 1)[:, None], axis=1)
    kth_B1 = jnp.where(k_on_B1, kth_B1, -jnp.inf)
    logits_BV = jnp.where(logits_BV < kth_B1, neg, logits_BV)
    sorted_BV = jnp.where(sorted_BV < kth_B1, neg, sorted_BV)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    p_B1 = top_p_B[:, None].astype(before_BV.dtype)
    cutoff_B1 = jnp.min(jnp.where(before_BV < p_B1, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    cutoff_B1 = jnp.where(p_B1 < 1.0, cutoff_B1, -jnp.inf)
    return jnp.where(logits_BV < cutoff_B1, neg, logits_BV)


def pick_rows(row_keys_B: jax.Array, i_B: jax.Array, logits_BV: jax.Array, s: RowSettings
              ) -> tuple[jax.Array, jax.Array]:
    """`pick` with each row's settings as traced values. A greedy row (temperature <= 0) takes the argmax (the first
    on ties) and its log-prob at temperature 1; the vocab is sorted only when some sampled row filters (lax.cond)."""
    logits_BV = constrain(logits_BV, ("batch", "vocab"))
    V = logits_BV.shape[-1]
    greedy_B = s.temperature_B <= 0
    x_BV = logits_BV / jnp.where(greedy_B, 1.0, s.temperature_B)[:, None].astype(logits_BV.dtype)
    filters = jnp.any(~greedy_B & (((s.top_k_B > 0) & (s.top_k_B < V)) | (s.top_p_B < 1.0)))
    filtered = jax.lax.cond(filters, lambda x: filter_logits_rows(x, s.top_k_B, s.top_p_B), lambda x: x, x_BV)
    keys_B = jax.vmap(jax.random.fold_in)(row_keys_B, i_B)
    noise_BV = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[1:], filtered.dtype))(keys_B)
    return _draw(x_BV, jnp.where(greedy_B[:, None], x_BV, filtered + noise_BV))


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
    continuous: bool = True,
    refill_rows: int = 1,
    per_row: RowSettings | None = None,
) -> Samples:
    """Sample `max_new_tokens` per row (stopping a row at EOS, or any of several stop ids given as a tuple, and the
    loop once every row stopped).

    With `max_num_sequences` = c < B only c rows decode at once, so the KV cache holds c sequences. `continuous`: c
    slots, and a slot whose sequence ended takes the next pending row (prompts prefilled into free slots
    `refill_rows` at a time: best one per data-parallel group) until all B are done, so slots do not idle while rows
    are pending. Otherwise the rows go in B / c sequential chunks, each
    decoding until its longest row ends. Either way rows enter in the order k, k + n, k + 2n, ... (n = B / c,
    trainer.model.sharding.split_strided): with the batch sharded in contiguous blocks over the data devices, the first
    c are spread over all of them. With an adapter, each row decodes with its own LoRA slot (its gate row travels with
    it). `per_row`: each row's settings as traced data (temperature, top_k, top_p and eos_id are then unused) and
    its own token limit, at most `max_new_tokens`.
    """
    B, P = prompt_BP.shape
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature,
                              top_k=top_k, top_p=top_p, cc=cc)
    rows_B = jnp.arange(B, dtype=jnp.int32)
    c = min(max_num_sequences or B, B)
    gate_BS = None if adapter is None else adapter.gate_BS
    if c == B:
        return _sample_rows(params, cfg, prompt_BP, prompt_valid_BP, rows_B, key, adapter, per_row, **kw)
    if B % c:
        raise ValueError(f"max_num_sequences={c} must divide the batch of {B} rows")
    n = B // c
    if continuous:
        return _sample_continuous(params, cfg, prompt_BP, prompt_valid_BP, key, adapter, per_row, slots=c,
                                  refill_rows=refill_rows, **kw)

    def one(xs: tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, RowSettings | None]) -> Samples:
        prompt, valid, rows, gate, settings = xs
        # gate is None only without an adapter.
        chunk_adapter = None if adapter is None else Adapter(adapter.weights, gate)  # type: ignore[arg-type]
        return _sample_rows(params, cfg, prompt, valid, rows, key, chunk_adapter, settings, **kw)

    gate_n = None if gate_BS is None else split_strided(gate_BS, n)
    per_row_n = None if per_row is None else RowSettings(*(split_strided(x, n) for x in per_row))
    out = jax.lax.map(one, (*(split_strided(x, n) for x in (prompt_BP, prompt_valid_BP, rows_B)), gate_n,
                            per_row_n))
    tokens_BN, logprobs_BN, mask_BN = (join_strided(x) for x in out[:3])
    return Samples(tokens_BN, logprobs_BN, mask_BN, jnp.sum(out.steps))


def refill_size(refill_rows: int, slots: int) -> int:
    """Rows a continuous-batching refill prefills together: `refill_rows`, at least 1 and at most the slots."""
    return max(1, min(refill_rows, slots))


def row_keys(key: jax.Array, rows_B: jax.Array) -> jax.Array:
    """Each row's random stream: the step's key folded with the row's index in the whole batch."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(rows_B)


def _draw(x_BV: jax.Array, noisy_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """argmax of noisy_BV (the first on ties, as jnp.argmax) and log softmax(x_BV) there, in one read of both: one
    reduction carries the running max and mass of x (the online-softmax combine), the best noisy score, its index and
    x there."""
    f32 = jnp.float32

    def combine(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m = jnp.maximum(a[0], b[0])
        mass = lambda side: jnp.where(side[1] > 0, side[1] * jnp.exp(side[0] - m), 0.0)  # noqa: E731
        take_b = (b[2] > a[2]) | ((b[2] == a[2]) & (b[3] < a[3]))
        return (m, mass(a) + mass(b), *(jnp.where(take_b, y, x) for x, y in zip(a[2:], b[2:], strict=True)))

    ids_BV = jax.lax.broadcasted_iota(jnp.int32, x_BV.shape, 1)
    init = (jnp.array(-jnp.inf, f32), jnp.array(0.0, f32), jnp.array(-jnp.inf, noisy_BV.dtype),
            jnp.array(jnp.iinfo(jnp.int32).max, jnp.int32), jnp.array(0.0, f32))
    x_BV = x_BV.astype(f32)
    m_B, z_B, _, tok_B, x_tok_B = jax.lax.reduce((x_BV, jnp.ones_like(x_BV), noisy_BV, ids_BV, x_BV), init, combine,
                                                 (1,))
    return tok_B, x_tok_B - (m_B + jnp.log(z_B))


def pick(row_keys_B: jax.Array, i_B: jax.Array, logits_BV: jax.Array, temperature: float, top_k: int, top_p: float
         ) -> tuple[jax.Array, jax.Array]:
    """Token i_B of each row (drawn with its stream folded with i_B) and its log-prob. The logits stay sharded over
    the vocab as the head wrote them: each chip draws the Gumbel noise of its own slice (threefry is partitionable:
    the same bits whatever the sharding) and only [B] maxima cross chips, instead of every chip drawing for the
    whole vocab. The draw is jax.random.categorical's (argmax of logits + Gumbel noise, the same noise), in the
    log-prob's own pass over the logits."""
    logits_BV = constrain(logits_BV, ("batch", "vocab"))
    if temperature == 0:
        tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        return tok_B, logprobs_and_entropy(logits_BV, tok_B, temperature)[0]
    keys_B = jax.vmap(jax.random.fold_in)(row_keys_B, i_B)
    x_BV = logits_BV / temperature
    filtered = filter_logits(x_BV, top_k, top_p)
    noise_BV = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[1:], filtered.dtype))(keys_B)
    return _draw(x_BV, filtered + noise_BV)


def prefill(params: Params, cfg: ModelConfig, prompt_BP: jax.Array, valid_BP: jax.Array, cache_len: int,
            cc: ComputeConfig, adapter: Adapter | None) -> tuple[jax.Array, KVCache]:
    """Left-padded prompts into a fresh cache of `cache_len` slots: the logits that pick each row's first token."""
    B, _ = prompt_BP.shape
    x_BPD, cache = forward(params, cfg, prompt_BP, valid_BP, cache=init_cache(cfg, B, cache_len, cc), index=0, cc=cc,
                           adapter=adapter)
    # forward returns a cache (KVCache | None) when it is given one.
    return logits(params, cfg, x_BPD[:, -1:], adapter)[:, 0], cache  # type: ignore[return-value]


def decode_step(params: Params, cfg: ModelConfig, tok_B: jax.Array, live_B: jax.Array, pos_B: jax.Array,
                slot: jax.Array | int, cache: KVCache, cc: ComputeConfig, adapter: Adapter | None
                ) -> tuple[jax.Array, KVCache]:
    """One token per row into cache slot `slot` (one for all rows, or one per row) at RoPE position pos_B; a row
    that is not live writes an invalid slot, which nothing attends to. Returns the next logits and the cache.

    With `compute.decode_attention: unrolled` the step is traced once per count of live cache blocks, each reading
    exactly that many (unrolled), and `lax.switch` runs the one this step needs: no loop inside the step."""

    def run(cache: KVCache) -> tuple[jax.Array, KVCache]:
        # forward returns a cache (KVCache | None) when it is given one.
        x_B1D, cache = forward(params, cfg, tok_B[:, None], live_B[:, None], pos_B[:, None], cache=cache,  # type: ignore[assignment]
                               index=slot, cc=cc, adapter=adapter)
        return logits(params, cfg, x_B1D, adapter)[:, 0], cache

    S, block = cache.valid_BS.shape[1], cc.decode_block
    if cc.decode_attention != "unrolled" or not 0 < block < S or static_blocks() is not None:
        return run(cache)

    def fixed(n: int) -> Callable[[KVCache], tuple[jax.Array, KVCache]]:
        def branch(cache: KVCache) -> tuple[jax.Array, KVCache]:
            with static_decode_blocks(n):
                return run(cache)
        return branch

    slot_B1 = jnp.broadcast_to(jnp.reshape(slot, (-1, 1)), (tok_B.shape[0], 1))
    n = live_blocks(slot_B1, live_B[:, None], block, S)
    return jax.lax.switch(n - 1, [fixed(k) for k in range(1, -(-S // block) + 1)], cache)


def _stop(tok_B: jax.Array, eos_id: int | tuple[int, ...]) -> jax.Array:
    return jnp.isin(tok_B, jnp.asarray(eos_id, jnp.int32))


def _choose(keys_B: jax.Array, i_B: jax.Array, logits_BV: jax.Array, per_row: RowSettings | None, temperature: float,
            top_k: int, top_p: float, eos_id: int | tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's token i_B, its log-prob, and whether the row ends with it (a stop id, or its own limit reached)."""
    if per_row is None:
        tok_B, logp_B = pick(keys_B, i_B, logits_BV, temperature, top_k, top_p)
        return tok_B, logp_B, _stop(tok_B, eos_id)
    tok_B, logp_B = pick_rows(keys_B, i_B, logits_BV, per_row)
    ends_B = jnp.any(tok_B[:, None] == per_row.stop_BS, axis=1) | (i_B + 1 >= per_row.max_new_B)
    return tok_B, logp_B, ends_B


def _sample_rows(
    params: Params,
    cfg: ModelConfig,
    prompt_BP: jax.Array,
    prompt_valid_BP: jax.Array,
    rows_B: jax.Array,
    key: jax.Array,
    adapter: Adapter | None,
    per_row: RowSettings | None,
    *,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    cc: ComputeConfig,
) -> Samples:
    """`sample` for one set of rows decoded together; `rows_B` are their indices in the whole batch."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    prompt_BP, valid_BP = to_left_padding(prompt_BP, prompt_valid_BP.astype(bool))
    n_prompt_B = jnp.sum(valid_BP.astype(jnp.int32), axis=1)
    keys_B = row_keys(key, rows_B)
    logits_BV, cache = prefill(params, cfg, prompt_BP, valid_BP, P + N, cc, adapter)

    def cond(c: _Carry) -> jax.Array:
        return (c.i < N) & ~jnp.all(c.done_B)

    def body(c: _Carry) -> _Carry:
        tok_B, logp_B, ends_B = _choose(keys_B, jnp.full((B,), c.i), c.logits_BV, per_row, temperature, top_k, top_p,
                                        eos_id)
        live_B = ~c.done_B
        tok_B = jnp.where(live_B, tok_B, pad_id)
        tokens_BN = c.tokens_BN.at[:, c.i].set(tok_B)
        logprobs_BN = c.logprobs_BN.at[:, c.i].set(jnp.where(live_B, logp_B, 0.0))
        mask_BN = c.mask_BN.at[:, c.i].set(live_B.astype(jnp.int32))
        done_B = c.done_B | ends_B
        # Feed the token back; a finished row's pad is marked invalid so nothing attends to it.
        next_logits, cache = decode_step(params, cfg, tok_B, live_B, n_prompt_B + c.i, P + c.i, c.cache, cc, adapter)
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
    return Samples(out.tokens_BN, out.logprobs_BN, out.mask_BN, out.i)


class _Slots(NamedTuple):
    """Continuous-batching state: per slot the row it decodes (B: none), the position of its next token in that
    row's completion, the row's prompt length and the logits that pick that token; the next pending row; the cache;
    the outputs of all B rows; the decode steps run."""

    row_C: jax.Array
    i_C: jax.Array
    n_prompt_C: jax.Array
    logits_CV: jax.Array
    next_q: jax.Array
    cache: KVCache
    tokens_BN: jax.Array
    logprobs_BN: jax.Array
    mask_BN: jax.Array
    steps: jax.Array


def _sample_continuous(
    params: Params,
    cfg: ModelConfig,
    prompt_BP: jax.Array,
    prompt_valid_BP: jax.Array,
    key: jax.Array,
    adapter: Adapter | None,
    per_row: RowSettings | None,
    *,
    slots: int,
    refill_rows: int,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    cc: ComputeConfig,
) -> Samples:
    """`sample` with `slots` rows decoding at once and finished rows' slots refilled from the pending ones,
    `refill_rows` at a time (once that many slots are free, or as many as are still pending): a prefill of one row
    would leave all data-parallel groups but one idle.

    Every slot's sequence has the same cache layout as in a static batch (prompt left-padded in slots [0, P), token i
    at P + i), so a refilled slot's stale keys past its position are masked exactly as unwritten ones, and each
    row's tokens are those the static sampler draws."""
    B, P = prompt_BP.shape
    N, C, R = max_new_tokens, slots, refill_size(refill_rows, slots)
    n = B // C
    prompt_BP, valid_BP = to_left_padding(prompt_BP, prompt_valid_BP.astype(bool))
    n_prompt_B = jnp.sum(valid_BP.astype(jnp.int32), axis=1)
    keys_B = row_keys(key, jnp.arange(B, dtype=jnp.int32))
    q_Q = jnp.arange(B, dtype=jnp.int32)
    queue_Q = (q_Q % C) * n + q_Q // C  # the pieces of split_strided in turn: rows 0, n, 2n, ..., 1, n + 1, ...
    gate_BS = None if adapter is None else adapter.gate_BS

    def adapter_for(rows: jax.Array) -> Adapter | None:
        # gate_BS is None only without an adapter.
        return None if adapter is None else Adapter(adapter.weights, gate_BS[jnp.minimum(rows, B - 1)])  # type: ignore[index]

    first_C = queue_Q[:C]
    logits_CV, cache = prefill(params, cfg, prompt_BP[first_C], valid_BP[first_C], P + N, cc, adapter_for(first_C))

    def refill(s: _Slots) -> _Slots:
        """Prefill the next R pending rows together into the lowest free slots (fewer when fewer are pending)."""
        free_C = s.row_C >= B
        slots_R = jnp.argsort(~free_C, stable=True)[:R]
        q_R = s.next_q + jnp.arange(R, dtype=jnp.int32)
        ok_R = (q_R < B) & free_C[slots_R]
        rows_R = queue_Q[jnp.minimum(q_R, B - 1)]
        logits_RV, one = prefill(params, cfg, prompt_BP[rows_R], valid_BP[rows_R], P, cc, adapter_for(rows_R))
        to_R = jnp.where(ok_R, slots_R, C)  # slot C is out of range: a padding row's writes are dropped
        put = lambda big, small: big.at[:, to_R, :P].set(small.astype(big.dtype), mode="drop")  # noqa: E731
        valid_RS = jnp.concatenate([one.valid_BS, jnp.zeros((R, N), bool)], axis=1)
        cache = KVCache(put(s.cache.k_LBSKE, one.k_LBSKE), put(s.cache.v_LBSKE, one.v_LBSKE),
                        s.cache.valid_BS.at[to_R].set(valid_RS, mode="drop"))
        at = lambda x, v: x.at[to_R].set(v, mode="drop")  # noqa: E731
        return s._replace(row_C=at(s.row_C, rows_R), i_C=at(s.i_C, 0), n_prompt_C=at(s.n_prompt_C, n_prompt_B[rows_R]),
                          logits_CV=at(s.logits_CV, logits_RV), next_q=s.next_q + jnp.sum(ok_R), cache=cache)

    def pending(s: _Slots) -> jax.Array:
        left = B - s.next_q
        return (left > 0) & (jnp.sum(s.row_C >= B) >= jnp.minimum(R, left))

    def cond(s: _Slots) -> jax.Array:
        return jnp.any(s.row_C < B) | (s.next_q < B)

    def body(s: _Slots) -> _Slots:
        s = jax.lax.while_loop(pending, refill, s)
        live_C = s.row_C < B
        row_C = jnp.minimum(s.row_C, B - 1)
        tok_C, logp_C, ends_C = _choose(keys_B[row_C], s.i_C, s.logits_CV,
                                        None if per_row is None else per_row.take(row_C), temperature, top_k, top_p,
                                        eos_id)
        tok_C = jnp.where(live_C, tok_C, pad_id)
        at = (s.row_C, s.i_C)  # a free slot's row B is out of range: its writes are dropped
        tokens_BN = s.tokens_BN.at[at].set(tok_C, mode="drop")
        logprobs_BN = s.logprobs_BN.at[at].set(logp_C, mode="drop")
        mask_BN = s.mask_BN.at[at].set(1, mode="drop")
        ended_C = ends_C | (s.i_C + 1 >= N)
        logits_CV, cache = decode_step(params, cfg, tok_C, live_C, s.n_prompt_C + s.i_C, P + s.i_C, s.cache, cc,
                                       adapter_for(s.row_C))
        return s._replace(row_C=jnp.where(live_C & ended_C, B, s.row_C), i_C=s.i_C + 1, logits_CV=logits_CV,
                          cache=cache, tokens_BN=tokens_BN, logprobs_BN=logprobs_BN, mask_BN=mask_BN,
                          steps=s.steps + 1)

    init = _Slots(
        row_C=first_C, i_C=jnp.zeros((C,), jnp.int32), n_prompt_C=n_prompt_B[first_C], logits_CV=logits_CV,
        next_q=jnp.asarray(C, jnp.int32), cache=cache, tokens_BN=jnp.full((B, N), pad_id, jnp.int32),
        logprobs_BN=jnp.zeros((B, N), jnp.float32), mask_BN=jnp.zeros((B, N), jnp.int32),
        steps=jnp.zeros((), jnp.int32))
    out = jax.lax.while_loop(cond, body, init)
    return Samples(out.tokens_BN, out.logprobs_BN, out.mask_BN, out.steps)


def schedule_steps(lengths: list[int], slots: int, continuous: bool = True, refill_rows: int = 1) -> int:
    """The decode steps `sample` runs for completions of these lengths (through their stop token), replayed on the
    host: what slot efficiency a length distribution gets without running a model. Rows enter in the order k, k + n,
    ... (n = B / slots). Static: each chunk of `slots` rows runs until its longest ends. Continuous: before each step,
    while `refill_rows` slots are free (or as many as rows are pending), that many pending rows take the lowest free
    slots; a row of length L then holds its slot for L steps."""
    B = len(lengths)
    n = B // slots
    queue = [(j % slots) * n + j // slots for j in range(B)]
    if not continuous:
        return sum(max(lengths[r] for r in queue[k * slots:(k + 1) * slots]) for k in range(n))
    left = [lengths[r] for r in queue[:slots]]
    pending, steps = deque(queue[slots:]), 0
    while any(left) or pending:
        while pending and left.count(0) >= min(refill_rows, len(pending)):
            for s in [s for s in range(slots) if left[s] == 0][:refill_rows]:
                if pending:
                    left[s] = lengths[pending.popleft()]
        left = [max(x - 1, 0) for x in left]
        steps += 1
    return steps
