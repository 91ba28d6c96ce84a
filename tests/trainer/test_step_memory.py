"""The memory options of the one RL step: each changes how it runs, never what it computes (beyond rounding)."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.base.config import ComputeConfig, ConfigError, ModelConfig, config_from_dict, resolve_mesh
from trainer.model import decoder as M
from trainer.model.sharding import batch_sharding, make_mesh
from trainer.rl.batch import replicate
from trainer.rl.sampler import sample
from trainer.rl.step import abstract_args, build_programs

from .conftest import TINY_MODEL

B, P, N = 16, 6, 7  # 4 prompts x group 4; N odd so log-prob chunks need padding


def _cfg(tiny: dict, mesh: tuple[int, int, int] = (2, 2, 2), **sections: dict) -> Any:
    """The tiny config with B=16; the equality tests run on one device (fast compiles), the sharded ones on 8."""
    d = {**tiny, "rl": {**tiny["rl"], "prompts_per_step": 4, "group_size": 4, "mu_iterations": 2},
         "sampling": {"max_new_tokens": N, "max_prompt_len": P},
         "mesh": {**tiny["mesh"], **dict(zip(("slices", "fsdp", "tensor"), mesh, strict=True))}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return resolve_mesh(config_from_dict(d), 8)


ONE = (1, 1, 1)
_REFERENCE: dict[tuple, Any] = {}  # single-pass update per mesh, computed once per session


def _batch(mesh: Any, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 100, (B, P)).astype(np.int32)
    prompt[:, :2] = 0
    mask = (np.arange(N)[None] < rng.integers(1, N + 1, (B, 1))).astype(np.int32)
    host = {
        "prompt": prompt, "prompt_valid": (prompt != 0).astype(np.int32),
        "completion": rng.integers(3, 100, (B, N)).astype(np.int32) * mask, "mask": mask,
        "old_logp": (-4.6 + 0.1 * rng.standard_normal((B, N))).astype(np.float32) * mask,
        "rewards": rng.random((B, 1)).astype(np.float32),
    }
    return {k: jax.device_put(v, batch_sharding(mesh, v.ndim)) for k, v in host.items()}


def _run_update(cfg: Any) -> tuple[dict, dict, Any]:
    n = cfg.mesh.slices * cfg.mesh.fsdp * cfg.mesh.tensor
    mesh = make_mesh(cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor, jax.devices()[:n])
    progs = build_programs(cfg, mesh, 0, 2)
    with jax.set_mesh(mesh):
        params = progs.init_params(replicate(mesh, np.asarray(jax.random.key_data(jax.random.PRNGKey(1)))))
        opt = progs.init_opt(params)
        params, opt, m = progs.update(params, opt, _batch(mesh), None)
    return jax.device_get(params), jax.device_get(m), jax.device_get(opt)


def _close(a: Any, b: Any, rtol: float, atol: float) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


@pytest.fixture
def base(tiny_train_dict: dict) -> dict:
    return tiny_train_dict


def _reference(base: dict, mesh: tuple[int, int, int]) -> tuple[dict, dict, Any]:
    if mesh not in _REFERENCE:
        _REFERENCE[mesh] = _run_update(_cfg(base, mesh))
    return _REFERENCE[mesh]


def _initial_params(base: dict) -> dict:
    cfg = _cfg(base, ONE)
    progs = build_programs(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), 0, 2)
    return jax.device_get(progs.init_params(np.asarray(jax.random.key_data(jax.random.PRNGKey(1)))))


@pytest.mark.parametrize(("mesh", "compute"), [
    # 4 micro-batches of 4 sequences, gradients summed; full remat: both also in the sharded case below
    pytest.param(ONE, {"train_micro_batch_size": 4}, marks=pytest.mark.long),
    pytest.param(ONE, {"remat": "full"}, marks=pytest.mark.long),
    (ONE, {"remat": "dots"}),
    (ONE, {"logprob_chunk": 2}),  # 4 chunks, the last one padded
    ((2, 2, 2), {"train_micro_batch_size": 8, "remat": "full", "logprob_chunk": 3}),  # sharded micro-batches
])
def test_memory_options_equal_the_single_pass_update(base: dict, mesh: tuple, compute: dict) -> None:
    want_params, want_m, _ = _reference(base, mesh)
    params, m, _ = _run_update(_cfg(base, mesh, compute=compute))
    # Adam divides by sqrt(v): a near-zero gradient's rounding moves its param by up to ~1e-5 (lr is 3e-3), so
    # params get an absolute tolerance; grad_norm below is what catches a wrongly scaled accumulation.
    _close(params, want_params, rtol=0, atol=1e-4)
    for k in ("loss", "loss_first", "pg_loss", "clip_frac", "ratio", "entropy", "grad_norm", "kl"):
        np.testing.assert_allclose(m[k], want_m[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_bf16_gradient_accumulation_is_close_to_fp32(base: dict) -> None:
    want_params, want_m, _ = _reference(base, ONE)
    params, m, _ = _run_update(_cfg(base, ONE, compute={"train_micro_batch_size": 4, "grad_accum_dtype": "bfloat16"}))
    np.testing.assert_allclose(m["grad_norm"], want_m["grad_norm"], rtol=2e-2)
    # Adam turns a rounding of a near-zero gradient into up to one lr-sized step (lr 3e-3, 2 steps); the rest agree.
    _close(params, want_params, rtol=0, atol=6e-3)
    diffs = np.concatenate([np.abs(np.ravel(a) - np.ravel(b)) for a, b in
                            zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True)])
    assert np.mean(diffs < 1e-4) > 0.99


def test_the_reference_update_moves_the_params(base: dict) -> None:
    """So the equalities above are not two no-ops agreeing."""
    init, (after, _, _) = _initial_params(base), _reference(base, ONE)
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(init), jax.tree.leaves(after), strict=True)) > 1e-3


def test_minibatches_take_one_optimizer_step_each(base: dict) -> None:
    _, _, opt1 = _reference(base, ONE)
    params2, m2, opt2 = _run_update(_cfg(base, ONE, rl={"minibatches": 2}))
    counts = lambda opt: sorted({int(x) for x in jax.tree.leaves(opt) if np.ndim(x) == 0})  # noqa: E731
    assert counts(opt1) == [2]  # mu_iterations=2 full-batch steps
    assert counts(opt2) == [4]  # 2 iterations x 2 minibatches
    # Accumulating micro-batches inside each minibatch changes nothing.
    params3, m3, _ = _run_update(_cfg(base, ONE, rl={"minibatches": 2}, compute={"train_micro_batch_size": 4}))
    _close(params3, params2, rtol=0, atol=1e-4)
    np.testing.assert_allclose(m3["loss"], m2["loss"], rtol=2e-5)


def test_bf16_compute_keeps_fp32_master_weights(base: dict) -> None:
    want_params, want_m, _ = _reference(base, ONE)
    params, m, opt = _run_update(_cfg(base, ONE, compute={"dtype": "bfloat16"}))
    assert {np.asarray(x).dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    assert {np.asarray(x).dtype for x in jax.tree.leaves(opt) if np.ndim(x) > 0} == {np.dtype(np.float32)}
    # bf16 matmuls: the same update to bf16 precision, not bitwise.
    np.testing.assert_allclose(m["loss"], want_m["loss"], rtol=0.05, atol=0.02)
    _close(params, want_params, rtol=0, atol=5e-3)
    cfg = _cfg(base, ONE, compute={"param_dtype": "bfloat16"})
    assert cfg.model_cfg.param_dtype == "bfloat16" and cfg.compute_dtype == "bfloat16"
    bf16 = jax.eval_shape(build_programs(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), 0, 2).init_params,
                          jax.ShapeDtypeStruct((2,), jnp.uint32))
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}


def test_chunked_logprobs_match_full_logits_and_gradients() -> None:
    cfg = ModelConfig(**{**TINY_MODEL, "vocab_size": 300})
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 11, cfg.d_model)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 300, (3, 11)), jnp.int32)

    def full(p: dict) -> tuple[jax.Array, jax.Array]:
        logits = M.logits(p, cfg, x)
        logp_all = jax.nn.log_softmax(logits / 0.7, axis=-1)  # the textbook formula, independently
        return (jnp.take_along_axis(logp_all, t[..., None], -1)[..., 0],
                -jnp.sum(jnp.exp(logp_all) * logp_all, -1))

    # Each compiled as one program, as the trainer runs them (not a compile per operation).
    want = jax.jit(full)(params)
    for chunk in (1, 4, 11, 64):
        got = jax.jit(lambda p, chunk=chunk: M.chunked_logprobs(p, cfg, x, t, 0.7, chunk))(params)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    g_want = jax.jit(jax.grad(lambda p: jnp.sum(full(p)[0])))(params)
    g_got = jax.jit(jax.grad(lambda p: jnp.sum(M.chunked_logprobs(p, cfg, x, t, 0.7, 4)[0])))(params)
    _close(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_chunked_logprobs_never_hold_the_full_logits() -> None:
    """The compiled backward's temporaries shrink with the chunk: [B, N, V] fp32 logits are never all live."""
    cfg = ModelConfig(**{**TINY_MODEL, "vocab_size": 8192, "max_seq_len": 256})
    params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))
    b, n = 8, 128
    x = jax.ShapeDtypeStruct((b, n, cfg.d_model), jnp.float32)
    t = jax.ShapeDtypeStruct((b, n), jnp.int32)
    full_logits_bytes = b * n * cfg.vocab_size * 4  # 32 MiB

    def temp(chunk: int) -> int:
        f = jax.jit(jax.grad(lambda p, x, t: jnp.sum(M.chunked_logprobs(p, cfg, x, t, 1.0, chunk)[0]), (0, 1)))
        return f.lower(params, x, t).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = temp(n), temp(16)
    assert whole >= full_logits_bytes
    assert chunked < full_logits_bytes / 2, (chunked, whole)  # ~3 chunks of [8, 16, V] live, not 3 x [8, 128, V]


def test_sampling_in_chunks_gives_the_same_tokens() -> None:
    cfg = ModelConfig(**TINY_MODEL)
    params = M.init_params(cfg, jax.random.PRNGKey(7))
    rng = np.random.default_rng(3)
    prompt = jnp.asarray(rng.integers(3, 100, (8, 5)), jnp.int32)
    valid = jnp.ones((8, 5), bool)

    def run(**kw: Any) -> tuple[np.ndarray, ...]:
        f = jax.jit(functools.partial(sample, cfg=cfg, max_new_tokens=6, eos_id=2, pad_id=0, temperature=1.0, **kw))
        return tuple(np.asarray(a) for a in f(params, prompt_BP=prompt, prompt_valid_BP=valid,
                                              key=jax.random.PRNGKey(5)))

    whole = run()
    for n in (1, 2, 4):
        chunked = run(max_num_sequences=n)
        np.testing.assert_array_equal(chunked[0], whole[0])
        np.testing.assert_array_equal(chunked[2], whole[2])
        np.testing.assert_allclose(chunked[1], whole[1], rtol=1e-6, atol=1e-6)
    assert len({tuple(r) for r in whole[0]}) > 1  # rows really differ: per-row streams, not one repeated
    # The KV cache is in the compute dtype.
    cache = M.init_cache(cfg, 2, 4, ComputeConfig(dtype="bfloat16"))
    assert cache.k_LBSKE.dtype == jnp.bfloat16


def test_abstract_args_lower_every_program(base: dict) -> None:
    cfg = _cfg(base, compute={"train_micro_batch_size": 8}, sampling={"max_num_sequences": 8})
    mesh = make_mesh(2, 2, 2)
    progs = build_programs(cfg, mesh, 0, 2)
    args = abstract_args(cfg, progs, 1)
    for name in ("sample", "ref_logprobs", "update"):
        compiled = getattr(progs, name).lower(*args[name]).compile()
        assert compiled.memory_analysis().argument_size_in_bytes > 0


@pytest.mark.parametrize(("section", "value", "key"), [
    ("rl", {"minibatches": 3}, "rl.minibatches"),
    ("compute", {"train_micro_batch_size": 6}, "compute.train_micro_batch_size"),
    ("sampling", {"max_num_sequences": 6}, "sampling.max_num_sequences"),
    ("compute", {"remat": "some"}, "compute.remat"),
])
def test_bad_splits_name_the_key(base: dict, section: str, value: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(base, **{section: value})


def test_micro_batch_must_split_over_the_data_axes(base: dict) -> None:
    # 2 sequences per micro-batch cannot spread over slices 2 x fsdp 2 = 4 data devices.
    with pytest.raises(ConfigError, match=r"compute\.train_micro_batch_size = 2"):
        _cfg(base, compute={"train_micro_batch_size": 2})


def test_fsdp_across_slices_shards_state_over_the_slice_axis(base: dict) -> None:
    cfg = _cfg(base, mesh=(2, 2, 2))
    wide = _cfg({**base, "mesh": {**base["mesh"], "fsdp_across_slices": True}}, mesh=(2, 2, 2))
    mesh = make_mesh(2, 2, 2)
    plain, across = build_programs(cfg, mesh, 0, 2), build_programs(wide, mesh, 0, 2)
    assert plain.param_sh["layers"]["w_up"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert across.param_sh["layers"]["w_up"].spec == jax.sharding.PartitionSpec(None, ("slices", "fsdp"), "tensor")
    per_device = lambda sh, shape: sh.shard_shape(shape)  # noqa: E731
    shape = (2, 32, 64)
    assert per_device(across.param_sh["layers"]["w_up"], shape)[1] * 2 == per_device(plain.param_sh["layers"]["w_up"],
                                                                                     shape)[1]


def test_adafactor_keeps_factored_state_and_trains(base: dict) -> None:
    cfg = _cfg(base, (2, 2, 2), optim={"name": "adafactor"})
    params, m, opt = _run_update(cfg)
    init = _initial_params(base)
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(init), jax.tree.leaves(params), strict=True)) > 1e-4
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    # At real sizes (dims >= 128 get factored) the state is a small fraction of the params, and every leaf gets
    # a sharding that fits its shape.
    from trainer.model.sharding import named_shardings, opt_state_shardings
    from trainer.rl.optim import make_optimizer

    big = ModelConfig(**{**TINY_MODEL, "d_model": 256, "d_ff": 512, "head_dim": 64, "vocab_size": 512})
    abstract = M.abstract_params(big)
    optimizer = make_optimizer(cfg.optim, 10)
    mesh = make_mesh(2, 2, 2)
    sh = opt_state_shardings(mesh, optimizer, named_shardings(mesh, M.param_axes(big), abstract), abstract)
    state = jax.eval_shape(optimizer.init, abstract)
    for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(sh), strict=True):
        s.shard_shape(leaf.shape)  # raises if the spec does not fit the leaf
    n_params = sum(x.size for x in jax.tree.leaves(abstract))
    assert sum(x.size for x in jax.tree.leaves(state)) < n_params / 2  # AdamW holds 2 x n_params


def test_gathered_sampler_weights_give_the_same_samples(base: dict) -> None:
    cfg = _cfg(base, (1, 4, 2), sampling={"temperature": 1.0})
    gathered = _cfg(base, (1, 4, 2), sampling={"temperature": 1.0, "gather_weights": True})
    mesh = make_mesh(1, 4, 2)
    batch = _batch(mesh)
    key = replicate(mesh, np.asarray(jax.random.key_data(jax.random.PRNGKey(4))))
    step = replicate(mesh, np.int32(0))
    outs = []
    for c in (cfg, gathered):
        progs = build_programs(c, mesh, 0, 2)
        with jax.set_mesh(mesh):
            params = progs.init_params(key)
            outs.append(jax.device_get(progs.sample(params, batch["prompt"], batch["prompt_valid"], key, step)))
    np.testing.assert_array_equal(outs[0].tokens_BN, outs[1].tokens_BN)
    np.testing.assert_allclose(outs[0].logprobs_BN, outs[1].logprobs_BN, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather", [pytest.param(False, marks=pytest.mark.long), True])  # True: gathered and unstacked
def test_unstacked_sampler_weights_give_the_same_samples(base: dict, gather: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the sampler reads one array per layer (XLA there copies each layer's slice of a stacked weight
    before its GEMM, at every decode step): forced on here, the same tokens and log-probs on a sharded mesh,
    gathered or not, from a program that takes no slice of a stacked weight inside its decode loop."""
    import trainer.rl.step as step_module

    cfg = _cfg(base, (1, 4, 2), sampling={"temperature": 1.0, "gather_weights": gather})
    mesh = make_mesh(1, 4, 2)
    batch = _batch(mesh)
    key = replicate(mesh, np.asarray(jax.random.key_data(jax.random.PRNGKey(4))))
    step = replicate(mesh, np.int32(0))
    outs, texts = [], []
    for platforms in (frozenset(), frozenset({"cpu"})):
        monkeypatch.setattr(step_module, "UNSTACKED_SAMPLER_PLATFORMS", platforms)
        step_module._build.cache_clear()
        progs = build_programs(cfg, mesh, 0, 2)
        with jax.set_mesh(mesh):
            params = progs.init_params(key)
            outs.append(jax.device_get(progs.sample(params, batch["prompt"], batch["prompt_valid"], key, step)))
            texts.append(progs.sample.lower(params, batch["prompt"], batch["prompt_valid"], key, step).as_text())
    step_module._build.cache_clear()
    np.testing.assert_array_equal(outs[0].tokens_BN, outs[1].tokens_BN)
    np.testing.assert_allclose(outs[0].logprobs_BN, outs[1].logprobs_BN, rtol=1e-5, atol=1e-5)
    L = cfg.model_cfg.n_layers

    def loop_slices(text: str) -> int:  # slices of a stacked [L, ...] array inside the decode loop's body
        body = text[text.index("stablehlo.while"):]
        return len(re.findall(rf"stablehlo\.(?:dynamic_)?slice %[\w#]+(?:, %[\w#]+)* .*tensor<{L}x", body))

    assert loop_slices(texts[1]) <= loop_slices(texts[0]) - 7 * L  # none of the 7 matrices of any layer


@pytest.mark.parametrize("chunk", [pytest.param(None, marks=pytest.mark.long), 8])  # 8: continuously batched
def test_a_regrouped_sampler_gives_the_same_samples(base: dict, chunk: int | None) -> None:
    """sampling.tensor 4 on a slices 2 x fsdp 2 x tensor 2 mesh: the sampler runs on (2, 1, 4), its gathered weights
    split 4 ways, and draws the very tokens the mesh as it is draws (all rows at once, or continuously batched)."""
    s = {"temperature": 1.0, "gather_weights": True, "max_num_sequences": chunk}
    cfg, regrouped = _cfg(base, sampling=s), _cfg(base, sampling={**s, "tensor": 4})
    assert regrouped.sampler_mesh == {"slices": 2, "fsdp": 1, "tensor": 4}
    mesh = make_mesh(2, 2, 2)
    batch = _batch(mesh)
    key = replicate(mesh, np.asarray(jax.random.key_data(jax.random.PRNGKey(4))))
    step = replicate(mesh, np.int32(0))
    outs, texts = [], []
    for c in (cfg, regrouped):
        progs = build_programs(c, mesh, 0, 2)
        with jax.set_mesh(mesh):
            params = progs.init_params(key)
            outs.append(jax.device_get(progs.sample(params, batch["prompt"], batch["prompt_valid"], key, step)))
            texts.append(progs.sample.lower(params, batch["prompt"], batch["prompt_valid"], key, step).as_text())
    np.testing.assert_array_equal(outs[0].tokens_BN, outs[1].tokens_BN)
    np.testing.assert_allclose(outs[0].logprobs_BN, outs[1].logprobs_BN, rtol=1e-5, atol=1e-5)
    # The program declares the regrouped mesh and lays the stacked weights out on it, split over its 4-way tensor axis.
    regrouped_mesh = re.findall(r'sdy.mesh (@\w+) = <\["slices"=2, "fsdp"=1, "tensor"=4\]>', texts[1])
    assert regrouped_mesh and '"tensor"=4' not in texts[0]
    assert f'<{regrouped_mesh[0]}, [{{}}, {{}}, {{"tensor"}}]>' in texts[1]
