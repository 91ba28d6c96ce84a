"""A decode step's attention as one Pallas TPU kernel reading the stacked KV cache by DMA, block by block.

`attention.block_attention` (XLA) computes the same online softmax over `block`-slot blocks, but libtpu materialises
each block (a dynamic-slice fusion) before the dot reads it. Here each grid step DMAs one block of `ROWS` rows'
keys and values (every KV head) straight from the stacked [L, B, S, K, E] cache into VMEM. Blocks past the furthest
slot a group's queries see are neither fetched nor computed: their index map repeats the last live block, which
the pipeline does not fetch again, and the compute is skipped.

Off TPU it runs only in Pallas' interpret mode (`pltpu.force_tpu_interpret_mode`), as the tests do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

f32 = jnp.float32
ROWS = 8  # rows per grid step (a divisor of the shard's rows): fewer steps, each still a few MB of VMEM
LANES = 128  # a TPU vector register's lanes: the head size must fill them
_NEG = -1e30  # a finite "minus infinity": a query with no visible key keeps zeros, not NaN


def supported(head_dim: int, slots: int, block: int) -> bool:
    """Shapes the kernel takes on TPU: whole blocks, and a head size of whole lane tiles."""
    return block > 0 and slots % block == 0 and head_dim % LANES == 0


def _kernel(layer_ref: jax.Array, last_ref: jax.Array, q_ref: jax.Array, q_slot_ref: jax.Array, k_ref: jax.Array,
            v_ref: jax.Array, valid_ref: jax.Array, o_ref: jax.Array, m_sc: jax.Array, l_sc: jax.Array,
            acc_sc: jax.Array, *, block: int, scale: float) -> None:
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, _NEG, f32)
        l_sc[...] = jnp.zeros(l_sc.shape, f32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, f32)

    @pl.when(j * block <= last_ref[i])
    def _block() -> None:
        rows, K, GT, E = q_ref.shape
        q = q_ref[...].reshape(rows * K, GT, E)
        # [rows, block, K, E] as the cache holds it (or [rows, block, E] with one KV head: see below), to one
        # [block, E] tile per row and KV head.
        k = (k_ref[...] if K == 1 else jnp.swapaxes(k_ref[...], 1, 2)).reshape(rows * K, block, E)
        v = (v_ref[...] if K == 1 else jnp.swapaxes(v_ref[...], 1, 2)).reshape(rows * K, block, E)
        s = jnp.einsum("nge,nse->ngs", q, k, preferred_element_type=f32).reshape(rows, K, GT, block) * scale
        slot = j * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 3)
        seen = (valid_ref[...][:, None] != 0) & (slot <= q_slot_ref[...][:, None])
        s = jnp.where(seen, s, _NEG)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=3, keepdims=True))
        p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=3, keepdims=True)
        pv = jnp.einsum("ngs,nse->nge", p.reshape(rows * K, GT, block).astype(v.dtype), v,
                        preferred_element_type=f32)
        acc_sc[...] = alpha * acc_sc[...] + pv.reshape(rows, K, GT, E)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _done() -> None:
        total = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(total > 0, total, 1.0)).astype(o_ref.dtype)


def local_decode_attention(q_BTHE: jax.Array, k_LBSKE: jax.Array, v_LBSKE: jax.Array, layer: jax.Array | int,
                           valid_BS: jax.Array, q_slot_BT: jax.Array, live_BT: jax.Array, block: int,
                           blocks: int | None = None) -> jax.Array:
    """`attention.block_attention` of one shard's rows and heads in the kernel: queries see slot s if valid_BS and
    s <= their own slot. `blocks`: the grid's blocks (fit prices a fixed number); by default all of the cache's, of
    which each group of rows computes only those up to its furthest live query's slot."""
    B, T, H, E = q_BTHE.shape
    S, K = k_LBSKE.shape[2], k_LBSKE.shape[3]
    G = H // K
    rows = next(r for r in range(min(ROWS, B), 0, -1) if B % r == 0)
    nb = blocks if blocks is not None else S // block
    q = q_BTHE.reshape(B, T, K, G, E).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, E)
    q_slot = jnp.broadcast_to(q_slot_BT[:, None, :], (B, G, T)).reshape(B, G * T, 1).astype(jnp.int32)
    # [B, blocks, 1, block]: a block of the mask is its whole last two dimensions, which Mosaic takes at any block
    # size (a [rows, 1, block] block of [B, 1, S] needed block to be a multiple of 128).
    valid = valid_BS.astype(jnp.int32).reshape(B, S // block, 1, block)
    # The furthest slot a live query of each group of rows sees; a group with none computes its first block only.
    last = jnp.max(jnp.where(live_BT, q_slot_BT, 0).reshape(B // rows, rows * T), axis=1).astype(jnp.int32)

    def live_block(i: jax.Array, j: jax.Array, last_ref: jax.Array) -> jax.Array:
        return jnp.minimum(j, jax.lax.div(last_ref[i], block))

    # One KV head per shard (e.g. 8 KV heads over a tensor axis of 8): the cache's [L, B, S, E] view. A block of
    # [block, 1, E] tiles pads each slot to a whole sublane tile, and libtpu copied the cache to that layout at every
    # step (Qwen3-8B at sampling.tensor 8, 4 layers reading 5 blocks: 2.18 ms with the copy, 0.76 ms without).
    heads = (K,) if K > 1 else ()

    def kv_map(i: jax.Array, j: jax.Array, layer_ref: jax.Array, last_ref: jax.Array) -> tuple[jax.Array | int, ...]:
        return (layer_ref[0], i, live_block(i, j, last_ref), *(0 for _ in heads), 0)

    def valid_map(i: jax.Array, j: jax.Array, layer_ref: jax.Array, last_ref: jax.Array) -> tuple[jax.Array | int, ...]:
        return i, live_block(i, j, last_ref), 0, 0

    per_rows = pl.BlockSpec((rows, K, G * T, E), lambda i, j, *_: (i, 0, 0, 0))
    kv = pl.BlockSpec((None, rows, block, *heads, E), kv_map)
    size = jnp.dtype(k_LBSKE.dtype).itemsize
    # What the kernel moves and computes at `nb` blocks: each block's keys and values once, the queries and outputs.
    cost = pl.CostEstimate(flops=4 * B * H * T * nb * block * E, transcendentals=B * H * T * nb * block,
                           bytes_accessed=2 * B * nb * block * K * E * size + 2 * B * T * H * E * q.dtype.itemsize)
    out = pl.pallas_call(
        functools.partial(_kernel, block=block, scale=E**-0.5),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B // rows, nb),
            in_specs=[per_rows, pl.BlockSpec((rows, G * T, 1), lambda i, j, *_: (i, 0, 0)), kv, kv,
                      pl.BlockSpec((rows, None, 1, block), valid_map)],
            out_specs=per_rows,
            scratch_shapes=[pltpu.VMEM((rows, K, G * T, 1), f32), pltpu.VMEM((rows, K, G * T, 1), f32),
                            pltpu.VMEM((rows, K, G * T, E), f32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct((B, K, G * T, E), v_LBSKE.dtype),
        cost_estimate=cost,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), last, q, q_slot,
      *(x.reshape(*x.shape[:3], *heads, E) for x in (k_LBSKE, v_LBSKE)), valid)
    return out.reshape(B, K, G, T, E).transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)


def decode_attention(q_BTHE: jax.Array, k_LBSKE: jax.Array, v_LBSKE: jax.Array, layer: jax.Array | int,
                     valid_BS: jax.Array, q_slot_BT: jax.Array, live_BT: jax.Array, block: int,
                     blocks: int | None = None) -> jax.Array:
    """The kernel per shard under a mesh (shard_map, `sharding.kernel_shard_axes`), as `attention.flash_attention`
    runs its kernel."""
    from trainer.model.sharding import kernel_shard_axes

    run = functools.partial(local_decode_attention, block=block, blocks=blocks)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(q_BTHE, k_LBSKE, v_LBSKE, layer, valid_BS, q_slot_BT, live_BT)
    rows, heads = kernel_shard_axes(mesh, q_BTHE.shape[0], q_BTHE.shape[2], k_LBSKE.shape[3])
    P = jax.sharding.PartitionSpec
    q_spec, cache_spec, row_spec = P(rows, None, heads, None), P(None, rows, None, heads, None), P(rows, None)
    return jax.shard_map(
        lambda q, k, v, lay, valid, slot, live: run(q, k, v, lay, valid, slot, live),
        in_specs=(q_spec, cache_spec, cache_spec, P(), row_spec, row_spec, row_spec), out_specs=q_spec,
        check_vma=False)(q_BTHE, k_LBSKE, v_LBSKE, jnp.asarray(layer, jnp.int32), valid_BS, q_slot_BT, live_BT)
