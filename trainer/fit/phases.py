"""The sampler's phases as programs of their own, and the physical lower bounds fit prints next to its estimates.

XLA's cost analysis counts a loop body once, and the sampler is loops in loops (decode steps, refills, layers), so
its compiled program says little about its time. fit therefore compiles each phase separately, as the sampler runs
it (trainer/rl/sampler.py: the same functions, shardings and weights layout), with its decoder layers unrolled so no
loop is left: the weights gathered for sampling (sampling.gather_weights, once per step), a prefill of the first
`sample_chunk_rows` prompts, a refill of one row per data-parallel group (continuous batching), and one decode step
(the token drawn, fed back through every layer against the P + N-slot cache). A phase is compiled with 2 and 4
layers and extrapolated linearly to the model's depth (the layers are identical), which keeps each compile small.
A decode step whose attention loops over cache blocks (compute.decode_block) is compiled with that loop unrolled,
reading one block and all of them, and priced at the mean number its step reads (`at_mean_blocks`).

Phase time x how often it runs (every row to max_new_tokens: the most a step can take) is the sample estimate.

Lower bounds, per RL step, on the target's peak bf16 FLOP/s and HBM bandwidth: prefill, reference log-probs and the
update take at least their model FLOPs over peak; a decode step takes at least the bytes each chip must read, its
share of the compute-dtype weights (split over the sampler's tensor axis: mesh.tensor, or sampling.tensor) plus its
rows' live KV cache (prompt + tokens so far, split over that axis where the KV heads divide), over HBM bandwidth (or its
FLOPs over peak, if more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.base.config import TrainConfig
from trainer.fit.flops import _fwd_flops, decode_blocks, param_count

# Layers of the two compiles a phase's per-layer cost is taken from. Not 1: libtpu prices a 1-layer decode step
# off the line the deeper ones lie on (Qwen3-8B on v6e 4x4: 1 layer 0.649 ms, 2 layers 0.637, 4 0.938, 6 1.211).
DEPTHS = (2, 4)
# A model of DEEP_LAYERS or more: the deeper compile further out. libtpu schedules programs of different depths
# differently, and the gap's share of that noise is multiplied by (layers - b) / (b - a) on the way out: Llama-3.1-70B's
# decode step on v5p 4x4x4 priced 0.631, 1.120, 1.670, 1.722 and 3.216 ms at 2, 4, 6, 8 and 16 layers, so 2 and 4
# layers put 80 at 19.7 ms, 2 and 8 at 14.8, and a line through all five at 14.6.
DEEP_DEPTHS = (2, 8)
DEEP_LAYERS = 32


def depths(layers: int) -> tuple[int, int]:
    """The two depths a model of `layers` layers is compiled at."""
    return DEEP_DEPTHS if layers >= DEEP_LAYERS else DEPTHS


def extrapolate(values: tuple[float, float], layers: int, at: tuple[int, int] = DEPTHS) -> float:
    """A figure compiled at `at` layers, extrapolated linearly to `layers` (never falling with depth)."""
    (a, b), (va, vb) = at, values
    return va + (layers - a) * max(vb - va, 0.0) / (b - a)


@dataclass(frozen=True)
class Phase:
    """One sampler phase to compile: its program on `cfg` (layers unrolled), abstract arguments, runs per step."""

    name: str
    program: Any
    args: tuple[Any, ...]
    runs: int
    blocks: tuple[float, int] | None = None  # a decode step's cache blocks read: the step's mean, and at most
    mesh: Any = None  # the mesh to lower it under: the sampler's (sampling.tensor regroups it)


def at_mean_blocks(one: tuple[float, float], all_deep: float, blocks: tuple[float, int],
                   at: tuple[int, int] = DEPTHS) -> tuple[float, float]:
    """A decode step's times at `at` layers reading its step's mean number of cache blocks, from its compiles
    reading one block (at both depths) and all of them (at the deeper): each layer reads the blocks, so a block's
    cost is per layer. (A 2-layer compile reading all blocks is priced off the line: Qwen3-8B on v6e 4x4, 1 block
    0.582 / 0.688 ms at 2 / 4 layers, 5 blocks 0.907 / 0.965 ms.)"""
    mean, most = blocks
    per_block_layer = max(all_deep - one[1], 0.0) / ((most - 1) * at[1])
    shallow, deep = (t + (mean - 1) * depth * per_block_layer for t, depth in zip(one, at, strict=True))
    return shallow, deep


def one_micro_batch(cfg: TrainConfig, micro_rows: int) -> TrainConfig:
    """`cfg` whose step is one of its update's micro-batches of `micro_rows` sequences: one minibatch, one
    micro-batch, one mu iteration, so its update program runs the forward and backward once and the optimizer once,
    with no loop left but the log-prob chunks'. (Groups shrink to fit: their size only shapes the advantages.)"""
    g = math.gcd(micro_rows, cfg.rl.group_size)
    return cfg.model_copy(update={
        "rl": cfg.rl.model_copy(update={"group_size": g, "prompts_per_step": micro_rows // g, "minibatches": 1,
                                        "mu_iterations": 1}),
        "compute": cfg.compute.model_copy(update={"train_micro_batch_size": None}),
        "sampling": cfg.sampling.model_copy(update={"max_num_sequences": None})})


def counts(cfg: TrainConfig, data_groups: int) -> dict[str, int]:
    """How often each phase runs in one step when every row generates max_new_tokens."""
    B, c, N = cfg.batch_size, cfg.sample_chunk_rows, cfg.sampling.max_new_tokens
    from trainer.rl.sampler import refill_size

    continuous = cfg.sampling.continuous_batching and c < B
    refill = refill_size(data_groups, c)
    return {
        "gather": int(bool(cfg.sampling.gather_weights)),
        "prefill": 1 if continuous else B // c,
        "refill": -(-(B - c) // refill) if continuous else 0,
        "decode": (B // c) * N,
    }


def with_depth(cfg: TrainConfig, layers: int) -> TrainConfig:
    """`cfg` with `layers` decoder layers, unrolled (no scan: the compiler then counts every layer)."""
    assert cfg.model is not None
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_layers": layers}),
                                  "compute": cfg.compute.model_copy(update={"scan_layers": False})})


def phases(cfg: TrainConfig, mesh: Any) -> list[Phase]:
    """The phases of `cfg`'s sampler on `mesh` (count > 0 only), built like trainer/rl/step.py's sample program."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.layout import Format, Layout
    from jax.sharding import NamedSharding

    from trainer.model import decoder as M
    from trainer.model import lora as L
    from trainer.model.sharding import (
        RULES,
        RULES_ACROSS_SLICES,
        RULES_GATHERED,
        batch_sharding,
        data_size,
        logical_to_spec,
        named_shardings,
        regroup,
    )
    from trainer.rl import sampler as S

    train_mesh, mesh = mesh, regroup(mesh, cfg.sampling.tensor)
    mcfg, cc, sc, lcfg = cfg.model_cfg, cfg.compute.on_platform(mesh.devices.flat[0].platform), cfg.sampling, cfg.lora
    P, N, c = cfg.prompt_len, sc.max_new_tokens, cfg.sample_chunk_rows
    groups = data_size(mesh)
    runs = counts(cfg, groups)
    R = S.refill_size(groups, c)
    rules = RULES_ACROSS_SLICES if cfg.mesh.fsdp_across_slices else RULES
    abstract = M.abstract_params(mcfg)
    param_sh = named_shardings(train_mesh, M.param_axes(mcfg), abstract, rules)
    dt = M.compute_dtype(mcfg, cc)
    if sc.gather_weights:
        w_abs = jax.eval_shape(lambda p: M.cast_weights(p, dt), abstract)
        w_sh = named_shardings(mesh, M.param_axes(mcfg), abstract, RULES_GATHERED)
    else:
        w_abs, w_sh = abstract, param_sh
    b1, b2 = batch_sharding(mesh, 1), batch_sharding(mesh, 2)

    def sds(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    weights = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), w_abs, w_sh)
    w_fmt = jax.tree.map(lambda s: Format(Layout.AUTO, s), w_sh)
    lora: tuple[Any, ...] = ()
    lora_sh: tuple[Any, ...] = ()
    if lcfg is not None:
        l_abs = L.abstract_lora(mcfg, lcfg)
        l_sh = named_shardings(mesh, L.lora_axes(mcfg, lcfg), l_abs, rules)  # as the sampler lays them out
        lora = (jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), l_abs, l_sh),)
        lora_sh = (l_sh,)

    def adapter(lora_w: tuple[Any, ...], slot: tuple[Any, ...]) -> M.Adapter | None:
        return None if lcfg is None else L.adapter(lora_w[0], slot[0], lcfg)

    def slot_arg(rows: int) -> tuple[Any, ...]:
        return () if lcfg is None else (sds((rows,), jnp.int32, b1),)

    out: list[Phase] = []
    if runs["gather"]:
        from trainer.rl.step import gather_for_sampling

        by_layer = mesh is not train_mesh
        unroll = not cc.scans(mcfg.n_layers)
        gather = jax.jit(lambda p: gather_for_sampling(p, dt, w_sh, by_layer, unroll), in_shardings=(param_sh,),
                         out_shardings=w_sh)
        out.append(Phase("gather", gather, (jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), abstract, param_sh),),
                         runs["gather"], mesh=mesh))

    def prefill_phase(name: str, rows: int, cache_len: int) -> Phase:
        def f(w: Any, prompt: Any, valid: Any, *rest: Any) -> Any:
            k = len(lora)
            return S.prefill(w, mcfg, prompt, valid, cache_len, cc, adapter(rest[:k], rest[k:]))

        args = (weights, sds((rows, P), jnp.int32, b2), sds((rows, P), bool, b2), *lora, *slot_arg(rows))
        shardings = (w_fmt, b2, b2, *lora_sh, *(a.sharding for a in slot_arg(rows)))
        return Phase(name, jax.jit(f, in_shardings=shardings), args, runs[name], mesh=mesh)

    out.append(prefill_phase("prefill", c, P + N))
    if runs["refill"]:
        out.append(prefill_phase("refill", R, P))

    continuous = runs["refill"] > 0
    kv_spec = logical_to_spec(("layers", "batch", "cache_seq", "kv_heads", "head_dim"),
                              (mcfg.n_layers, c, P + N, mcfg.n_kv_heads, mcfg.head_dim), mesh, rules)
    # The cache's and the weights' layouts are the compiler's to choose, as they are for the sampler's loop carry and
    # the weights it gathers (or hoists out of its loop): fixed ones add copies per layer that the loop does not have.
    kv_sh = NamedSharding(mesh, kv_spec)
    kv_fmt = Format(Layout.AUTO, kv_sh)
    kv = sds((mcfg.n_layers, c, P + N, mcfg.n_kv_heads, mcfg.head_dim), dt, kv_sh)
    # KVCache as a tree of ShapeDtypeStructs, and below of layouts (its fields are typed as the arrays).
    cache = M.KVCache(kv, kv, sds((c, P + N), bool, b2))  # type: ignore[arg-type]
    eos = jnp.asarray(0, jnp.int32)

    def decode(w: Any, cache: M.KVCache, logits_CV: Any, keys_C: Any, i_C: Any, n_prompt_C: Any, *rest: Any) -> Any:
        k = len(lora)
        tok_C, logp_C = S.pick(keys_C, i_C, logits_CV, sc.temperature, sc.top_k, sc.top_p)
        live_C = tok_C != eos
        slot = P + i_C if continuous else P + i_C[0]  # one slot for all rows, or each row its own
        logits, cache = S.decode_step(w, mcfg, tok_C, live_C, n_prompt_C + i_C, slot, cache, cc,
                                      adapter(rest[:k], rest[k:]))
        return logits, cache, logp_C  # the log-prob the sampler stores: priced, not dead code

    keys = sds((c, 2), jnp.uint32, b2)  # raw keys, as trainer/rl/step.py passes them
    # The loop carries the logits as the head writes them (model.logits_from_head): rows over data, vocab over tensor.
    v_sh = NamedSharding(mesh, logical_to_spec(("batch", "vocab"), (c, mcfg.vocab_size), mesh, rules))
    args = (weights, cache, sds((c, mcfg.vocab_size), jnp.float32, v_sh), keys, sds((c,), jnp.int32, b1),
            sds((c,), jnp.int32, b1), *lora, *slot_arg(c))
    fmt = M.KVCache(kv_fmt, kv_fmt, b2)  # type: ignore[arg-type]
    in_fmt = (w_fmt, fmt, *(a.sharding for a in args[2:6]), *lora_sh, *(a.sharding for a in slot_arg(c)))
    jitted = jax.jit(decode, in_shardings=in_fmt, out_shardings=(v_sh, fmt, None), donate_argnums=(1,))
    out.append(Phase("decode", jitted, args, runs["decode"], decode_blocks(cfg), mesh))
    return out


@dataclass(frozen=True)
class Bounds:
    """Physical lower bounds of one RL step's programs, seconds (all chips at peak FLOP/s or HBM bandwidth)."""

    prefill: float
    decode: float
    ref_logprobs: float
    update: float

    @property
    def sample(self) -> float:
        return self.prefill + self.decode


def bounds(cfg: TrainConfig, chips: int, peak_per_chip: float, bw_per_chip: float, model_flops: dict[str, float]
           ) -> Bounds:
    """Lower bounds (see the module docstring); `model_flops` per program as fit reports them."""
    import jax.numpy as jnp

    m, sm = cfg.model_cfg, cfg.sampler_mesh
    B, P, N, c = cfg.batch_size, cfg.prompt_len, cfg.sampling.max_new_tokens, cfg.sample_chunk_rows
    peak = chips * peak_per_chip
    prefill = B * _fwd_flops(m, P, P * (P + 1) / 2, 1) / peak
    cb = jnp.dtype(cfg.compute_dtype).itemsize
    weights = param_count(m) * cb / sm["tensor"]
    kv_shards = sm["tensor"] if m.n_kv_heads % sm["tensor"] == 0 else 1
    kv_token = m.n_layers * 2 * m.n_kv_heads * m.head_dim * cb / kv_shards
    rows_per_chip = c / (sm["slices"] * sm["fsdp"])
    decode = 0.0
    for i in range(N):  # every chunk (or wave of slots) of c rows at position P + i
        read = weights + rows_per_chip * kv_token * (P + i + 1)
        flops = c * _fwd_flops(m, 1, P + i + 1, 1)
        decode += max(read / bw_per_chip, flops / peak)
    decode *= B // c
    return Bounds(prefill, decode, model_flops.get("ref_logprobs", 0.0) / peak, model_flops.get("update", 0.0) / peak)
