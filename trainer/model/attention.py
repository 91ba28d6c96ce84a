"""The decoder's attention (shape suffixes as in trainer/model/decoder.py): XLA's einsum (`attention`), Pallas' splash
kernel for a pass without a cache (`flash_attention`), cuDNN's over packed rows (`packed_attention`), and the attention
of new tokens to the stacked KV cache they were written into (`write_slots`, `cached_attend`: the whole cache, block by
block in XLA up to the furthest live token, or the Pallas decode kernel of trainer/model/decode_kernel.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp

from trainer.base.config import ComputeConfig
from trainer.model import decode_kernel

f32 = jnp.float32


def attention(q_BTHE: jax.Array, k_BSKE: jax.Array, v_BSKE: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    B, T, H, E = q_BTHE.shape
    K = k_BSKE.shape[2]
    q_BTKGE = q_BTHE.reshape(B, T, K, H // K, E)
    scores = jnp.einsum("btkge,bske->bkgts", q_BTKGE, k_BSKE, preferred_element_type=f32) * E**-0.5
    # Finite fill: a pad query with no visible key gets a uniform (ignored) row instead of NaN.
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, jnp.finfo(f32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKE.dtype)
    out_BTKGE = jnp.einsum("bkgts,bske->btkge", probs, v_BSKE)
    return out_BTKGE.reshape(B, T, H, E)


FLASH_BLOCK = 128  # the kernel's smallest block: the sequence must be a multiple


FLASH_BLOCK_MAX = 512  # its block when the sequence allows (libtpu prices 512 below 128 and 256: Qwen3-0.6B update)


def flash_attention(q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, valid_BT: jax.Array) -> jax.Array:
    """Causal attention of T tokens among themselves with pad keys masked, as `attention` computes it for valid
    queries, in Pallas' splash attention TPU kernel (no [T, T] scores in HBM, forward and backward). Grouped KV heads
    are read in place: query head h reads KV head h // (H / K) (the kernel's index maps), so no repeated copy of the
    keys and values is written, nor its gradient summed back. Pad tokens form their own segment, so a pad query
    attends pads (its output is never used; valid queries never see a pad). Under a mesh the kernel runs per shard
    (shard_map): rows over the data axes, heads over tensor where both head counts divide."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    from trainer.model.sharding import kernel_shard_axes

    B, T, H, E = q_BTHE.shape
    K = k_BTKE.shape[2]
    block = math.gcd(T, FLASH_BLOCK_MAX)
    blocks = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                           block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)

    def local(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
        kernel = sk.make_splash_mha(sm.MultiHeadMask([sm.CausalMask((T, T))] * q.shape[2]), block_sizes=blocks,
                                    head_shards=1, q_seq_shards=1)
        q = (q.astype(f32) * E**-0.5).astype(q.dtype)  # the kernel takes no softmax scale
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))  # [B, heads, T, E]
        seg = valid.astype(jnp.int32)
        rows = (q, k, v, sk.SegmentIds(seg, seg))
        # TPU interpret mode cannot run a vmapped kernel (its grid gains a dimension): one row at a time there
        out = jax.lax.map(lambda r: kernel(*r), rows) if _pallas_interpreting() else jax.vmap(kernel)(*rows)
        return out.swapaxes(1, 2)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(q_BTHE, k_BTKE, v_BTKE, valid_BT)
    rows, heads = kernel_shard_axes(mesh, B, H, K)
    spec = jax.sharding.PartitionSpec(rows, None, heads, None)
    return jax.shard_map(local, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec(rows, None)), out_specs=spec,
                         check_vma=False)(q_BTHE, k_BTKE, v_BTKE, valid_BT)


def no_cache_attention(cc: ComputeConfig, T: int) -> str:
    """The attention a pass over T tokens without a KV cache, or a prefill from slot 0, runs (`forward`; fit adds the
    flash kernel's FLOPs by it): compute.attention as resolved for the platform, with flash only where T fills its
    blocks, else XLA's."""
    if cc.attention == "flash" and T % FLASH_BLOCK:
        return "xla"
    return cc.attention


def packed_order(valid_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's valid tokens moved to its front in their own order (a stable sort), the permutation back, and each
    row's count. Causal attention among a packed row's first n tokens is `attention`'s causal, pad-masked attention
    of its valid queries, wherever the pads were (left-padded prompts, right-padded completions, both)."""
    order_BT = jnp.argsort(~valid_BT.astype(bool), axis=1, stable=True)
    return order_BT, jnp.argsort(order_BT, axis=1), jnp.sum(valid_BT, axis=1, dtype=jnp.int32)


def packed_attention(q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Causal attention of packed rows (`packed_order`: the first lengths_B[b] tokens valid) through
    `jax.nn.dot_product_attention`: on GPU cuDNN's fused flash attention (padding + causal mask, so pad blocks are
    neither read nor computed, grouped KV heads read in place, no [T, T] scores in HBM, forward and backward); in
    float32 or off GPU the same call through XLA (how the tests check this path off GPU). Pad queries' outputs are
    zeroed: cuDNN leaves them to its kernel, and a NaN there would reach the next layer's keys through a matmul."""
    from trainer.model.sharding import kernel_shard_axes

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:  # cuDNN's partitioner takes q, k and v sharded alike: rows and, where both divide, heads
        rows, heads = kernel_shard_axes(mesh, q_BTHE.shape[0], q_BTHE.shape[2], k_BTKE.shape[2])
        spec = jax.sharding.PartitionSpec(rows, None, heads, None)
        q_BTHE, k_BTKE, v_BTKE = (jax.lax.with_sharding_constraint(x, spec) for x in (q_BTHE, k_BTKE, v_BTKE))
    cudnn = jax.default_backend() == "gpu" and q_BTHE.dtype in (jnp.bfloat16, jnp.float16)  # its dtypes
    impl: Literal["cudnn", "xla"] = "cudnn" if cudnn else "xla"
    out = jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, is_causal=True, query_seq_lengths=lengths_B,
                                       key_value_seq_lengths=lengths_B, implementation=impl)
    live_BT = jnp.arange(q_BTHE.shape[1])[None, :] < lengths_B[:, None]
    return jnp.where(live_BT[:, :, None, None], out, jnp.zeros((), out.dtype))


def _pallas_interpreting() -> bool:
    """Whether Pallas TPU kernels are being traced under `pltpu.force_tpu_interpret_mode` (the tests, off TPU).
    Its interpreter zips the kernel's grid with its dimension semantics, which vmap's extra grid dimension breaks
    (jax 0.10.2 `interpret_pallas_call._get_randomized_grid_coordinates`)."""
    from jax._src import config as jax_config

    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


# fit prices the decode step's block loop at a fixed number of blocks (the compiler counts a loop's body once).
_STATIC_DECODE_BLOCKS: contextvars.ContextVar[int | None] = contextvars.ContextVar("decode_blocks", default=None)


@contextlib.contextmanager
def static_decode_blocks(n: int) -> Iterator[None]:
    """Trace decode steps whose attention reads exactly `n` blocks, unrolled: how fit prices the loop. Not part of
    jit's cache key: trace a fresh program under it."""
    token = _STATIC_DECODE_BLOCKS.set(n)
    try:
        yield
    finally:
        _STATIC_DECODE_BLOCKS.reset(token)


def static_blocks() -> int | None:
    """The block count `static_decode_blocks` fixes for the trace under way, if any."""
    return _STATIC_DECODE_BLOCKS.get()


def live_blocks(q_slot_BT: jax.Array, live_BT: jax.Array, block: int, slots: int) -> jax.Array:
    """Blocks of `block` cache slots up to the one holding the furthest live query's own slot (at most all)."""
    last = jnp.max(jnp.where(live_BT, q_slot_BT, 0))
    return jnp.minimum(last // block + 1, -(-slots // block)).astype(jnp.int32)


def block_attention(q_BTHE: jax.Array, k_LBSKE: jax.Array, v_LBSKE: jax.Array, layer: jax.Array | int,
                    valid_BS: jax.Array, q_slot_BT: jax.Array, block: int, blocks: jax.Array | int) -> jax.Array:
    """`attention` of the queries to layer `layer` of a stacked cache, read `block` slots at a time for the first
    `blocks` blocks only (online softmax in fp32): a query sees slot s if valid_BS and s <= its own slot, so slots
    past the furthest live query are never read. Each block is one dynamic slice of the stacked cache, not of a copy
    of the layer (libtpu still copies each block before the dot reads it: a kernel reading the cache by DMA would
    not). The last block ends at the cache's end, overlapping the one before; its slots already seen are masked.
    A query with no visible key gets zeros (the einsum's uniform row), a row nothing reads."""
    B, T, H, E = q_BTHE.shape
    S, K = k_LBSKE.shape[2], k_LBSKE.shape[3]
    G = H // K
    q_BTKGE = q_BTHE.reshape(B, T, K, G, E)
    # A float32 cache at default precision is a bf16 matmul on TPU: libtpu hoists the convert out of the loop, as a
    # bf16 copy of the whole cache at every layer. At HIGHEST each block is read as it is.
    prec = jax.lax.Precision.HIGHEST if k_LBSKE.dtype == f32 else None

    def step(j: jax.Array | int, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, total, acc = carry
        start = jnp.minimum(j * block, S - block)
        k_BSKE, v_BSKE = (jax.lax.dynamic_slice(c, (layer, 0, start, 0, 0), (1, B, block, K, E))[0]
                          for c in (k_LBSKE, v_LBSKE))
        slot_S = start + jnp.arange(block)
        seen_BTS = (jax.lax.dynamic_slice_in_dim(valid_BS, start, block, axis=1)[:, None, :]
                    & (slot_S >= j * block) & (slot_S <= q_slot_BT[:, :, None]))[:, None, None]
        s = jnp.einsum("btkge,bske->bkgts", q_BTKGE, k_BSKE, preferred_element_type=f32, precision=prec) * E**-0.5
        m_new = jnp.maximum(m, jnp.max(jnp.where(seen_BTS, s, jnp.finfo(f32).min), axis=-1))
        p = jnp.where(seen_BTS, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgts,bske->bkgte", p.astype(v_BSKE.dtype), v_BSKE, preferred_element_type=f32,
                        precision=prec)
        return m_new, scale * total + jnp.sum(p, axis=-1), scale[..., None] * acc + pv

    carry: tuple[jax.Array, ...] = (jnp.full((B, K, G, T), jnp.finfo(f32).min), jnp.zeros((B, K, G, T), f32),
                                    jnp.zeros((B, K, G, T, E), f32))
    if isinstance(blocks, int):
        for j in range(blocks):
            carry = step(j, carry)
    else:
        carry = jax.lax.fori_loop(0, blocks, step, carry)
    _, total, acc = carry
    out_BKGTE = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E).astype(v_LBSKE.dtype)


def write_slots(cache: jax.Array, new_BT: jax.Array, index: jax.Array | int, layer: jax.Array | None = None
                ) -> jax.Array:
    """`new` written into a [B, S, ...] cache (or layer `layer` of a stacked [L, B, S, ...] one) from slot `index`:
    one index for every row, or one per row ([B]: rows of a continuously batched sampler sit at different
    positions). One scatter of unique, sorted (row, slot) pairs, in place: a decode step writes only its tokens.
    The cache as a scan input stacked into a fresh output, or a per-row dynamic-update-slice, made libtpu copy
    cache-sized buffers at every step. Unlike dynamic-update-slice, slots past the end would be dropped, not clamped
    (no row writes past P + N)."""
    B, T = new_BT.shape[:2]
    rows, slots = jnp.arange(B)[:, None], jnp.broadcast_to(jnp.reshape(index, (-1, 1)), (B, 1)) + jnp.arange(T)
    at = (rows, slots) if layer is None else (layer, rows, slots)
    return cache.at[at].set(new_BT.astype(cache.dtype), unique_indices=True, indices_are_sorted=True)


def cached_attend(valid_BS: jax.Array, q_slot_BT: jax.Array, live_BT: jax.Array, index: jax.Array | int,
                   block: int, kernel: bool = False) -> Any:
    """The attention of new tokens to the cache they were written into: a pass from a static slot `index` > 0 (a
    prefill from slot 0 attends its own keys, see `forward`) reads only the slots up to its last token; a decode
    step (index per step or per row) reads block by block up to the furthest live token (`block_attention`, or with
    `kernel` the Pallas kernel of trainer/model/decode_kernel.py where its shapes fit), or, with block 0 or a cache of
    one block, the whole cache."""
    T, S = q_slot_BT.shape[1], valid_BS.shape[1]
    if isinstance(index, int) or block <= 0 or block >= S:
        n = min(S, index + T) if isinstance(index, int) else S
        mask_BTS = valid_BS[:, None, :n] & (jnp.arange(n)[None, None, :] <= q_slot_BT[:, :, None])

        def whole(q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
            k_all, v_all, layer = kv
            return attention(q, k_all[layer, :, :n], v_all[layer, :, :n], mask_BTS)

        return whole
    fixed = static_blocks()

    def blockwise(q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        k_all, v_all, layer = kv
        if kernel and decode_kernel.supported(q.shape[-1], S, block):
            return decode_kernel.decode_attention(q, k_all, v_all, layer, valid_BS, q_slot_BT, live_BT, block,
                                                  fixed)
        blocks = live_blocks(q_slot_BT, live_BT, block, S) if fixed is None else fixed
        return block_attention(q, k_all, v_all, layer, valid_BS, q_slot_BT, block, blocks)

    return blockwise
