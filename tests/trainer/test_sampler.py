from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.base.config import ModelConfig
from trainer.model import decoder as M
from trainer.model.sharding import make_mesh
from trainer.rl.sampler import filter_logits, sample, schedule_steps

from .conftest import TINY_MODEL

CFG = ModelConfig(**TINY_MODEL)
PAD, EOS, N = 0, 2, 6
PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64], [1, 70, 71]]


def _padded(left: bool, width: int = 8) -> tuple[jax.Array, jax.Array]:
    rows = [[PAD] * (width - len(p)) + p if left else p + [PAD] * (width - len(p)) for p in PROMPTS]
    tokens = jnp.array(rows, jnp.int32)
    return tokens, tokens != PAD


@functools.cache
def _params() -> M.Params:
    return M.init_params(CFG, jax.random.PRNGKey(7))


@functools.cache
def _sampler(eos: int, **kw: float):  # noqa: ANN202
    return jax.jit(functools.partial(sample, cfg=CFG, max_new_tokens=N, eos_id=eos, pad_id=PAD, **kw))


def _sample(tokens: jax.Array, valid: jax.Array, eos: int = EOS, seed: int = 0, **kw: float) -> tuple[np.ndarray, ...]:
    out = _sampler(eos, **kw)(_params(), prompt_BP=tokens, prompt_valid_BP=valid, key=jax.random.PRNGKey(seed))
    return tuple(np.asarray(x) for x in out[:3])  # tokens, log-probs, mask


def _greedy_by_recompute(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Reference without a cache: rerun the whole sequence for every new token. Rows sit right-padded in a
    fixed buffer (causal attention never sees the pad on the right), so one compiled program serves all steps."""
    width = max(map(len, prompts)) + N

    @jax.jit
    def next_logp(p: M.Params, buf: jax.Array, length: jax.Array) -> jax.Array:
        valid = jnp.arange(width)[None, :] < length[:, None]
        logits = M.logits(p, CFG, M.forward(p, CFG, buf, valid)[0])
        return jax.nn.log_softmax(jnp.take_along_axis(logits, (length - 1)[:, None, None], axis=1)[:, 0], -1)

    buf = np.zeros((len(prompts), width), np.int32)
    length = np.array([len(q) for q in prompts])
    for b, q in enumerate(prompts):
        buf[b, : len(q)] = q
    tokens, logps = [], []
    for _ in range(N):
        logp = np.asarray(next_logp(_params(), jnp.asarray(buf), jnp.asarray(length)))
        tok = logp.argmax(-1)
        tokens.append(tok)
        logps.append(logp[np.arange(len(prompts)), tok])
        buf[np.arange(len(prompts)), length] = tok
        length = length + 1
    return np.stack(tokens, 1), np.stack(logps, 1)


def test_greedy_kv_cache_matches_full_recompute() -> None:
    want_tokens, want_logp = _greedy_by_recompute(PROMPTS)
    # An EOS id that never occurs, so every row runs all N steps.
    tokens, logp, mask = _sample(*_padded(left=True), eos=CFG.vocab_size + 1, temperature=0.0)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    assert mask.all()


def test_right_padded_prompts_sample_the_same() -> None:
    left = _sample(*_padded(left=True), temperature=0.0)
    right = _sample(*_padded(left=False), temperature=0.0)
    for a, b in zip(left, right, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_stops_at_eos_and_pads_after() -> None:
    free, _, _ = _sample(*_padded(left=True), eos=CFG.vocab_size + 1, temperature=0.0)
    eos = int(free[0, 2])  # make row 0's third greedy token the EOS
    tokens, logp, mask = _sample(*_padded(left=True), eos=eos, temperature=0.0)
    for b in range(len(PROMPTS)):
        hits = np.flatnonzero(free[b] == eos)
        stop = hits[0] + 1 if hits.size else N
        assert mask[b].tolist() == [1] * stop + [0] * (N - stop)
        np.testing.assert_array_equal(tokens[b, :stop], free[b, :stop])
        assert (tokens[b, stop:] == PAD).all() and (logp[b, stop:] == 0).all()
    assert mask[0].sum() == 3


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 20, 0.9), (0.7, 20, 0.9), (1.0, 0, 1.0),
                                                              (0.7, 0, 1.0)])
def test_sampling_logprobs_equal_policy_logprobs(temperature: float, top_k: int, top_p: float) -> None:
    """The old-policy log-probs the sampler returns are what the loss recomputes: ratio 1 on policy, with and
    without top-k/top-p truncation (the log-probs are before it)."""
    prompt, valid = _padded(left=True)
    tokens, logp, mask = _sample(prompt, valid, temperature=temperature, top_k=top_k, top_p=top_p)
    want, _ = jax.jit(functools.partial(M.completion_logprobs, cfg=CFG, temperature=temperature))(
        _params(), prompt_BP=prompt, prompt_valid_BP=valid, completion_BN=jnp.asarray(tokens),
        completion_mask_BN=jnp.asarray(mask))
    np.testing.assert_allclose(logp * mask, np.asarray(want) * mask, rtol=1e-5, atol=1e-5)


def test_top_k_one_is_greedy() -> None:
    greedy = _sample(*_padded(left=True), temperature=0.0)[0]
    np.testing.assert_array_equal(_sample(*_padded(left=True), temperature=1.0, top_k=1)[0], greedy)


def test_filter_logits_top_k_and_top_p() -> None:
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = lambda x: (np.asarray(x) > -1e30).astype(int).tolist()  # noqa: E731
    assert kept(filter_logits(logits, 3, 1.0)) == [[1, 1, 1, 0], [0, 1, 1, 1]]
    # Mass before each token (sorted): 0, 0.5, 0.8, 0.95; top_p 0.7 keeps the first two.
    assert kept(filter_logits(logits, 0, 0.7)) == [[1, 1, 0, 0], [0, 0, 1, 1]]
    assert kept(filter_logits(logits, 0, 0.4)) == [[1, 0, 0, 0], [0, 0, 0, 1]]


def test_sampling_is_random_but_reproducible() -> None:
    prompt, valid = _padded(left=True)
    a = _sample(prompt, valid, temperature=1.0)[0]
    np.testing.assert_array_equal(_sample(prompt, valid, temperature=1.0)[0], a)
    assert (_sample(prompt, valid, seed=1, temperature=1.0)[0] != a).any()


def test_continuous_batching_same_tokens_fewer_steps() -> None:
    """Long-tailed completion lengths (12 of 100 ids stop a row: geometric lengths, capped at 48): decoding 8 of 32
    rows at once, refilling a slot as its row ends draws exactly the tokens of sampling all rows together or in static
    chunks, in the steps the host's replay of the schedule counts, and fewer of them than static chunks."""
    B, P, n_new, slots = 32, 8, 48, 8
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, CFG.vocab_size, (B, P)).astype(np.int32)
    valid = np.ones((B, P), bool)
    for b in range(B):
        valid[b, : rng.integers(0, 5)] = False  # ragged prompts
    stops = tuple(range(10, 22))

    def run(**kw: object) -> tuple[np.ndarray, ...]:
        f = jax.jit(functools.partial(sample, cfg=CFG, max_new_tokens=n_new, eos_id=stops, pad_id=PAD, **kw))
        out = f(_params(), prompt_BP=jnp.asarray(prompt), prompt_valid_BP=jnp.asarray(valid), key=jax.random.key(3))
        return tuple(np.asarray(x) for x in out)

    whole = run()
    static = run(max_num_sequences=slots, continuous=False)
    cont = run(max_num_sequences=slots)
    lengths = whole[2].sum(axis=1).tolist()
    assert min(lengths) < 5 and max(lengths) > 30  # the tail the schedule is for
    for out in (static, cont):
        np.testing.assert_array_equal(out[0], whole[0])
        np.testing.assert_array_equal(out[2], whole[2])
        np.testing.assert_allclose(out[1], whole[1], atol=1e-5)
    assert int(whole[3]) == max(lengths)
    assert int(static[3]) == schedule_steps(lengths, slots, continuous=False)
    assert int(cont[3]) == schedule_steps(lengths, slots, continuous=True)
    tokens = sum(lengths)
    assert tokens / (int(cont[3]) * slots) > 1.5 * tokens / (int(static[3]) * slots)
    # Refills three rows at a time (a padding row when fewer are pending): the same tokens, in its schedule's steps.
    grouped = run(max_num_sequences=slots, refill_rows=3)
    np.testing.assert_array_equal(grouped[0], whole[0])
    np.testing.assert_allclose(grouped[1], whole[1], atol=1e-5)
    assert int(grouped[3]) == schedule_steps(lengths, slots, continuous=True, refill_rows=3) > int(cont[3])


def test_continuous_batching_with_one_slot_per_row_and_greedy() -> None:
    """One slot: every row is a refill. Greedy decoding with one stop id gives the whole batch's tokens."""
    prompt, valid = _padded(left=False)
    whole = _sample(prompt, valid, temperature=0.0)
    one = jax.jit(functools.partial(sample, cfg=CFG, max_new_tokens=N, eos_id=EOS, pad_id=PAD, temperature=0.0,
                                    max_num_sequences=1))(_params(), prompt_BP=prompt, prompt_valid_BP=valid,
                                                               key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(one.tokens_BN), whole[0])
    np.testing.assert_array_equal(np.asarray(one.mask_BN), whole[2])
    assert int(one.steps) == int(whole[2].sum())  # one slot: a step per generated token


def _block_sampled(block: int, attention: str, **kw: object) -> tuple[np.ndarray, ...]:
    """Tokens, log-probs and mask of the block tests' case: float32, 8 rows of 16-token prompts, 48 new tokens."""
    from trainer.base.config import ComputeConfig

    B, P, n_new = 8, 16, 48
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(3, CFG.vocab_size, (B, P)).astype(np.int32))
    valid = jnp.asarray(np.arange(P)[None, :] >= rng.integers(0, 6, (B, 1)))
    cc = ComputeConfig(dtype="float32", decode_block=block, decode_attention=attention)
    f = jax.jit(functools.partial(sample, cfg=CFG, max_new_tokens=n_new, eos_id=tuple(range(10, 14)), pad_id=PAD,
                                  cc=cc, **kw))
    out = f(_params(), prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(5))
    return tuple(np.asarray(x) for x in out[:3])


# The whole-cache einsum's samples, once for every parametrization (decode_block 0 takes no block path: the
# decode_attention setting is not read).
_whole_cache = functools.cache(lambda: _block_sampled(0, "xla"))


@pytest.mark.parametrize(("block", "attention"), [(8, "xla"), (5, "xla"), (5, "unrolled"),
                                                 pytest.param(8, "unrolled", marks=pytest.mark.long)])
def test_block_attention_decodes_as_the_whole_cache(block: int, attention: str) -> None:
    """compute.decode_block: a decode step reads the cache block by block up to the furthest live token. float32:
    the same tokens as the whole-cache einsum (the reference), with log-probs within rounding, sampled all at once
    or continuously batched (rows then sit at different slots), blocks dividing the cache (48 + 16 = 64 slots) or
    not (the last block overlaps the one before); the blocks in a loop (xla) or the step compiled per live-block
    count (unrolled, GPU's default)."""
    ref = _whole_cache()
    assert len(set(ref[2].sum(axis=1))) > 3 and ref[2].sum(axis=1).max() == 48  # rows end at different steps
    for kw in ({}, {"max_num_sequences": 4}):
        out = _block_sampled(block, attention, **kw)
        np.testing.assert_array_equal(out[0], ref[0])
        np.testing.assert_array_equal(out[2], ref[2])
        np.testing.assert_allclose(out[1], ref[1], atol=2e-5)


@pytest.mark.parametrize("attention", ["xla", "unrolled"])
def test_block_attention_never_reads_past_the_live_block(attention: str) -> None:
    """Slots in blocks past the one holding the furthest live token are never read: filled with NaN they leave the
    step's logits finite and equal to a clean cache's (the whole-cache einsum reads them: its probabilities are 0
    there, but 0 x NaN is NaN). In bfloat16 the blocks' online softmax rounds differently from the einsum's, within
    a few hundredths of a logit."""
    from trainer.base.config import ComputeConfig
    from trainer.rl.sampler import decode_step, prefill

    P, S, block = 8, 40, 8
    prompt, valid = _padded(left=True)
    slot = jnp.array([P + 3, P + 9, P + 1, P])  # rows at their own slots; the furthest live one in block 2
    live = jnp.array([True, True, True, False])
    tok = jnp.array([5, 6, 7, 8], jnp.int32)
    pos = jnp.sum(valid, axis=1) + slot - P
    for dtype, atol in (("float32", 2e-5), ("bfloat16", 0.1)):
        whole, blocks = (ComputeConfig(dtype=dtype, decode_block=b, decode_attention=attention) for b in (0, block))
        _, cache = jax.jit(lambda p, t, v, cc=whole: prefill(p, CFG, t, v, S, cc, None))(_params(), prompt, valid)
        # Compiled, as the sampler runs them (one program each, not a compile per operation).
        step_whole, step_blocks = (jax.jit(lambda p, c, cc=cc: decode_step(p, CFG, tok, live, pos, slot, c, cc, None))
                                   for cc in (whole, blocks))
        want, _ = step_whole(_params(), cache)
        poisoned = cache._replace(v_LBSKE=cache.v_LBSKE.at[:, :, 3 * block:].set(jnp.nan))
        got, _ = step_blocks(_params(), poisoned)
        assert bool(jnp.all(jnp.isfinite(got[:3])))
        np.testing.assert_allclose(np.asarray(got[:3]), np.asarray(want[:3]), atol=atol)
        spoiled, _ = step_whole(_params(), poisoned)
        assert not bool(jnp.all(jnp.isfinite(spoiled[:3])))


def test_an_unrolled_decode_step_has_no_loop_inside() -> None:
    """compute.decode_attention unrolled (GPU's default): the step is one compiled branch per live-block count (a
    conditional), with no `while` inside, whose trip count a GPU would read back from the device at every
    iteration; the block loop (xla) has one."""
    from trainer.base.config import ComputeConfig
    from trainer.rl.sampler import decode_step, prefill

    P, S, block = 8, 40, 8
    prompt, valid = _padded(left=True)
    _, cache = prefill(_params(), CFG, prompt, valid, S, ComputeConfig(), None)
    tok, live, slot = jnp.array([5, 6, 7, 8], jnp.int32), jnp.ones(4, bool), jnp.asarray(P + 3)

    def hlo(attention: str) -> str:
        cc = ComputeConfig(decode_block=block, decode_attention=attention)
        step = jax.jit(lambda p, c, s: decode_step(p, CFG, tok, live, jnp.sum(valid, axis=1) + s - P, s, c, cc,
                                                   None))
        return step.lower(_params(), cache, slot).compile().as_text()

    unrolled, loop = hlo("unrolled"), hlo("xla")
    assert " while(" not in unrolled and " conditional(" in unrolled
    assert " while(" in loop
    assert ComputeConfig().on_platform("gpu").decode_attention == "unrolled"
    # A GPU reads the whole cache unless told a block (measured faster there); a block set is kept
    assert ComputeConfig().on_platform("gpu").decode_block == 0
    assert ComputeConfig(decode_block=256).on_platform("gpu").decode_block == 256
    assert ComputeConfig().on_platform("tpu").decode_block == 256
    assert ComputeConfig().on_platform("cpu").decode_attention == "xla"


def test_a_prefill_attends_its_own_tokens_in_the_flash_kernel() -> None:
    """A prefill writes slots [0, P) of a fresh cache and attends among exactly those tokens, as a pass without a
    cache does: with compute.attention flash, in the splash kernel (run in Pallas' TPU interpret mode here) rather
    than reading the keys back from the cache into an einsum. The last logits and the cache's valid slots are the
    einsum prefill's within float rounding (a pad query's output differs between the two and is never read: pads
    attend pads in the kernel)."""
    from jax.experimental.pallas import tpu as pltpu

    from trainer.base.config import ComputeConfig
    from trainer.rl.sampler import prefill

    cfg = ModelConfig(**{**TINY_MODEL, "max_seq_len": 256})
    params = M.init_params(cfg, jax.random.PRNGKey(5))
    # A 128-token prompt batch (one flash block), left-padded as the sampler hands prompts to `prefill`.
    prompt = jnp.asarray(np.random.default_rng(4).integers(3, cfg.vocab_size, (4, 128)).astype(np.int32))
    valid = jnp.asarray(np.stack([np.arange(128) >= s for s in (0, 30, 100, 127)]))
    # Compiled, as the sampler runs it (one program, not a compile per operation).
    run = lambda cc: jax.jit(lambda p: prefill(p, cfg, prompt, valid, 160, cc, None))(params)  # noqa: E731
    want, want_cache = run(ComputeConfig(attention="xla"))
    flash = ComputeConfig(attention="flash")
    with pltpu.force_tpu_interpret_mode():
        assert "pallas_call" in str(jax.make_jaxpr(lambda: run(flash))())
        got, cache = run(flash)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.valid_BS), np.asarray(want_cache.valid_BS))
    slots = np.asarray(cache.valid_BS)
    for a, b in zip(cache[:2], want_cache[:2], strict=True):
        np.testing.assert_allclose(np.asarray(a)[:, slots], np.asarray(b)[:, slots], rtol=1e-4, atol=1e-4)


def test_a_prefill_on_tpu_keeps_no_scores_in_hbm() -> None:
    """Compiled for one v6e chip by libtpu: the flash prefill runs the kernel and no [T, T] scores reach HBM; the
    einsum prefill writes and reads them: 1.58x the bytes here, with the cache's zeroing common to both."""
    from tests.trainer.test_fit import V6E_2X2
    from trainer.base.config import ComputeConfig
    from trainer.fit import preflight as F
    from trainer.rl.sampler import prefill

    F.prepare_environment(V6E_2X2)
    sh = jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0])
    cfg = ModelConfig(**{**TINY_MODEL, "max_seq_len": 1024, "d_model": 256, "n_heads": 4, "n_kv_heads": 2,
                         "head_dim": 128, "d_ff": 1024})
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0))))
    B, P = 16, 512
    prompt, valid = (jax.ShapeDtypeStruct((B, P), dt, sharding=sh) for dt in (jnp.int32, bool))
    accessed, text = {}, {}
    for attention in ("flash", "xla"):
        cc = ComputeConfig(attention=attention, dtype="bfloat16")
        compiled = jax.jit(lambda p, t, v, cc=cc: prefill(p, cfg, t, v, 1024, cc, None)).lower(
            params, prompt, valid).compile()
        accessed[attention], text[attention] = compiled.cost_analysis()["bytes accessed"], compiled.as_text()
    assert 'custom_call_target="tpu_custom_call"' in text["flash"]
    assert f"{P},{P}]" not in text["flash"] and f"{P},{P}]" in text["xla"]
    assert accessed["xla"] > 1.4 * accessed["flash"]


def test_pick_draws_categoricals_tokens_with_the_log_prob_in_one_pass() -> None:
    """`pick` is jax.random.categorical's draw (argmax of the logits plus the same Gumbel noise, the first index on
    ties) on the temperature-scaled, top-k/top-p-filtered logits, and returns log softmax at the temperature before
    the filter: the same tokens, and the log-probs within float rounding."""
    from trainer.model.decoder import logprobs_and_entropy
    from trainer.rl.sampler import pick

    rng = np.random.default_rng(0)
    B, V = 64, 1000
    logits = jnp.asarray(rng.normal(0, 3, (B, V)).astype(np.float32))
    logits = logits.at[0, :2].set(50.0)  # a tie: the first index wins
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.PRNGKey(3), r))(jnp.arange(B))
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 0, 0.8)):
        for i in range(3):
            tok, logp = pick(keys, jnp.full((B,), i), logits, temperature, top_k, top_p)
            step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.full((B,), i))
            want = jax.vmap(jax.random.categorical)(step_keys, filter_logits(logits / temperature, top_k, top_p))
            np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
            np.testing.assert_allclose(np.asarray(logp),
                                       np.asarray(logprobs_and_entropy(logits, want, temperature)[0]), rtol=1e-5,
                                       atol=1e-5)


def test_pick_reads_the_logits_once_on_tpu() -> None:
    """Compiled for v6e 2x2 with the vocab over the 4 chips, as the head writes it (Qwen3's 151,936 ids, 128 rows):
    the draw, the max, the mass and the token's logit are one reduction, so the chips access about one read of their
    [128, 37,984] float32 slice (libtpu's bytes accessed), where the draw and the log-prob's passes took 7."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.trainer.test_fit import V6E_2X2
    from trainer.fit import preflight as F
    from trainer.rl.sampler import pick

    F.prepare_environment(V6E_2X2)
    mesh = make_mesh(1, 1, 4, F.topology_devices(V6E_2X2))
    B, V = 128, 151936
    rep = NamedSharding(mesh, P())
    args = (jax.ShapeDtypeStruct((B, 2), jnp.uint32, sharding=rep), jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((B, V), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor"))))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda k, i, x: pick(k, i, x, 1.0, 0, 1.0)).lower(*args).compile()
    accessed = compiled.cost_analysis()["bytes accessed"]
    assert accessed < 1.2 * B * V // 4 * 4
