"""trainer/service/losses.py against references written from Tinker's docs, not from the module.

The numpy references transcribe the docs' torch snippets line by line (tinker-cookbook docs/losses.mdx at
b8701586: cross_entropy L58-60, importance_sampling L133-135, ppo L212-221, cispo L252-258, dro L286-290; gspo from
tinker-docs.thinkingmachines.ai/tinker/losses/gspo), in float64 on one unpadded datum at a time. stable_reinforce,
whose objective Tinker's docs leave open, is checked against the truncated importance-sampling REINFORCE gradient its
docstring chooses (-min(r, C) A per sampled token, Yao et al. 2025).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.service import losses as L

V = 11  # vocab of the toy logits


# ---- references from the docs (numpy, float64, one datum) ----


def np_logp(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return x[np.arange(len(targets)), targets] - lse


def np_loss(name: str, logp: np.ndarray, inp: dict[str, np.ndarray], cfg: L.RowConfig) -> float:
    """The docs' torch code, in numpy."""
    if name == "cross_entropy":
        return float((-logp * inp["weights"]).sum())
    q, adv = inp["logprobs"], inp["advantages"]
    prob_ratio = np.exp(logp - q)
    if name == "importance_sampling":
        return float(-(prob_ratio * adv).sum())
    if name == "ppo":
        clipped_ratio = np.clip(prob_ratio, cfg.clip_low, cfg.clip_high)
        return float(-np.minimum(prob_ratio * adv, clipped_ratio * adv).sum())
    if name == "cispo":
        clipped_ratio = np.clip(prob_ratio, cfg.clip_low, cfg.clip_high)
        return float(-(clipped_ratio * logp * adv).sum())
    if name == "dro":
        return float(-(logp * adv - 0.5 * cfg.beta * (logp - q) ** 2).sum())
    if name == "gspo":
        in_ratio = inp["sequence_ratio_mask"] != 0
        ratio = np.exp((logp - q)[in_ratio].mean()) * np.ones_like(logp)
        clipped_ratio = np.clip(ratio, cfg.clip_low, cfg.clip_high)
        return float(-np.minimum(ratio * adv, clipped_ratio * adv).sum())
    if name == "stable_reinforce":
        return float(-(np.minimum(prob_ratio, cfg.clip_high) * adv)[inp["sampled"] != 0].sum())
    raise AssertionError(name)


def np_dloss_dlogp(name: str, logp: np.ndarray, inp: dict[str, np.ndarray], cfg: L.RowConfig) -> np.ndarray:
    """d loss / d logp_t implied by the docs' code, stop-gradients (detach) included, away from clip ties."""
    if name == "cross_entropy":
        return -inp["weights"]
    q, adv = inp["logprobs"], inp["advantages"]
    r = np.exp(logp - q)
    if name == "importance_sampling":
        return -r * adv
    if name == "ppo":
        binds = ((adv > 0) & (r > cfg.clip_high)) | ((adv < 0) & (r < cfg.clip_low))
        return np.where(binds, 0.0, -r * adv)
    if name == "cispo":
        return -np.clip(r, cfg.clip_low, cfg.clip_high) * adv
    if name == "dro":
        return -(adv - cfg.beta * (logp - q))
    if name == "gspo":
        s = np.exp((logp - q)[inp["sequence_ratio_mask"] != 0].mean())
        binds = ((adv > 0) & (s > cfg.clip_high)) | ((adv < 0) & (s < cfg.clip_low))
        return np.where(binds, 0.0, -s * adv)
    if name == "stable_reinforce":
        return np.where(inp["sampled"] != 0, -np.minimum(r, cfg.clip_high) * adv, 0.0)
    raise AssertionError(name)


def np_dloss_dlogits(name: str, logits: np.ndarray, targets: np.ndarray, inp: dict, cfg: L.RowConfig) -> np.ndarray:
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(x.shape[-1])[targets]
    g = np_dloss_dlogp(name, np_logp(logits, targets), inp, cfg)
    return g[:, None] * (onehot - p)


# ---- data ----

CONFIGS: dict[str, dict[str, float] | None] = {
    "cross_entropy": None,
    "importance_sampling": None,
    "ppo": None,
    "cispo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
    "stable_reinforce": {"truncation_threshold": 1.2},
}


def make_datum(name: str, n: int, seed: int) -> tuple[np.ndarray, L.Row]:
    """Random logits [n, V] and a Row whose sampler logprobs sit near the model's (ratios around the clip range)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, V)).astype(np.float32) * 2
    targets = rng.integers(0, V, size=n)
    logp = np_logp(logits, targets)
    inputs: dict[str, np.ndarray] = {"target_tokens": targets.astype(np.int64)}
    if name == "cross_entropy":
        inputs["weights"] = rng.choice([0.0, 1.0, 0.5, -0.7], size=n).astype(np.float32)
    else:
        inputs["logprobs"] = (logp + rng.normal(scale=0.3, size=n)).astype(np.float32)
        inputs["advantages"] = rng.normal(size=n).astype(np.float32)
        inputs["advantages"][0] = 0.0  # a "prompt" position
    if name == "gspo":
        m = (rng.random(n) < 0.6).astype(np.float32)
        m[-1] = 1.0
        inputs["sequence_ratio_mask"] = m
    if name == "stable_reinforce":
        # The recorded sampler log-probs, not the datum's (which must not matter): positions 0-1 are the prompt.
        sampled = np.arange(n) >= 2
        inputs["advantages"][~sampled] = 0.0
        recorded = np.where(sampled, logp + rng.normal(scale=0.3, size=n), 0.0).astype(np.float32)
        inputs["logprobs"] = np.full(n, -50.0, np.float32)
        return logits, L.Row(name, inputs, CONFIGS[name], L.Provenance(recorded, sampled))
    return logits, L.Row(name, inputs, CONFIGS[name])


def reference_inputs(row: L.Row) -> dict[str, np.ndarray]:
    """A row's inputs as the references read them (stable_reinforce: q and S from its provenance)."""
    inp = {k: np.asarray(v, np.float64) for k, v in row.inputs.items()}
    if row.provenance is not None:
        inp["logprobs"] = row.provenance.logprobs.astype(np.float64)
        inp["sampled"] = row.provenance.sampled.astype(np.float64)
    return inp


def pad_logits(logits_list: list[np.ndarray], b: int, t: int, seed: int = 99) -> np.ndarray:
    """[b, t, V] with each datum's logits in front and random garbage everywhere else."""
    out = np.random.default_rng(seed).normal(size=(b, t, V)).astype(np.float32) * 5
    for i, lg in enumerate(logits_list):
        out[i, : len(lg)] = lg
    return out


@jax.jit
def _grad_and_out(logits: jax.Array, targets: jax.Array, inputs: L.LossInputs) -> tuple[jax.Array, L.LossOutput]:
    def total(lg: jax.Array) -> tuple[jax.Array, L.LossOutput]:
        out = L.losses_from_logits(lg, targets, inputs)
        return out.total, out

    return jax.grad(total, has_aux=True)(logits)


def run(packed: L.Packed, logits: np.ndarray) -> tuple[L.LossOutput, np.ndarray]:
    """Loss outputs and d total / d logits, jitted (tests keep to a few shapes so it compiles a few times)."""
    grad, out = _grad_and_out(
        jnp.asarray(logits), jnp.asarray(packed.targets), jax.tree.map(jnp.asarray, packed.inputs)
    )
    return out, np.asarray(grad)


# ---- tests ----


@pytest.mark.parametrize("name", L.SUPPORTED_LOSSES)
def test_each_loss_matches_the_docs_formula_value_and_gradient(name: str) -> None:
    logits, row = make_datum(name, 7, seed=L.LOSS_IDS[name])
    packed = L.pack_rows([row], length=12)  # one shape for every test that runs a single datum
    out, grad = run(packed, pad_logits([logits], 1, 12))
    cfg = L.resolve_config(name, row.config)
    inp = reference_inputs(row)
    logp = np_logp(logits, row.inputs["target_tokens"])
    expected = np_loss(name, logp, inp, cfg)
    np.testing.assert_allclose(float(out.row_loss[0]), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(out.total), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.logprobs[0, :7]), logp, rtol=1e-5, atol=1e-5)
    ref_grad = np_dloss_dlogits(name, logits, row.inputs["target_tokens"], inp, cfg)
    np.testing.assert_allclose(grad[0, :7], ref_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "dro"])
def test_reference_gradient_is_the_finite_difference_of_the_reference_loss(name: str) -> None:
    """Checks the reference gradient itself where the loss has no stop-gradient (so d value = gradient)."""
    logits, row = make_datum(name, 5, seed=7 + L.LOSS_IDS[name])
    cfg = L.resolve_config(name, row.config)
    inp = {k: np.asarray(v, np.float64) for k, v in row.inputs.items()}
    targets = row.inputs["target_tokens"]
    x = logits.astype(np.float64)
    analytic = np_dloss_dlogits(name, x, targets, inp, cfg)
    eps = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        hi, lo = x.copy(), x.copy()
        hi[idx] += eps
        lo[idx] -= eps
        fd[idx] = (np_loss(name, np_logp(hi, targets), inp, cfg) - np_loss(name, np_logp(lo, targets), inp, cfg)) / (
            2 * eps
        )
    np.testing.assert_allclose(analytic, fd, rtol=1e-5, atol=1e-7)


def test_hand_computed_values() -> None:
    """Small inputs worked out by hand (logp given directly)."""
    lp = np.log(np.array([[0.5, 0.25, 0.5]]))
    ln2 = np.log(2.0)

    def one(name: str, config: dict | None = None, **inputs: list[float]) -> float:
        row = L.Row(name, {"target_tokens": [0, 0, 0], **inputs}, config)
        return float(L.tinker_losses(jnp.asarray(lp), L.pack_rows([row]).inputs).total)

    # -(log .5 * 1 + log .25 * 2 + log .5 * 0) = 5 ln 2
    assert one("cross_entropy", weights=[1, 2, 0]) == pytest.approx(5 * ln2, rel=1e-6)
    # q = logp - ln 2 -> r = 2 everywhere; A = [1, -1, 3]: -(2 - 2 + 6) = -6
    q = (lp[0] - ln2).tolist()
    assert one("importance_sampling", logprobs=q, advantages=[1, -1, 3]) == pytest.approx(-6, rel=1e-6)
    # ppo (0.8, 1.2), r = 2: A = 1 -> min(2, 1.2) = 1.2; A = -1 -> min(-2, -1.2) = -2; A = 3 -> 3.6: -(1.2 - 2 + 3.6)
    assert one("ppo", logprobs=q, advantages=[1, -1, 3]) == pytest.approx(-2.8, rel=1e-6)
    # cispo default (0, 4): coefficient 2 -> -(2 * ln .5 * 1 + 2 * ln .25 * -1) = -(-2 ln2 + 4 ln2) = -2 ln 2
    assert one("cispo", logprobs=q, advantages=[1, -1, 0]) == pytest.approx(-2 * ln2, rel=1e-6)
    # dro beta 2, logp - q = ln 2: -(sum logp A - 3 * (0.5 * 2 * ln2^2)) with A = [1, 0, 0] -> ln2 + 3 ln2^2
    assert one("dro", {"beta": 2.0}, logprobs=q, advantages=[1, 0, 0]) == pytest.approx(ln2 + 3 * ln2**2, rel=1e-6)
    # gspo: log ratios [ln2, ln2, 0] (q = logp on the last), mask [1, 1, 0] -> s = 2, clip (0.8, 1.2);
    # A = [1, -1, 0]: -(min(2, 1.2) + min(-2, -1.2)) = -(1.2 - 2) = 0.8
    gq = [q[0], q[1], float(lp[0, 2])]
    got = one("gspo", None, logprobs=gq, advantages=[1, -1, 0], sequence_ratio_mask=[1, 1, 0])
    assert got == pytest.approx(0.8, rel=1e-6)


def test_cross_entropy_is_minus_weighted_logprob_sum_with_any_weights() -> None:
    """forward_backward_custom sends weights = -dLoss/dlogp, so negative and fractional weights must just multiply."""
    rng = np.random.default_rng(3)
    logp = -rng.random((1, 9)) * 4
    w = rng.normal(size=9)
    row = L.Row("cross_entropy", {"target_tokens": np.zeros(9, np.int64), "weights": w})
    inputs = L.pack_rows([row]).inputs
    total, grad = jax.value_and_grad(lambda x: L.tinker_losses(x, inputs).total)(jnp.asarray(logp, jnp.float32))
    assert float(total) == pytest.approx(-(logp[0] * w).sum(), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad[0]), -w, rtol=1e-6)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_ppo_clipping_at_and_around_the_thresholds(adv: float) -> None:
    """Ratios around 0.8 and 1.2 (the default clip). d loss/d logp = -r A unless the clip binds against A's sign
    (A > 0 and r > 1.2, or A < 0 and r < 0.8), where it is 0; a ratio clipped on the other side keeps it."""
    ratios = np.array([0.5, 0.8 - 1e-3, 0.8 + 1e-3, 1.0, 1.2 - 1e-3, 1.2 + 1e-3, 2.0])
    n = len(ratios)
    q = np.full(n, -1.0)
    logp = jnp.asarray(np.log(ratios) + q, jnp.float32)[None]
    r = np.exp(np.asarray(logp[0], np.float64) - q)
    row = L.Row("ppo", {"target_tokens": np.zeros(n, np.int64), "logprobs": q, "advantages": np.full(n, adv)})
    inputs = L.pack_rows([row]).inputs
    grad = np.asarray(jax.grad(lambda x: L.tinker_losses(x, inputs).total)(logp))[0]
    value = float(L.tinker_losses(logp, inputs).total)
    assert value == pytest.approx(-np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv).sum(), rel=1e-5)
    binds = (r > 1.2) if adv > 0 else (r < 0.8)
    assert binds.sum() == 2
    np.testing.assert_allclose(grad, np.where(binds, 0.0, -r * adv), rtol=1e-5, atol=1e-7)


def test_ppo_gradient_on_an_exact_bound_is_full() -> None:
    """r == clip_high exactly (A > 0) and r == clip_low exactly (A < 0), thresholds set to the float32 ratio."""
    logp = jnp.asarray([[-0.5, -2.0]], jnp.float32)
    q = np.array([-0.9, -1.5], np.float32)
    r = np.exp(np.asarray(logp[0]) - q)  # float32 like the loss; [~1.49, ~0.61]
    for adv, cfg in (
        (1.0, {"clip_low_threshold": 0.1, "clip_high_threshold": float(r[0])}),
        (-1.0, {"clip_low_threshold": float(r[1]), "clip_high_threshold": 9.0}),
    ):
        row = L.Row("ppo", {"target_tokens": [0, 0], "logprobs": q, "advantages": [adv, adv]}, cfg)
        inputs = L.pack_rows([row]).inputs
        grad = np.asarray(jax.grad(lambda x, i=inputs: L.tinker_losses(x, i).total)(logp))[0]
        np.testing.assert_allclose(grad, -r * adv, rtol=1e-5)


def test_padding_rows_and_columns_change_nothing() -> None:
    datums = [
        make_datum(name, n, seed=20 + i)
        for i, (name, n) in enumerate(zip(L.SUPPORTED_LOSSES, [3, 7, 5, 6, 4, 8, 5], strict=True))
    ]
    rows = [row for _, row in datums]
    logits_list = [lg for lg, _ in datums]
    tight = L.pack_rows(rows)
    out_tight, grad_tight = run(tight, pad_logits(logits_list, len(rows), int(tight.lengths.max()), seed=1))
    loose = L.pack_rows(rows, length=13, num_rows=9)
    out_loose, grad_loose = run(loose, pad_logits(logits_list, 9, 13, seed=2))
    k = len(rows)
    np.testing.assert_allclose(np.asarray(out_loose.row_loss[:k]), np.asarray(out_tight.row_loss), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out_loose.row_loss[k:]), 0.0)
    assert float(out_loose.total) == pytest.approx(float(out_tight.total), rel=1e-6)
    for i, n in enumerate(tight.lengths):
        np.testing.assert_allclose(grad_loose[i, :n], grad_tight[i, :n], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(grad_loose[i, n:], 0.0)
        np.testing.assert_array_equal(np.asarray(out_loose.logprobs[i, n:]), 0.0)
    np.testing.assert_array_equal(grad_loose[k:], 0.0)


def test_mixed_batch_equals_each_loss_alone_and_jit_and_sharding_agree() -> None:
    datums = [make_datum(name, 4 + i, seed=40 + i) for i, name in enumerate(L.SUPPORTED_LOSSES)]
    datums += [make_datum("ppo", 6, seed=60)]  # 8 rows: one per device
    rows = [row for _, row in datums]
    packed = L.pack_rows(rows, length=12)
    logits = pad_logits([lg for lg, _ in datums], len(rows), 12)
    out, grad = run(packed, logits)
    for i, (lg, row) in enumerate(datums):
        alone_out, alone_grad = run(L.pack_rows([row], length=12), pad_logits([lg], 1, 12))
        n = len(lg)
        assert float(out.row_loss[i]) == pytest.approx(float(alone_out.row_loss[0]), rel=1e-6, abs=1e-6)
        np.testing.assert_allclose(grad[i, :n], alone_grad[0, :n], rtol=1e-5, atol=1e-7)
    # A request's loss:sum is the sum over its own rows only.
    assert L.request_metrics(out.row_loss, [2, 6])["loss:sum"] == pytest.approx(
        float(out.row_loss[2] + out.row_loss[6]), rel=1e-6
    )

    # The same program jitted, with the rows sharded over the 8 devices as an engine would.
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def shard(x: np.ndarray) -> jax.Array:
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))

    @jax.jit
    def step(lg: jax.Array, targets: jax.Array, inputs: L.LossInputs) -> tuple[jax.Array, jax.Array]:
        def total(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            o = L.losses_from_logits(x, targets, inputs)
            return o.total, o.row_loss

        return jax.grad(total, has_aux=True)(lg)

    jit_grad, jit_rows = step(shard(logits), shard(packed.targets), jax.tree.map(shard, packed.inputs))
    assert len(jax.devices()) == 8
    np.testing.assert_allclose(np.asarray(jit_rows), np.asarray(out.row_loss), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jit_grad), grad, rtol=1e-5, atol=1e-6)


def test_gspo_uses_one_ratio_per_sequence_and_empty_mask_means_ratio_one() -> None:
    logp = jnp.asarray([[-1.0, -2.0, -3.0, -4.0]], jnp.float32)
    q = [-1.5, -2.0, -3.5, -9.0]  # log ratios 0.5, 0, 0.5, 5
    inputs = {"target_tokens": [0] * 4, "logprobs": q, "advantages": [1.0, 1.0, 1.0, 0.0]}
    # Only the first three count toward s: s = exp(1/3), within (0.5, 2) -> every token has gradient -s A.
    row = L.Row(
        "gspo", {**inputs, "sequence_ratio_mask": [1, 1, 1, 0]}, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    )
    packed = L.pack_rows([row])
    grad = np.asarray(jax.grad(lambda x: L.tinker_losses(x, packed.inputs).total)(logp))[0]
    s = np.exp(1 / 3)
    np.testing.assert_allclose(grad, [-s, -s, -s, 0.0], rtol=1e-5)
    assert float(L.tinker_losses(logp, packed.inputs).total) == pytest.approx(-3 * s, rel=1e-5)
    empty = L.pack_rows([L.Row("gspo", {**inputs, "sequence_ratio_mask": [0, 0, 0, 0]})])
    assert float(L.tinker_losses(logp, empty.inputs).total) == pytest.approx(-3.0, rel=1e-6)


def test_config_defaults_and_refusals() -> None:
    assert L.resolve_config("ppo", None) == L.RowConfig(clip_low=0.8, clip_high=1.2)
    assert L.resolve_config("gspo", {}) == L.RowConfig(clip_low=0.8, clip_high=1.2)
    assert L.resolve_config("cispo", None) == L.RowConfig(clip_low=0.0, clip_high=4.0)
    assert L.resolve_config("ppo", {"clip_low_threshold": 0.9}) == L.RowConfig(clip_low=0.9, clip_high=1.2)
    assert L.resolve_config("dro", {"beta": 0.05}).beta == 0.05
    with pytest.raises(L.BadLossInput, match="beta"):
        L.resolve_config("dro", None)
    with pytest.raises(L.BadLossInput, match="clip_high_threshold"):
        L.resolve_config("importance_sampling", {"clip_high_threshold": 1.1})
    with pytest.raises(L.BadLossInput, match="clip_low_threshold <= clip_high_threshold"):
        L.resolve_config("ppo", {"clip_low_threshold": 1.3})
    with pytest.raises(L.BadLossInput, match="finite number"):
        L.resolve_config("ppo", {"clip_low_threshold": "0.9"})
    for name in ("custom", "ppo_critic"):
        with pytest.raises(L.UnsupportedLoss) as err:
            L.loss_id(name)
        assert "cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce" in str(err.value)
    assert L.resolve_config("stable_reinforce", None) == L.RowConfig(clip_high=2.0)
    with pytest.raises(L.BadLossInput, match="truncation_threshold must be > 0"):
        L.resolve_config("stable_reinforce", {"truncation_threshold": 0.0})
    with pytest.raises(L.BadLossInput, match="record_stability_info=True"):
        L.pack_rows([L.Row("stable_reinforce", {"target_tokens": [1], "advantages": [1.0]})])
    unsampled = L.Provenance(np.zeros(2, np.float32), np.array([False, True]))
    with pytest.raises(L.BadLossInput, match="advantages must be 0 where no sampled sequence"):
        L.pack_rows([L.Row("stable_reinforce", {"target_tokens": [1, 1], "advantages": [1.0, 1.0]}, None, unsampled)])


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (L.Row("importance_sampling", {"target_tokens": [1, 2], "logprobs": [0.0, 0.0]}), "missing.*advantages"),
        (L.Row("gspo", {"target_tokens": [1], "logprobs": [0.0], "advantages": [1.0]}), "sequence_ratio_mask"),
        (L.Row("cross_entropy", {"target_tokens": [1, 2], "weights": [1.0]}), "length 1"),
        (L.Row("cross_entropy", {"target_tokens": [[1, 2]], "weights": [[1.0, 1.0]]}), r"multi-target"),
        (L.Row("cross_entropy", {"target_tokens": [1], "weights": [float("nan")]}), "non-finite"),
        (L.Row("cross_entropy", {"target_tokens": [1], "weights": [1.0], "mask": [1.0]}), "unknown loss_fn_inputs"),
        (L.Row("cross_entropy", {"target_tokens": [V], "weights": [1.0]}), "target_tokens must be integers"),
        (L.Row("cross_entropy", {"target_tokens": [1.5], "weights": [1.0]}), "target_tokens must be integers"),
    ],
)
def test_bad_inputs_are_user_errors(row: L.Row, match: str) -> None:
    with pytest.raises(L.BadLossInput, match=match):
        L.pack_rows([row], vocab_size=V)


def test_per_token_clip_thresholds_from_loss_fn_inputs_override_config() -> None:
    row = L.Row(
        "ppo",
        {
            "target_tokens": [0, 0],
            "logprobs": [-1.0, -1.0],
            "advantages": [1.0, 1.0],
            "clip_high_threshold": [1.1, 3.0],
        },
    )
    packed = L.pack_rows([row])
    np.testing.assert_allclose(packed.inputs.clip_high[0], [1.1, 3.0])
    np.testing.assert_allclose(packed.inputs.clip_low[0], [0.8, 0.8])
    # r = e^0.5 ~ 1.65: clipped to 1.1 on the first token, not on the second.
    total = float(L.tinker_losses(jnp.asarray([[-0.5, -0.5]]), packed.inputs).total)
    assert total == pytest.approx(-(1.1 + np.exp(0.5)), rel=1e-6)


def test_metric_keys_carry_a_reduction_suffix() -> None:
    metrics = L.request_metrics(np.array([1.0, 2.0, 4.0]), slice(0, 2))
    assert metrics == {"loss:sum": 3.0}
    for key in metrics:
        assert key.count(":") == 1 and key.split(":")[1] in ("sum", "mean", "min", "max")
    for bad in ("loss", "loss:avg", "a:b:sum", ":sum"):
        with pytest.raises(ValueError):
            L.check_metric_keys({bad: 1.0})


def _load_skyrl_loss_fns(src: Path) -> types.ModuleType:
    """skyrl/tinker/loss_fns.py needs only LOSS_TYPES from skyrl.tinker.types (which needs Python 3.12 + pydantic)."""
    stub = types.ModuleType("skyrl.tinker.types")
    stub.LOSS_TYPES = {"cross_entropy": 0, "importance_sampling": 1, "ppo": 2, "cispo": 3}  # types.py L358-363
    saved = sys.modules.get("skyrl.tinker.types")
    sys.modules["skyrl.tinker.types"] = stub
    try:
        spec = importlib.util.spec_from_file_location("skyrl_loss_fns", src / "skyrl" / "tinker" / "loss_fns.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("skyrl.tinker.types")
        else:
            sys.modules["skyrl.tinker.types"] = saved
    return module


@pytest.mark.skipif(not os.environ.get("SKYRL_SRC"), reason="set SKYRL_SRC to an unpacked skyrl 0.4.0 wheel")
@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "cispo"])
def test_per_token_losses_match_skyrl_with_unit_weights(name: str) -> None:
    """skyrl's four JAX losses give the same per-token values and gradients when its loss_mask (= weights) is ones
    (and, for cross_entropy, when our weights are its loss_mask); it then divides by the weight sum, we do not."""
    sky = _load_skyrl_loss_fns(Path(os.environ["SKYRL_SRC"]))
    logits, row = make_datum(name, 6, seed=80 + L.LOSS_IDS[name])
    cfg = L.resolve_config(name, row.config)
    packed = L.pack_rows([row])
    logp = jnp.asarray(np_logp(logits, row.inputs["target_tokens"]), jnp.float32)
    mask = jnp.asarray(row.inputs.get("weights", np.ones(6)), jnp.float32)
    q = jnp.asarray(row.inputs.get("logprobs", np.zeros(6)), jnp.float32)
    adv = jnp.asarray(row.inputs.get("advantages", np.zeros(6)), jnp.float32)
    sky_cfg = sky.LossFnConfig(
        clip_low_threshold=jnp.float32(cfg.clip_low), clip_high_threshold=jnp.float32(cfg.clip_high)
    )
    fn = sky.LOSS_FUNCTIONS[L.LOSS_IDS[name]]
    sky_tok = np.asarray(fn(logp, mask, q, adv, sky_cfg))
    sky_grad = np.asarray(jax.grad(lambda x: fn(x, mask, q, adv, sky_cfg).sum())(logp))
    ours = lambda x: L.tinker_losses(x[None], packed.inputs).total  # noqa: E731
    assert float(ours(logp)) == pytest.approx(float(sky_tok.sum()), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(logp)), sky_grad, rtol=1e-5, atol=1e-7)


def test_stable_reinforce_truncates_the_ratio_and_keeps_the_gradient() -> None:
    """Ratios [0.5, 1, 3, e^200] with C = 2 on sampled tokens, a prompt token first: the gradient is -min(r, C) A
    (a truncated token keeps C times its REINFORCE gradient, where ppo's clip would give none), the value
    -sum min(r, C) A, nothing overflows, and the datum's own `logprobs` are not read."""
    ratios = np.array([1.0, 0.5, 1.0, 3.0])
    q = np.array([0.0, -1.0, -1.0, -1.0, -201.0])
    logp = jnp.asarray([[-1.0, *(np.log(ratios[1:]) - 1.0), -1.0]], jnp.float32)
    sampled = np.array([False, True, True, True, True])
    adv = np.array([0.0, 1.0, -2.0, 1.0, 1.0])
    row = L.Row("stable_reinforce", {"target_tokens": [0] * 5, "advantages": adv, "logprobs": [9.0] * 5}, None,
                L.Provenance(q.astype(np.float32), sampled))
    inputs = L.pack_rows([row]).inputs
    value, grad = jax.value_and_grad(lambda x: L.tinker_losses(x, inputs).total)(logp)
    weight = np.array([0.0, 0.5, 1.0, 2.0, 2.0])
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    assert float(value) == pytest.approx(-(weight * adv).sum(), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad[0]), -weight * adv, rtol=1e-5, atol=1e-7)
    # Where no ratio exceeds C it is importance_sampling on the recorded log-probs, value and gradient.
    small = L.Row("stable_reinforce", {"target_tokens": [0] * 3, "advantages": [1.0, -1.0, 0.5]}, None,
                  L.Provenance(np.array([-1.2, -0.7, -1.0], np.float32), np.ones(3, bool)))
    plain = L.Row("importance_sampling", {"target_tokens": [0] * 3, "advantages": [1.0, -1.0, 0.5],
                                          "logprobs": [-1.2, -0.7, -1.0]})
    x = jnp.asarray([[-1.0, -1.0, -1.0]], jnp.float32)
    ins_a, ins_b = L.pack_rows([small]).inputs, L.pack_rows([plain]).inputs
    (va, ga), (vb, gb) = (jax.value_and_grad(lambda v, i=i: L.tinker_losses(v, i).total)(x) for i in (ins_a, ins_b))
    assert float(va) == pytest.approx(float(vb), rel=1e-6)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-6)
