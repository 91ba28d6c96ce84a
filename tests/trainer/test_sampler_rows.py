"""Sampling settings as traced data (`RowSettings`): one compiled program serves every temperature, top-k, top-p,
stop set and token limit, and each row gets what the static settings give it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.rl.sampler import RowSettings, filter_logits, filter_logits_rows, pick, pick_rows, sample

from .test_sampler import CFG, EOS, PAD, N, _padded, _params, _sample

SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 3, 0.6), (2.0, 1, 1.0), (0.9, 0, 0.05)]
STOPS = 4


def _rows(B: int, temperature: float, top_k: int, top_p: float, stops: tuple[int, ...] = (EOS,),
          max_new: int = N) -> RowSettings:
    stop = np.full((B, STOPS), -1, np.int32)
    stop[:, :len(stops)] = stops
    return RowSettings(jnp.full((B,), temperature, jnp.float32), jnp.full((B,), top_k, jnp.int32),
                       jnp.full((B,), top_p, jnp.float32), jnp.asarray(stop), jnp.full((B,), max_new, jnp.int32))


@functools.cache
def _traced(max_num_sequences: int | None = None, continuous: bool = True):  # noqa: ANN202
    return jax.jit(functools.partial(sample, cfg=CFG, max_new_tokens=N, eos_id=EOS, pad_id=PAD,
                                     max_num_sequences=max_num_sequences, continuous=continuous))


def _sample_rows(rows: RowSettings, seed: int = 0, **kw: int | bool | None) -> tuple[np.ndarray, ...]:
    tokens, valid = _padded(left=True)
    out = _traced(**kw)(_params(), prompt_BP=tokens, prompt_valid_BP=valid, key=jax.random.PRNGKey(seed),
                        per_row=rows)
    return tuple(np.asarray(x) for x in out[:3])


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.7), (3, 0.5), (1, 1.0), (40, 0.3),
                                              (0, 1e-6), (70, 1.0)])
def test_the_row_filter_is_the_static_filter(top_k: int, top_p: float) -> None:
    logits = jax.random.normal(jax.random.PRNGKey(3), (4, 64)) * 3
    logits = logits.at[:, 10].set(logits[:, 11])  # a tie, kept alike by both
    static = filter_logits(logits, top_k, top_p)
    rows = filter_logits_rows(logits, jnp.full((4,), top_k, jnp.int32), jnp.full((4,), top_p, jnp.float32))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(static))


def test_each_row_picks_as_the_static_settings_pick_it() -> None:
    """Six rows, six settings, one call: each row's token and log-prob are those of `pick` at its own settings."""
    B = len(SETTINGS)
    logits = jax.random.normal(jax.random.PRNGKey(5), (B, 64)) * 2
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.PRNGKey(9), r))(jnp.arange(B))
    i = jnp.full((B,), 3, jnp.int32)
    t, k, p = (jnp.asarray([s[j] for s in SETTINGS]) for j in range(3))
    rows = RowSettings(t.astype(jnp.float32), k.astype(jnp.int32), p.astype(jnp.float32),
                       jnp.full((B, STOPS), -1, jnp.int32), jnp.full((B,), N, jnp.int32))
    tok, logp = jax.jit(pick_rows)(keys, i, logits, rows)
    for b, (temperature, top_k, top_p) in enumerate(SETTINGS):
        want_tok, want_logp = pick(keys, i, logits, temperature, top_k, top_p)
        assert int(tok[b]) == int(want_tok[b]), (b, SETTINGS[b])
        np.testing.assert_allclose(float(logp[b]), float(want_logp[b]), rtol=1e-6, atol=1e-6)


def test_a_greedy_row_takes_the_argmax_and_its_log_prob_at_temperature_one() -> None:
    logits = jax.random.normal(jax.random.PRNGKey(1), (2, 64))
    keys = jnp.stack([jax.random.PRNGKey(0)] * 2)
    rows = RowSettings(jnp.zeros(2), jnp.asarray([0, 3], jnp.int32), jnp.asarray([1.0, 0.2]),
                       jnp.full((2, STOPS), -1, jnp.int32), jnp.full((2,), N, jnp.int32))
    tok, logp = pick_rows(keys, jnp.zeros(2, jnp.int32), logits, rows)
    want_tok, want_logp = pick(keys, jnp.zeros(2, jnp.int32), logits, 0.0, 0, 1.0)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want_logp), rtol=1e-6)


@pytest.mark.parametrize("layout", [{}, {"max_num_sequences": 2}, {"max_num_sequences": 2, "continuous": False}])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.8, 4, 0.9)])
def test_sampling_with_row_settings_gives_the_static_samplers_tokens(
    layout: dict[str, int | bool], temperature: float, top_k: int, top_p: float
) -> None:
    want = _sample(*_padded(left=True), temperature=temperature, top_k=top_k, top_p=top_p)
    got = _sample_rows(_rows(4, temperature, top_k, top_p), **layout)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", [{}, {"max_num_sequences": 2}, {"max_num_sequences": 2, "continuous": False}])
def test_a_rows_own_limit_and_stop_ids_end_it_as_a_shorter_program_would(layout: dict[str, int | bool]) -> None:
    """Token limits and stop ids per row, inside one program of max_new_tokens N: each row's tokens are the
    prefix that a program built for its own limit and stops samples."""
    free = _sample_rows(_rows(4, 1.0, 0, 1.0, stops=()), **layout)  # nothing stops a row before N
    limits = np.asarray([1, 3, N, 2], np.int32)
    stop = int(free[0][2, 2])  # row 2's third token: a stop id ends it there
    rows = _rows(4, 1.0, 0, 1.0, stops=(stop,))._replace(max_new_B=jnp.asarray(limits))
    tokens, logprobs, mask = _sample_rows(rows, **layout)
    for b in range(4):
        first = [j for j in range(N) if free[0][b, j] == stop]
        n = min(int(limits[b]), first[0] + 1 if first else N)
        assert mask[b].tolist() == [1] * n + [0] * (N - n), b
        np.testing.assert_array_equal(tokens[b, :n], free[0][b, :n])
        assert (tokens[b, n:] == PAD).all()
        np.testing.assert_array_equal(logprobs[b, :n], free[1][b, :n])


def test_one_program_serves_every_setting() -> None:
    """The service's promise: after the first call, new temperatures, top-k, top-p, stops and limits compile
    nothing."""
    fn = _traced()
    _sample_rows(_rows(4, 1.0, 0, 1.0))
    before = fn._cache_size()
    for temperature, top_k, top_p in SETTINGS:
        _sample_rows(_rows(4, temperature, top_k, top_p, stops=(EOS, 7), max_new=2))
    assert fn._cache_size() == before
