from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from trainer.base.config import ModelConfig, RLConfig
from trainer.model import attention as A
from trainer.model import decoder as M
from trainer.model.sharding import batch_sharding, make_mesh, named_shardings
from trainer.rl.losses import group_advantages, policy_loss

from .conftest import TINY_MODEL


# ---- an independent NumPy reference: plain loops over layers, heads and positions ------------------------
def _np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * w


def _np_rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """x [T, E]; Hugging Face rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for i in range(half):
            ang = pos[t] / theta ** (2 * i / x.shape[-1])
            c, s = np.cos(ang), np.sin(ang)
            out[t, i] = x[t, i] * c - x[t, i + half] * s
            out[t, i + half] = x[t, i + half] * c + x[t, i] * s
    return out


def np_reference_logits(p: dict, cfg: ModelConfig, tokens: np.ndarray) -> np.ndarray:
    """Logits [T, V] for one unpadded sequence."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    T = len(tokens)
    pos = np.arange(T)
    x = p["embed"][tokens]
    group = cfg.n_heads // cfg.n_kv_heads
    for layer in range(cfg.n_layers):
        lp = {k: v[layer] for k, v in p["layers"].items()}
        h = _np_rms(x, lp["attn_norm"], cfg.norm_eps)
        attn_out = np.zeros((T, cfg.n_heads, cfg.head_dim))
        for head in range(cfg.n_heads):
            kv = head // group
            q = h @ lp["wq"][:, head, :]
            k = h @ lp["wk"][:, kv, :]
            v = h @ lp["wv"][:, kv, :]
            if cfg.qk_norm:
                q = _np_rms(q, lp["q_norm"], cfg.norm_eps)
                k = _np_rms(k, lp["k_norm"], cfg.norm_eps)
            q, k = _np_rope(q, pos, cfg.rope_theta), _np_rope(k, pos, cfg.rope_theta)
            scores = q @ k.T / np.sqrt(cfg.head_dim)
            scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            attn_out[:, head, :] = (w / w.sum(-1, keepdims=True)) @ v
        x = x + np.einsum("the,hed->td", attn_out, lp["wo"])
        h = _np_rms(x, lp["mlp_norm"], cfg.norm_eps)
        gate, up = h @ lp["w_gate"], h @ lp["w_up"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lp["w_down"]
    x = _np_rms(x, p["final_norm"], cfg.norm_eps)
    return x @ (p["embed"].T if cfg.tie_embeddings else p["lm_head"])


def _jit_logits(cfg: ModelConfig):  # noqa: ANN202
    return jax.jit(lambda p, tokens, valid: M.logits(p, cfg, M.forward(p, cfg, tokens, valid)[0]))


def _randomize_norms(params: dict, key: jax.Array) -> dict:
    """Norm scales start at 1; perturb them so the test sees whether they are applied in the right place."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = [x * (1 + 0.3 * jax.random.normal(k, x.shape)) if "norm" in str(path) else x
           for (path, _), x, k in zip(jax.tree_util.tree_flatten_with_path(params)[0], leaves, keys, strict=True)]
    return jax.tree.unflatten(tree, out)


@pytest.mark.parametrize("variant", [
    {},  # untied, QK-norm, GQA 4/2 (Qwen3-like)
    {"qk_norm": False, "tie_embeddings": True, "n_kv_heads": 4},  # Llama-like MHA, tied
    {"n_kv_heads": 1, "rope_theta": 100.0},  # MQA, fast-rotating RoPE
])
def test_forward_matches_numpy_reference(variant: dict) -> None:
    cfg = ModelConfig(**{**TINY_MODEL, **variant})
    params = _randomize_norms(M.init_params(cfg, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
    tokens = np.array([1, 17, 42, 5, 99, 3, 64, 8, 23], np.int32)
    got = np.asarray(_jit_logits(cfg)(params, tokens[None], jnp.ones((1, len(tokens)), bool))[0])
    want = np_reference_logits(params, cfg, tokens)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_padding_does_not_change_logits() -> None:
    """Left padding is masked out and position ids count real tokens only."""
    cfg = ModelConfig(**TINY_MODEL)
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.array([[5, 6, 7, 8, 9]])
    padded = jnp.array([[0, 0, 0, 5, 6, 7, 8, 9]])
    valid = padded != 0
    f = _jit_logits(cfg)
    np.testing.assert_allclose(np.asarray(f(params, padded, valid)[:, 3:]),
                               np.asarray(f(params, tokens, jnp.ones_like(tokens, bool))), rtol=1e-5, atol=1e-5)


def test_completion_logprobs_any_prompt_padding() -> None:
    cfg = ModelConfig(**TINY_MODEL)
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    left = jnp.array([[0, 0, 11, 12, 13]])
    right = jnp.array([[11, 12, 13, 0, 0]])
    comp = jnp.array([[20, 21, 2, 0]])
    cmask = jnp.array([[1, 1, 1, 0]])
    f = jax.jit(functools.partial(M.completion_logprobs, cfg=cfg), static_argnames=())
    lp_l, _ = f(params, prompt_BP=left, prompt_valid_BP=left != 0, completion_BN=comp, completion_mask_BN=cmask)
    lp_r, _ = f(params, prompt_BP=right, prompt_valid_BP=right != 0, completion_BN=comp, completion_mask_BN=cmask)
    np.testing.assert_allclose(np.asarray(lp_l[:, :3]), np.asarray(lp_r[:, :3]), rtol=1e-5, atol=1e-6)
    # And both equal the log-softmax of the plain full-sequence logits.
    full = jnp.array([[11, 12, 13, 20, 21, 2]])
    logp = jax.nn.log_softmax(_jit_logits(cfg)(params, full, jnp.ones_like(full, bool)), -1)
    want = [float(logp[0, 2 + i, int(full[0, 3 + i])]) for i in range(3)]
    np.testing.assert_allclose(np.asarray(lp_l[0, :3]), want, rtol=1e-5, atol=1e-6)


def test_param_axes_cover_every_param() -> None:
    for variant in ({}, {"qk_norm": False, "tie_embeddings": True}):
        cfg = ModelConfig(**{**TINY_MODEL, **variant})
        params = M.init_params(cfg, jax.random.PRNGKey(0))
        axes = M.param_axes(cfg)
        is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
        assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=is_axes)
        for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=is_axes), strict=True):
            assert p.ndim == len(a)


def _loss_and_grad_norm(cfg: ModelConfig, rl: RLConfig, params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    def loss_fn(p: dict) -> jax.Array:
        logp, _ = M.completion_logprobs(p, cfg, batch["prompt"], batch["prompt_valid"], batch["completion"],
                                        batch["mask"])
        adv = group_advantages(batch["rewards"], rl.group_size)
        return policy_loss(logp, batch["old_logp"], adv, batch["mask"], rl)[0]

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))


def test_loss_on_8_device_mesh_equals_single_device() -> None:
    cfg = ModelConfig(**TINY_MODEL)
    rl = RLConfig(group_size=4, prompts_per_step=2)
    params = M.init_params(cfg, jax.random.PRNGKey(3))
    rng = np.random.default_rng(0)
    B, P, N = 8, 6, 5
    prompt = rng.integers(3, 100, (B, P)).astype(np.int32)
    prompt[:, :2] = 0  # left padding
    mask = (np.arange(N)[None] < rng.integers(1, N + 1, (B, 1))).astype(np.int32)
    batch = {
        "prompt": prompt, "prompt_valid": (prompt != 0).astype(np.int32),
        "completion": rng.integers(3, 100, (B, N)).astype(np.int32) * mask, "mask": mask,
        "old_logp": (-4.6 + 0.1 * rng.standard_normal((B, N))).astype(np.float32) * mask,
        "rewards": rng.random(B).astype(np.float32),
    }
    fn = functools.partial(_loss_and_grad_norm, cfg, rl)
    want = jax.jit(fn)(params, batch)

    mesh = make_mesh(2, 2, 2)
    p_sh = named_shardings(mesh, M.param_axes(cfg), params)
    sharded_params = jax.device_put(params, p_sh)
    sharded_batch = {k: jax.device_put(v, batch_sharding(mesh, v.ndim)) for k, v in batch.items()}
    assert isinstance(sharded_params["layers"]["wq"].sharding, NamedSharding)
    assert len(sharded_params["layers"]["wq"].sharding.device_set) == 8
    with jax.set_mesh(mesh):
        got = jax.jit(fn)(sharded_params, sharded_batch)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4)
    assert float(want[1]) > 0


def _flash_case() -> tuple[ModelConfig, M.Params, tuple[jax.Array, ...]]:
    """128 tokens (the kernel's block), left- and right-padded prompts and a completion cut short."""
    cfg = ModelConfig(**{**TINY_MODEL, "max_seq_len": 256})
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    B, P, N = 8, 32, 96
    valid = np.ones((B, P), bool)
    valid[0, :10] = False
    valid[1, 20:] = False
    mask = np.ones((B, N), bool)
    mask[2, 50:] = False
    data = (rng.integers(3, cfg.vocab_size, (B, P)), valid, rng.integers(3, cfg.vocab_size, (B, N)), mask)
    return cfg, params, tuple(jnp.asarray(x, jnp.int32 if x.dtype != bool else bool) for x in data)


def _matches_the_einsum_path(attention: str, context: Any = contextlib.nullcontext) -> None:
    """compute.attention `attention` gives the einsum path's log-probs and gradient on _flash_case, on one device and
    under an fsdp 2 x tensor 2 mesh, each traced inside `context()`."""
    from trainer.base.config import ComputeConfig

    cfg, params, (prompt, valid, completion, mask) = _flash_case()

    def loss(p: M.Params, prompt: jax.Array, completion: jax.Array, attention: str) -> tuple[jax.Array, jax.Array]:
        lp, _ = M.completion_logprobs(p, cfg, prompt, valid, completion, mask, cc=ComputeConfig(attention=attention))
        return jnp.sum(lp * mask), lp * mask

    grad = jax.value_and_grad(loss, has_aux=True)
    (want, want_lp), want_g = grad(params, prompt, completion, "xla")
    mesh = make_mesh(1, 2, 2, jax.devices()[:4])
    sharded = jax.device_put(params, named_shardings(mesh, M.param_axes(cfg), params))
    for where in ("one device", "mesh"):
        with context():
            if where == "one device":
                (got, got_lp), got_g = jax.jit(grad, static_argnums=3)(params, prompt, completion, attention)
            else:
                with jax.set_mesh(mesh):
                    rows = (jax.device_put(x, batch_sharding(mesh, 2)) for x in (prompt, completion))
                    (got, got_lp), got_g = jax.jit(grad, static_argnums=3)(sharded, *rows, attention)
        np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), atol=2e-5, err_msg=where)
        assert float(got) == pytest.approx(float(want), rel=1e-6)
        for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4, err_msg=where)


def test_flash_attention_kernel_matches_the_einsum_path() -> None:
    """The Pallas TPU kernel (run in Pallas' TPU interpret mode here) gives the einsum path's log-probs and gradient,
    on one device and per shard under an fsdp 2 x tensor 2 mesh (shard_map: rows and heads split)."""
    from jax.experimental.pallas import tpu as pltpu

    _matches_the_einsum_path("flash", pltpu.force_tpu_interpret_mode)


def test_packed_rows_attention_matches_the_einsum_path() -> None:
    """compute.attention cudnn: the layers run on rows packed valid-tokens-first, attention as
    jax.nn.dot_product_attention's causal + per-row-length masks (here through XLA; cuDNN's kernel on a GPU is
    checked by bench/gpu.py), and give the einsum path's log-probs and gradient, left pads, interior pads (a
    right-padded prompt before its completion) and a cut completion alike, on one device and an fsdp 2 x tensor 2
    mesh."""
    _matches_the_einsum_path("cudnn")


def test_packed_order_moves_valid_tokens_first_in_order() -> None:
    valid = jnp.asarray([[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    order, back, lengths = A.packed_order(valid)
    assert lengths.tolist() == [3, 4, 6]
    assert order.tolist() == [[2, 3, 4, 0, 1, 5], [0, 1, 4, 5, 2, 3], [0, 1, 2, 3, 4, 5]]
    x = jnp.arange(18).reshape(3, 6)
    assert (jnp.take_along_axis(jnp.take_along_axis(x, order, 1), back, 1) == x).all()


def test_auto_attention_is_each_platforms_fused_kernel() -> None:
    from trainer.base.config import ComputeConfig

    assert [ComputeConfig().on_platform(p).attention for p in ("tpu", "gpu", "cpu")] == ["flash", "cudnn", "xla"]
    assert ComputeConfig(attention="xla").on_platform("gpu").attention == "xla"


def test_flash_attention_skips_no_visible_block_and_reads_grouped_heads_in_place() -> None:
    """384 tokens: three 128-token blocks, so the kernel's causal block skipping and its cross-block online softmax
    run (the interpreted kernel's cost grows with the block pairs: 6 causal ones here, 15 at five blocks, which
    tested nothing more); 8 query heads read 2 KV heads, and the gradient reaches both KV heads through the kernel's
    grouped index maps alone (no repeat in the program). Left pads in one row (a whole block and part of the next),
    right pads in another."""
    from jax.experimental.pallas import tpu as pltpu

    B, T, H, K, E = 2, 384, 8, 2, 16
    assert T % A.FLASH_BLOCK == 0 and T % A.FLASH_BLOCK_MAX != 0  # gcd(384, 512) = 128: three blocks
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, T, n, E), jnp.float32) for i, n in enumerate((H, K, K)))
    valid = np.ones((B, T), bool)
    valid[0, :200], valid[1, 300:] = False, False
    valid = jnp.asarray(valid)
    slot = jnp.arange(T)
    mask = valid[:, None, :] & (slot[None, None, :] <= slot[None, :, None])

    def loss(attend, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = attend(q, k, v) * valid[:, :, None, None]  # pad queries' outputs are never used
        return jnp.sum(out * jnp.cos(jnp.arange(E)))

    want, want_g = jax.jit(jax.value_and_grad(functools.partial(loss, lambda *a: A.attention(*a, mask)), (0, 1, 2)))(
        q, k, v)
    with pltpu.force_tpu_interpret_mode():
        program = jax.jit(jax.value_and_grad(functools.partial(loss, lambda *a: A.flash_attention(*a, valid)),
                                             (0, 1, 2)))
        # KV heads are not repeated: jnp.repeat would broadcast them to [B, K, H / K, T, E]
        assert f"f32[{B},{K},{H // K},{T},{E}]" not in str(program.trace(q, k, v).jaxpr)
        got, got_g = program(q, k, v)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for name, a, b in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rope_matches_transformers_apply_rotary_pos_emb(dtype: str) -> None:
    """RoPE against transformers' own Qwen3 rotary embedding and apply_rotary_pos_emb, run here in torch in the
    same dtype (transformers casts cos and sin to the activations' dtype and rotates in it). rotate_half is a signed
    permutation product in bf16 here: exact, so bf16 differs only where XLA fuses without rounding in between (at most
    one bf16 step); fp32 only by the angles' rounding."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3

    cfg = ModelConfig(**{**TINY_MODEL, "n_heads": 4, "n_kv_heads": 2, "head_dim": 128, "rope_theta": 1e6,
                         "max_seq_len": 4096})
    hf = Qwen3Config(hidden_size=cfg.d_model, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                     rope_theta=1e6, max_position_embeddings=4096)
    B, T, H, E = 2, 300, 4, 128
    x = np.random.default_rng(0).standard_normal((B, T, H, E)).astype(np.float32)
    pos = np.arange(T)[None] + np.array([[0], [3500]])  # late positions: large angles
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    xt = torch.tensor(x).to(tdt).transpose(1, 2)  # transformers' [B, H, T, E]
    cos, sin = modeling_qwen3.Qwen3RotaryEmbedding(hf)(xt, torch.tensor(pos))
    want = modeling_qwen3.apply_rotary_pos_emb(xt, xt, cos, sin)[0].transpose(1, 2).float().numpy()
    xj = jnp.asarray(x).astype(dtype)
    got = np.asarray(M.rope(xj, M.rope_tables(jnp.asarray(pos), cfg, xj.dtype)).astype(jnp.float32))
    if dtype == "bfloat16":
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
        assert np.all(np.abs(got - want) <= ulp) and np.mean(got == want) > 0.999
    else:
        np.testing.assert_allclose(got, want, atol=2e-6)
    # rotate_half itself is exact: the split-and-concatenate it stands for, bit for bit
    x1, x2 = jnp.split(xj, 2, axis=-1)
    np.testing.assert_array_equal(np.asarray(M.rotate_half(xj)), np.asarray(jnp.concatenate([-x2, x1], axis=-1)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_log_softmax_and_their_gradient(temperature: float) -> None:
    """The max, then one pass for both sums (the entropy's weighted sum rides with the normaliser): log p(target)
    and the entropy as log_softmax gives them, in value and in the log-prob's gradient."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((3, 5, 40)) * 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (3, 5)), jnp.int32)

    def reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        logp = jax.nn.log_softmax(x / temperature, axis=-1)
        return (jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0],
                -jnp.sum(jnp.exp(logp) * logp, axis=-1))

    got, want = M.logprobs_and_entropy(logits, targets, temperature), reference(logits)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(M.logprobs_and_entropy(x, targets, temperature)[0]))(logits)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(lambda x: jnp.sum(reference(x)[0]))(logits)),
                               rtol=1e-5, atol=1e-6)


def test_token_dense_keeps_the_weight_gradient_a_canonical_matmul_on_cpu() -> None:
    """compute.dense_grad transposed (CPU's default): the MLP projections' values and gradients are the einsum's,
    and the weight gradient (a matmul over the tokens) runs with both operands canonical, which YNNPACK takes;
    through the plain einsum XLA's CPU contracts the left operand over its major axis (an Eigen dot)."""
    from trainer.base.config import ComputeConfig

    x = jax.random.normal(jax.random.key(0), (2, 64, 32))
    w = jax.random.normal(jax.random.key(1), (32, 96)) * 0.1

    def plain(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum("bti,io->bto", x, w)

    def loss(f: Any) -> Any:
        return lambda x, w: jnp.sum(jax.nn.silu(f(x, w)) ** 2)

    grads = {name: jax.jit(jax.grad(loss(f), argnums=(0, 1))) for name, f in (("plain", plain),
                                                                                  ("token", M.token_dense))}
    np.testing.assert_allclose(M.token_dense(x, w), plain(x, w), rtol=1e-6)
    for got, want in zip(grads["token"](x, w), grads["plain"](x, w), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    def transposed_lhs(name: str) -> int:
        return grads[name].lower(x, w).compile().as_text().count("lhs_contracting_dims={0}")

    assert transposed_lhs("token") == 0 < transposed_lhs("plain")
    assert ComputeConfig().on_platform("cpu").dense_grad == "transposed"
    assert ComputeConfig().on_platform("tpu").dense_grad == "xla" == ComputeConfig().on_platform("gpu").dense_grad
