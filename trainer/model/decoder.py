"""Llama / Mistral / Qwen2 / Qwen3 decoder: RMSNorm, RoPE (rotate_half; linear or Llama-3.1 scaling), GQA, SwiGLU,
optional q/k/v biases (Qwen2) and QK-norm (Qwen3).

Layers are stacked on a leading L axis and run with `lax.scan` (optionally rematerialised). Shape suffixes: B batch,
T query length, S key length (cache slots), D d_model, H query heads, K kv heads, G = H/K, E head_dim, F d_ff,
V vocab, L layers. Matmuls run in the compute dtype (`ComputeConfig.dtype`); norms, softmax, logits and log-probs
are fp32 whatever the parameter or compute dtype. LoRA adapters (trainer/model/lora.py) ride along as an `Adapter`: each
batch row adds its own slot's low-rank update to the targeted projections. The attention variants (XLA's einsum, the
flash and cuDNN kernels, the KV cache's block-wise reads and writes) are trainer/model/attention.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from trainer.base.config import ComputeConfig, ModelConfig
from trainer.model.attention import (
    attention,
    cached_attend,
    flash_attention,
    no_cache_attention,
    packed_attention,
    packed_order,
    write_slots,
)
from trainer.model.shapes import param_shapes
from trainer.model.sharding import constrain

Params = dict[str, Any]
f32 = jnp.float32
DEFAULT_COMPUTE = ComputeConfig()
# What a decoder layer keeps for the backward pass (compute.remat); None = everything.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Adapter(NamedTuple):
    """LoRA adapters for one pass (see trainer/model/lora.py for the layout): per target {"a": [(L,) S, *in, r],
    "b": [(L,) S, r, *out]}, and each row's gate [B, S], one-hot of its slot times the scale (all zero: the base model
    alone)."""

    weights: Params
    gate_BS: jax.Array


# einsum letters of the input and output dims of each projection an adapter can target (d_model, heads x head_dim,
# kv heads x head_dim, d_ff, vocab).
LORA_DIMS: dict[str, tuple[str, str]] = {
    "wq": ("d", "he"), "wk": ("d", "ke"), "wv": ("d", "ke"), "wo": ("he", "d"),
    "w_gate": ("d", "f"), "w_up": ("d", "f"), "w_down": ("f", "d"), "lm_head": ("d", "v"),
}


def lora_delta(x: jax.Array, ab: Params, gate_BS: jax.Array, key: str) -> jax.Array:
    """Every row's own adapter applied to x: scale x (x A_s) B_s for its slot s, as two dense matmuls over all slots.

    The low-rank activations [B, T, S, r] are computed for every slot and masked to the row's own (gate_BS) before the
    up-projection: one LoRA of rank S x r in which each row sees only its slot's columns. No gather or scatter, in the
    forward or the backward pass (the gradients of A and B are masked alike), which is what XLA runs well; the cost is
    S x r x (in + out) FLOPs per token, small next to the base's in x out while S x r << d_model.
    """
    ins, outs = LORA_DIMS[key]
    h = jnp.einsum(f"bt{ins},s{ins}r->btsr", x, ab["a"].astype(x.dtype))
    h = constrain(h, ("batch", "seq", None, None)) * gate_BS[:, None, :, None].astype(x.dtype)
    return jnp.einsum(f"btsr,sr{outs}->bt{outs}", h, ab["b"].astype(x.dtype))


class KVCache(NamedTuple):
    k_LBSKE: jax.Array
    v_LBSKE: jax.Array
    valid_BS: jax.Array  # which slots hold real (non-pad) tokens


def dtype_of(cfg: ModelConfig) -> jnp.dtype:
    return jnp.dtype(cfg.param_dtype)


def compute_dtype(cfg: ModelConfig, cc: ComputeConfig) -> jnp.dtype:
    return jnp.dtype(cc.dtype or cfg.param_dtype)


def cast_weights(p: Params, dt: jnp.dtype) -> Params:
    """Matrices and biases to the compute dtype; norm scales stay as stored (they are applied in fp32). Works on
    the whole tree or one layer's slice alike: norm scales are the leaves whose name says `norm`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, w: w if "norm" in jax.tree_util.keystr(path) else w.astype(dt), p)


def unstack_layers(params: Params) -> Params:
    """The stacked [L, ...] layer weights as a list of L per-layer trees, which `forward` runs unrolled. XLA on a
    GPU copies a layer's slice of a stacked weight before a GEMM reads it (a kernel per weight, layer and decode
    step: 112 of the ~470 kernels of a 1B model's decode step, each moving the weights once more); separate arrays
    are read in place."""
    L = jax.tree.leaves(params["layers"])[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda w, i=i: w[i], params["layers"]) for i in range(L)]}


def param_axes(cfg: ModelConfig) -> Params:
    """Same tree as the params, leaves are tuples of logical axis names (see sharding.RULES)."""
    layers: dict[str, tuple[str, ...]] = {
        "attn_norm": ("layers", "norm"),
        "wq": ("layers", "embed", "q_heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "q_heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "norm"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    }
    if cfg.qk_norm:
        layers["q_norm"] = ("layers", "norm")
        layers["k_norm"] = ("layers", "norm")
    if cfg.qkv_bias:
        layers["bq"] = ("layers", "q_heads", "head_dim")
        layers["bk"] = ("layers", "kv_heads", "head_dim")
        layers["bv"] = ("layers", "kv_heads", "head_dim")
    axes: Params = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("norm",)}
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def abstract_params(cfg: ModelConfig) -> Params:
    dt = dtype_of(cfg)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dt), param_shapes(cfg), is_leaf=is_shape)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Random init: norms at 1, biases at 0, matrices ~ N(0, 1/fan_in), residual outputs scaled down by sqrt(2L)."""
    dt = dtype_of(cfg)
    shapes = param_shapes(cfg)
    fan_in = {"wq": cfg.d_model, "wk": cfg.d_model, "wv": cfg.d_model, "wo": cfg.n_heads * cfg.head_dim,
              "w_gate": cfg.d_model, "w_up": cfg.d_model, "w_down": cfg.d_ff}
    residual_out = {"wo", "w_down"}
    keys = iter(jax.random.split(key, 16))

    def normal(shape: tuple[int, ...], std: float) -> jax.Array:
        return (std * jax.random.normal(next(keys), shape, f32)).astype(dt)

    layers: Params = {}
    for name, shape in shapes["layers"].items():
        if name in fan_in:
            std = fan_in[name] ** -0.5 / ((2 * cfg.n_layers) ** 0.5 if name in residual_out else 1.0)
            layers[name] = normal(shape, std)
        elif name in ("bq", "bk", "bv"):
            layers[name] = jnp.zeros(shape, dt)
        else:
            layers[name] = jnp.ones(shape, dt)
    # Tied: logits = normed_x @ embed.T with |normed_x| ~ sqrt(D), so std D^-1/2 keeps initial logits O(1).
    params: Params = {
        "embed": normal(shapes["embed"], cfg.d_model**-0.5 if cfg.tie_embeddings else 0.02),
        "layers": layers,
        "final_norm": jnp.ones(shapes["final_norm"], dt),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = normal(shapes["lm_head"], cfg.d_model**-0.5)
    return params


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(f32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(f32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """RoPE inverse frequencies [E/2] in fp32, with transformers' `linear` or `llama3` (Llama 3.1) scaling."""
    E = cfg.head_dim
    inv_freq_e = 1.0 / cfg.rope_theta ** (jnp.arange(0, E, 2, dtype=f32) / E)
    if cfg.rope_type == "linear":
        return inv_freq_e / cfg.rope_factor
    if cfg.rope_type == "llama3":
        # Wavelengths longer than original_len / low_freq_factor are stretched by `factor`, those shorter than
        # original_len / high_freq_factor are kept, and in between the two are blended linearly in
        # original_len / wavelength (same operations and fp32 order as transformers).
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        original_len = cfg.rope_original_max_len or cfg.max_seq_len
        wavelen_e = 2 * jnp.pi / inv_freq_e
        long_e = wavelen_e > original_len / low
        scaled_e = jnp.where(long_e, inv_freq_e / factor, inv_freq_e)
        smooth_e = (original_len / wavelen_e - low) / (high - low)
        blended_e = (1 - smooth_e) * scaled_e / factor + smooth_e * scaled_e
        medium_e = ~(wavelen_e < original_len / high) & ~long_e
        return jnp.where(medium_e, blended_e, scaled_e)
    return inv_freq_e


def rope_tables(pos_BT: jax.Array, cfg: ModelConfig, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, 1, E] for `rope`, computed in fp32 and cast to `dtype`, as transformers does (its rotary
    embedding returns them in the activations' dtype). Once per forward, not per layer."""
    ang_BTe = pos_BT.astype(f32)[..., None] * rope_inv_freq(cfg)
    ang_BTE = jnp.concatenate([ang_BTe, ang_BTe], axis=-1)[:, :, None, :]
    return jnp.cos(ang_BTE).astype(dtype), jnp.sin(ang_BTE).astype(dtype)


def rotates_by_product(dtype: Any) -> bool:
    """Whether `rotate_half` is a matmul in this activation dtype (trainer/fit/flops.py counts its FLOPs by it): bf16
    and fp16, not fp32, where a full-precision product would be six bf16 passes on TPU."""
    return jnp.dtype(dtype) != f32


def rotate_half(x_BTHE: jax.Array) -> jax.Array:
    """transformers' rotate_half, (x1, x2) -> (-x2, x1). Where `rotates_by_product`, a product with a signed
    permutation: on TPU a lane-dim split and concatenation is a relayout pass of its own, while a [E, E] product
    fuses with the norm before it and the rotation after; exact, one nonzero term per output."""
    if not rotates_by_product(x_BTHE.dtype):
        x1, x2 = jnp.split(x_BTHE, 2, axis=-1)
        return jnp.concatenate([-x2, x1], axis=-1)
    E = x_BTHE.shape[-1]
    r_EE = np.zeros((E, E), np.float32)  # a constant of the program, not a scatter in it
    r_EE[np.arange(E // 2) + E // 2, np.arange(E // 2)] = -1
    r_EE[np.arange(E // 2), np.arange(E // 2) + E // 2] = 1
    return jnp.einsum("bthe,ef->bthf", x_BTHE, jnp.asarray(r_EE, x_BTHE.dtype))


def rope(x_BTHE: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Hugging Face rotate_half RoPE in the activations' dtype: pairs are (i, i + E/2), not interleaved."""
    cos_BT1E, sin_BT1E = tables
    return x_BTHE * cos_BT1E + rotate_half(x_BTHE) * sin_BT1E


def positions_from_valid(valid_BT: jax.Array) -> jax.Array:
    """Position ids count real tokens only, so left padding does not shift RoPE phases."""
    return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1, 0)


@jax.custom_vjp
def token_dense(x_BTI: jax.Array, w_IO: jax.Array) -> jax.Array:
    """x @ w over the last axis (compute.dense_grad transposed): its weight gradient, a matmul over the tokens,
    reads x's transpose written out first, so both operands are in the canonical layout. XLA's CPU otherwise wrote
    the [T, F] output gradient transposed (fused into the SwiGLU backward) and ran the matmul with a transposed left
    operand, which YNNPACK refuses (Eigen ran it): 8 % of the CPU update step (bench/README.md "Against Tunix").
    The barrier keeps the algebraic simplifier from folding the transpose back into the dot."""
    return jnp.einsum("bti,io->bto", x_BTI, w_IO)


def _token_dense_fwd(x_BTI: jax.Array, w_IO: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return token_dense(x_BTI, w_IO), (x_BTI, w_IO)


def _token_dense_bwd(res: tuple[jax.Array, jax.Array], g_BTO: jax.Array) -> tuple[jax.Array, jax.Array]:
    x_BTI, w_IO = res
    dx = jnp.einsum("bto,io->bti", g_BTO, w_IO)
    x_IN = jax.lax.optimization_barrier(x_BTI.reshape(-1, x_BTI.shape[-1]).T)
    dw = jnp.dot(x_IN, g_BTO.reshape(-1, g_BTO.shape[-1]).astype(x_IN.dtype), preferred_element_type=w_IO.dtype)
    return dx, dw.astype(w_IO.dtype)


token_dense.defvjp(_token_dense_fwd, _token_dense_bwd)
MLP_WEIGHTS = ("w_gate", "w_up", "w_down")  # what compute.dense_grad covers: the rest already ran canonical


def _layer(
    cfg: ModelConfig,
    x_BTD: jax.Array,
    p: Params,
    rope_tab: tuple[jax.Array, jax.Array],
    attend: Any,
    kv: tuple[jax.Array, jax.Array, jax.Array] | None,
    index: jax.Array | int,
    lora: Params | None = None,
    gate_BS: jax.Array | None = None,
    transposed_grads: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array] | None]:
    def proj(spec: str, x: jax.Array, key: str) -> jax.Array:
        if transposed_grads and key in MLP_WEIGHTS and (lora is None or key not in lora):
            return token_dense(x, p[key])
        y = jnp.einsum(spec, x, p[key])
        if lora is not None and key in lora:
            y = y + lora_delta(x, lora[key], gate_BS, key)  # type: ignore[arg-type]  # gate_BS comes with lora
        return y

    h = rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps)
    q = proj("btd,dhe->bthe", h, "wq")
    k = proj("btd,dke->btke", h, "wk")
    v = proj("btd,dke->btke", h, "wv")
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = constrain(q, ("batch", "seq", "q_heads", None))
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.norm_eps)
    q = rope(q, rope_tab)
    k = rope(k, rope_tab)
    if kv is not None:  # the new keys and values written into the whole cache in place
        k_all, v_all, layer = kv
        k_all, v_all = write_slots(k_all, k, index, layer), write_slots(v_all, v, index, layer)
        kv = (k_all, v_all, layer)
    attn = attend(q, k, v, kv)  # a decode step reads the cache; a pass from slot 0 reads its own keys
    x_BTD = x_BTD + proj("bthe,hed->btd", attn, "wo")
    x_BTD = constrain(x_BTD, ("batch", "seq", None))
    h = rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps)
    gate = proj("btd,df->btf", h, "w_gate")
    up = proj("btd,df->btf", h, "w_up")
    ff = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    x_BTD = x_BTD + proj("btf,fd->btd", ff, "w_down")
    return constrain(x_BTD, ("batch", "seq", None)), kv


def init_cache(cfg: ModelConfig, batch: int, length: int, cc: ComputeConfig = DEFAULT_COMPUTE) -> KVCache:
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    dt = compute_dtype(cfg, cc)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((batch, length), bool))


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens_BT: jax.Array,
    valid_BT: jax.Array,
    positions_BT: jax.Array | None = None,
    cache: KVCache | None = None,
    index: jax.Array | int = 0,
    cc: ComputeConfig = DEFAULT_COMPUTE,
    adapter: Adapter | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Final-normed hidden states [B, T, D] in the compute dtype (see `logits`) and the updated cache.

    Without a cache, keys are the T inputs (causal, pad keys masked). With a cache, the T new tokens are
    written at slots [index, index + T) (`index` one int, or one per row) and attend to every valid slot up to their
    own. With an adapter, each row adds its own slot's LoRA updates to the targeted projections.
    """
    B, T = tokens_BT.shape
    dt = compute_dtype(cfg, cc)
    if positions_BT is None:
        positions_BT = positions_from_valid(valid_BT)
    # Training gathers from a replicated copy of the table: a gather out of the (vocab, embed)-sharded table makes
    # GSPMD produce an embed-sharded result it can only move to batch sharding by full rematerialisation. Sampling
    # (a cache) gathers from the vocab-sharded table (a masked gather and an all-reduce of the rows' embeddings):
    # replicating the table would move all of it at every decode step.
    table_VD = constrain(params["embed"].astype(dt), (None, None) if cache is None else ("vocab", None))
    x_BTD = constrain(table_VD[tokens_BT], ("batch", "seq", None))
    q_slot_BT = jnp.broadcast_to(jnp.reshape(index, (-1, 1)) + jnp.arange(T), (B, T))
    # A pass from slot 0 (a prefill) attends among its own T tokens, the slots it writes, as a pass without a cache
    # does: with the same kernels, and no read back of the cache just written. cuDNN's packed rows would move them.
    prefill = cache is not None and isinstance(index, int) and index == 0
    kind = "cache" if cache is not None and not prefill else no_cache_attention(cc, T)
    if prefill and kind == "cudnn":
        kind = "xla"
    if cache is not None:
        valid_BS = write_slots(cache.valid_BS, valid_BT.astype(bool), index)
    if kind != "cache":
        mask_BTS = valid_BT[:, None, :] & (jnp.arange(T)[None, None, :] <= q_slot_BT[:, :, None])

    lora_layers = (adapter.weights.get("layers") or None) if adapter is not None else None
    gate_BS = adapter.gate_BS if adapter is not None else None
    if kind == "cache":
        attend = cached_attend(valid_BS, q_slot_BT, valid_BT.astype(bool), index, cc.decode_block,
                                kernel=cc.decode_attention == "pallas")
    elif kind == "flash":
        valid = valid_BT.astype(bool)
        attend = lambda q, k, v, kv: flash_attention(q, k, v, valid)  # noqa: E731
    elif kind == "cudnn":
        # The layers run on packed rows (valid tokens first): cuDNN's masks are causal and a length per row.
        order_BT, back_BT, lengths_B = packed_order(valid_BT)
        x_BTD = jnp.take_along_axis(x_BTD, order_BT[:, :, None], axis=1)
        positions_BT = jnp.take_along_axis(positions_BT, order_BT, axis=1)
        attend = lambda q, k, v, kv: packed_attention(q, k, v, lengths_B)  # noqa: E731
    else:
        attend = lambda q, k, v, kv: attention(q, k, v, mask_BTS)  # noqa: E731

    rope_tab = rope_tables(positions_BT, cfg, dt)

    # The cache rides in the carry (updated in place); the layers' weights are the scanned inputs.
    def body(carry: tuple[jax.Array, Any], xs: tuple[Params, Params | None, jax.Array | int]) -> tuple[Any, None]:
        x, kv = carry
        p, lp, layer = xs
        lp = None if lp is None else cast_weights(lp, dt)
        x, kv = _layer(cfg, x, cast_weights(p, dt), rope_tab, attend,
                       None if kv is None else (*kv, layer), index, lp, gate_BS, cc.dense_grad == "transposed")
        return (x, None if kv is None else kv[:2]), None

    scans = cc.scans(cfg.n_layers)
    if cc.remat != "none":
        # prevent_cse=False is safe (and faster) inside scan, per jax.checkpoint's docs; unrolled, XLA would merge
        # the recomputed forward with the first one, and the remat (its memory saving) would be gone.
        body = jax.checkpoint(body, policy=REMAT_POLICIES[cc.remat], prevent_cse=not scans)

    kv_in = None if cache is None else (cache.k_LBSKE, cache.v_LBSKE)
    if isinstance(params["layers"], (list, tuple)):  # `unstack_layers`: one array per layer, no slice to take
        carry = (x_BTD, kv_in)
        for i, p in enumerate(params["layers"]):
            lp = None if lora_layers is None else jax.tree.map(lambda w, i=i: w[i], lora_layers)
            carry, _ = body(carry, (p, lp, i))
        x_BTD, kv_out = carry
    else:
        (x_BTD, kv_out), _ = jax.lax.scan(body, (x_BTD, kv_in),
                                          (params["layers"], lora_layers, jnp.arange(cfg.n_layers)),
                                          unroll=1 if scans else True)
    if kind == "cudnn":  # back to the rows' own order
        x_BTD = jnp.take_along_axis(x_BTD, back_BT[:, :, None], axis=1)
    x_BTD = rms_norm(x_BTD, params["final_norm"], cfg.norm_eps)
    new_cache = None if cache is None or kv_out is None else KVCache(kv_out[0], kv_out[1], valid_BS)
    return x_BTD, new_cache


def head_weight(params: Params, cfg: ModelConfig) -> jax.Array:
    """The output projection as [D, V] or, tied, the [V, D] embedding (see `logits_from_head`)."""
    return params["embed"] if cfg.tie_embeddings else params["lm_head"]


def logits_from_head(w: jax.Array, cfg: ModelConfig, x_BTD: jax.Array, head_lora: Params | None = None,
                     gate_BS: jax.Array | None = None) -> jax.Array:
    """fp32 logits [B, T, V], vocab-sharded like the head; the matmul runs in x's (compute) dtype. `head_lora`: an
    lm_head adapter stack, each row using its gate_BS slot."""
    spec = "btd,vd->btv" if cfg.tie_embeddings else "btd,dv->btv"
    out = jnp.einsum(spec, x_BTD, w.astype(x_BTD.dtype), preferred_element_type=f32)
    if head_lora is not None:
        # gate_BS comes with head_lora (the callers pass both or neither).
        out = out + lora_delta(x_BTD, head_lora, gate_BS, "lm_head").astype(f32)  # type: ignore[arg-type]
    return constrain(out, ("batch", "seq", "vocab"))


def _head_lora(adapter: Adapter | None) -> tuple[Params | None, jax.Array | None]:
    if adapter is None:
        return None, None
    return adapter.weights.get("lm_head"), adapter.gate_BS


def logits(params: Params, cfg: ModelConfig, x_BTD: jax.Array, adapter: Adapter | None = None) -> jax.Array:
    return logits_from_head(head_weight(params, cfg), cfg, x_BTD, *_head_lora(adapter))


def logprobs_and_entropy(
    logits_BTV: jax.Array, targets_BT: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """log p(target) and the entropy of softmax(logits / temperature); temperature 0 is treated as 1.

    Written as reductions over the vocab (logsumexp, a masked sum for the target) rather than a gather, so a
    vocab-sharded input stays sharded: each device reduces its slice and only [B, T] values cross devices.
    """
    scaled = logits_BTV / (temperature if temperature > 0 else 1.0)
    # One pass after the max for both sums (Z = sum e, W = sum e * s, e = exp(s - max)): lse = max + log Z and
    # entropy = lse - W / Z, where exp(s - lse) summed against s again would read the logits a third time.
    m_BT = jnp.max(scaled, axis=-1)
    m_BT = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m_BT), m_BT, 0.0))  # as logsumexp shifts: no gradient
    e_BTV = jnp.exp(scaled - m_BT[..., None])
    z_BT = jnp.sum(e_BTV, axis=-1)
    lse_BT = m_BT + jnp.log(z_BT)
    vocab_V = jnp.arange(scaled.shape[-1], dtype=targets_BT.dtype)
    target_BT = jnp.sum(jnp.where(vocab_V == targets_BT[..., None], scaled, 0.0), axis=-1)
    entropy_BT = lse_BT - jnp.sum(e_BTV * scaled, axis=-1) / z_BT
    return target_BT - lse_BT, entropy_BT


def chunked_logprobs(
    params: Params,
    cfg: ModelConfig,
    x_BND: jax.Array,
    targets_BN: jax.Array,
    temperature: float,
    chunk: int,
    adapter: Adapter | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`logprobs_and_entropy(logits(x))` over N in chunks of `chunk` tokens.

    Only one chunk's fp32 [B, chunk, V] logits exist at a time, and the backward pass recomputes them chunk by
    chunk (jax.checkpoint) instead of keeping them for the whole sequence.
    """
    B, N, D = x_BND.shape
    C = min(chunk, N)
    n = -(-N // C)
    pad = n * C - N
    x_BND = jnp.pad(x_BND, ((0, 0), (0, pad), (0, 0)))
    targets_BN = jnp.pad(targets_BN, ((0, 0), (0, pad)))
    x_nBCD = x_BND.reshape(B, n, C, D).swapaxes(0, 1)
    t_nBC = targets_BN.reshape(B, n, C).swapaxes(0, 1)

    @jax.checkpoint
    def one(w: jax.Array, head: Params | None, gate_BS: jax.Array | None, x_BCD: jax.Array, t_BC: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
        x_BCD = constrain(x_BCD, ("batch", None, None))
        return logprobs_and_entropy(logits_from_head(w, cfg, x_BCD, head, gate_BS), t_BC, temperature)

    w = head_weight(params, cfg)
    head, gate_BS = _head_lora(adapter)
    _, (logp_nBC, ent_nBC) = jax.lax.scan(lambda _, xs: (None, one(w, head, gate_BS, *xs)), None, (x_nBCD, t_nBC))
    logp_BN = logp_nBC.swapaxes(0, 1).reshape(B, n * C)[:, :N]
    ent_BN = ent_nBC.swapaxes(0, 1).reshape(B, n * C)[:, :N]
    return logp_BN, ent_BN


def completion_logprobs(
    params: Params,
    cfg: ModelConfig,
    prompt_BP: jax.Array,
    prompt_valid_BP: jax.Array,
    completion_BN: jax.Array,
    completion_mask_BN: jax.Array,
    temperature: float = 1.0,
    cc: ComputeConfig = DEFAULT_COMPUTE,
    adapter: Adapter | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs [B, N] (and entropies) of `completion` given the (any-padded) prompt."""
    tokens = jnp.concatenate([prompt_BP, completion_BN], axis=1)
    valid = jnp.concatenate([prompt_valid_BP, completion_mask_BN], axis=1).astype(bool)
    x_BTD, _ = forward(params, cfg, tokens, valid, cc=cc, adapter=adapter)
    P = prompt_BP.shape[1]
    N = completion_BN.shape[1]
    # Hidden state at t predicts token t + 1, except that the first completion token is predicted by the
    # last valid prompt token, which is not at P - 1 when the prompt is right-padded.
    last_valid_B = jnp.max(jnp.where(prompt_valid_BP, jnp.arange(P)[None, :], 0), axis=1)
    n_N = jnp.arange(N)[None, :]
    pred_idx_BN = jnp.where(n_N == 0, last_valid_B[:, None], P - 1 + n_N)
    x_BND = jnp.take_along_axis(x_BTD, pred_idx_BN[..., None], axis=1)
    return chunked_logprobs(params, cfg, x_BND, completion_BN, temperature, cc.logprob_chunk, adapter)
