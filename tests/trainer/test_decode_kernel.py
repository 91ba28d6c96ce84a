"""The decode step's Pallas TPU kernel (trainer/model/decode_kernel.py), run here in Pallas' TPU interpret mode, against
the XLA block loop and the whole-cache einsum it replaces on TPU; and compiled for a v6e chip by libtpu."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tests.trainer.conftest import TINY_MODEL
from trainer.base.config import ComputeConfig, ModelConfig
from trainer.model import attention as A
from trainer.model import decode_kernel as D
from trainer.model import decoder as M
from trainer.model.sharding import make_mesh
from trainer.rl.sampler import sample

f32 = jnp.float32


def _case(T: int, dtype: Any = f32, K: int = 2) -> tuple[Any, ...]:
    """16 rows (two groups of the kernel's 8) at their own slots of a 64-slot cache, left-padded prompts, some rows
    no longer live; every slot in blocks past a group's furthest live query is NaN."""
    L, B, S, H, E, block = 3, 16, 64, 4, 128, 16
    rng = np.random.default_rng(T)
    k, v = (jnp.asarray(rng.standard_normal((L, B, S, K, E)), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, T, H, E)), dtype)
    index = jnp.asarray(rng.integers(10, S - T, B))
    q_slot = index[:, None] + jnp.arange(T)
    valid = (jnp.arange(S)[None, :] >= jnp.asarray(rng.integers(0, 8, B))[:, None]) & (
        jnp.arange(S)[None, :] <= q_slot[:, -1:])
    live = jnp.asarray(rng.random(B) > 0.3)[:, None] & jnp.ones((1, T), bool)
    last = jnp.max(jnp.where(live, q_slot, 0).reshape(2, -1), axis=1).repeat(B // 2)
    past = (jnp.arange(S) // block)[None, None, :, None, None] > (last // block)[None, :, None, None, None]
    poisoned = tuple(jnp.where(past, jnp.nan, c) for c in (k, v))
    return (q, k, v, poisoned, valid, q_slot, live, block)


@pytest.mark.parametrize(("T", "K"), [(1, 2), (3, 2), (1, 1)])  # K 1: the cache's one-head view
def test_the_kernel_computes_the_block_loop_and_reads_no_block_past_the_live_one(T: int, K: int) -> None:
    q, k, v, (kp, vp), valid, q_slot, live, block = _case(T, K=K)
    rows = np.asarray(live[:, 0])
    assert 0 < rows.sum() < len(rows)
    # Each compiled once, the layer an argument as in the sampler's layer loop (not a compile per operation).
    block_loop, einsum_path = jax.jit(A.block_attention, static_argnums=(6, 7)), jax.jit(A.attention)
    kernel = jax.jit(D.decode_attention, static_argnums=(7,))
    for layer in range(3):
        want = block_loop(q, k, v, layer, valid, q_slot, block, k.shape[2] // block)
        mask = valid[:, None, :] & (jnp.arange(k.shape[2])[None, None, :] <= q_slot[:, :, None])
        einsum = einsum_path(q, k[layer], v[layer], mask)
        with pltpu.force_tpu_interpret_mode():
            got = kernel(q, kp, vp, layer, valid, q_slot, live, block)
        assert bool(jnp.all(jnp.isfinite(got[rows])))  # nothing past the live blocks was read
        np.testing.assert_allclose(np.asarray(got[rows]), np.asarray(want[rows]), atol=2e-5)
        np.testing.assert_allclose(np.asarray(got[rows]), np.asarray(einsum[rows]), atol=2e-5)


def test_the_kernel_runs_per_shard_under_a_mesh() -> None:
    """fsdp 2 x tensor 2: rows over the data axes, the two KV heads over tensor (shard_map), as the cache lies."""
    q, k, v, (kp, vp), valid, q_slot, live, block = _case(1)
    rows = np.asarray(live[:, 0])
    with pltpu.force_tpu_interpret_mode():
        one = D.decode_attention(q, kp, vp, 1, valid, q_slot, live, block)
        mesh = make_mesh(1, 2, 2, jax.devices()[:4])
        with jax.set_mesh(mesh):
            sharded = jax.jit(functools.partial(D.decode_attention, block=block))(q, kp, vp, 1, valid, q_slot, live)
    np.testing.assert_allclose(np.asarray(sharded[rows]), np.asarray(one[rows]), atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"max_num_sequences": 4}], ids=["all rows", "continuous"])
def test_sampling_with_the_kernel_gives_the_xla_paths_tokens(kw: dict[str, int]) -> None:
    """float32, a tiny model with 128-wide heads (the kernel's lane tiles): the same tokens and log-probs within
    rounding as the XLA block loop, all rows at once or continuously batched (rows at their own slots)."""
    cfg = ModelConfig(**{**TINY_MODEL, "head_dim": 128})
    params = M.init_params(cfg, jax.random.PRNGKey(3))
    B, P, n_new = 8, 16, 48
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, P)).astype(np.int32))
    valid = jnp.asarray(np.arange(P)[None, :] >= rng.integers(0, 6, (B, 1)))

    def run(decode_attention: str) -> tuple[np.ndarray, ...]:
        cc = ComputeConfig(dtype="float32", decode_block=8, decode_attention=decode_attention)
        f = jax.jit(functools.partial(sample, cfg=cfg, max_new_tokens=n_new, eos_id=tuple(range(10, 14)), pad_id=0,
                                      cc=cc, **kw))
        out = f(params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(5))
        return tuple(np.asarray(x) for x in out[:3])

    traced = jax.make_jaxpr(functools.partial(
        sample, cfg=cfg, max_new_tokens=n_new, eos_id=13, pad_id=0, cc=ComputeConfig(
            dtype="float32", decode_block=8, decode_attention="pallas"), **kw))(
        params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(5))
    assert "pallas_call" in str(traced)  # the decode steps run the kernel, not the fallback
    want = run("xla")
    assert len(set(want[2].sum(axis=1))) > 2  # rows end at different steps
    with pltpu.force_tpu_interpret_mode():
        got = run("pallas")
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[1], want[1], atol=2e-5)


def test_shapes_the_kernel_cannot_tile_fall_back_to_the_block_loop() -> None:
    assert D.supported(128, 1280, 256) and D.supported(256, 512, 128)
    assert not D.supported(64, 1280, 256)  # a head narrower than a lane tile
    assert not D.supported(128, 1300, 256)  # a cache of no whole number of blocks
    assert not D.supported(128, 1280, 0)


def test_auto_picks_the_kernel_on_tpu_only() -> None:
    cc = ComputeConfig()
    assert cc.on_platform("tpu").decode_attention == "pallas" and cc.on_platform("cpu").decode_attention == "xla"
    assert ComputeConfig(decode_attention="xla").on_platform("tpu").decode_attention == "xla"


@pytest.mark.parametrize("block", [64, 256])
def test_mosaic_lowers_the_kernel_at_block_sizes_below_a_lane_tile(block: int) -> None:
    """compiled for one v6e chip by libtpu: the valid mask's block is its whole last two dimensions, so a block of 64
    slots lowers too (a [8, 1, 64] block of the [B, 1, S] mask was refused by Mosaic: last dimension not a multiple of
    128 nor the array's)."""
    from tests.trainer.test_fit import V6E_2X2
    from trainer.fit import preflight as F

    F.prepare_environment(V6E_2X2)
    sh = jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0])
    L, B, S, K, E = 2, 16, 1024, 2, 128

    def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    cache = sds((L, B, S, K, E), jnp.bfloat16)
    args = (sds((B, 1, 4, E), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((B, S), bool),
            sds((B, 1), jnp.int32), sds((B, 1), bool))
    compiled = jax.jit(functools.partial(D.decode_attention, block=block)).lower(*args).compile()
    assert "custom_call_target=\"tpu_custom_call\"" in compiled.as_text()
