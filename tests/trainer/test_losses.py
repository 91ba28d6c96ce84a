"""Loss values against numbers worked out by hand (written as explicit arithmetic, not via trainer code)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.base.config import RLConfig
from trainer.rl.losses import group_advantages, kl_estimate, policy_loss

LOGP = jnp.array([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
OLD = jnp.array([[-1.2, -1.5, -0.5], [-1.0, -0.2, -2.0]])
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])
ADV = jnp.array([1.0, -2.0])
e = math.exp
# Per-token clipped objective with eps 0.2 / eps_high 0.28 (ratios: row 0 e^.2, e^-.5, 1; row 1 e^-.5, 1):
#   row 0, A=+1: -min(r, clip r)     -> -e^.2 (inside), -e^-.5 (min picks r), -1
#   row 1, A=-2: -min(-2r, -2 clip r) -> r=e^-.5 < 0.8 so clip wins: +1.6; then +2
TOKEN_LOSSES = [[-e(0.2), -e(-0.5), -1.0], [1.6, 2.0]]


def _rl(**kw: object) -> RLConfig:
    return RLConfig(**{"clip_eps": 0.2, "clip_eps_high": 0.28, **kw})


def test_group_advantages_by_hand() -> None:
    r = jnp.array([1.0, 0.0, 0.5, 0.5, 3.0, 1.0])
    adv = group_advantages(r, 2, eps=1e-6)
    s = math.sqrt(0.5**2 + 0.5**2)  # unbiased std of (1, 0): sqrt(sum sq dev / (n - 1))
    want = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0, 0.0, 1.0 / (math.sqrt(2) + 1e-6), -1.0 / (math.sqrt(2) + 1e-6)]
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(group_advantages(r, 3, normalize_std=False)),
                               [1 - 0.5, 0 - 0.5, 0.5 - 0.5, 0.5 - 1.5, 3 - 1.5, 1 - 1.5], rtol=1e-6)


def test_grpo_token_mean() -> None:
    loss, m = policy_loss(LOGP, OLD, ADV, MASK, _rl(loss_agg="token_mean"))
    want = (sum(TOKEN_LOSSES[0]) + sum(TOKEN_LOSSES[1])) / 5
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(1 / 5)
    assert float(m["kl"]) == 0.0


def test_grpo_seq_mean_token_mean() -> None:
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, _rl(loss_agg="seq_mean_token_mean"))
    want = (sum(TOKEN_LOSSES[0]) / 3 + sum(TOKEN_LOSSES[1]) / 2) / 2
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_grpo_gradient_zero_on_clipped_token() -> None:
    grad = jax.grad(lambda lp: policy_loss(lp, OLD, ADV, MASK, _rl())[0])(LOGP)
    # d/dlogp of -A r / 5 is -A r / 5; the clipped token (row 1, token 0) and the masked one get nothing.
    np.testing.assert_allclose(np.asarray(grad), [[-e(0.2) / 5, -e(-0.5) / 5, -1 / 5], [0.0, 2 / 5, 0.0]],
                               rtol=1e-5, atol=1e-7)


def test_clip_eps_high_is_asymmetric() -> None:
    # ratio e^.25 = 1.284 is clipped by eps_high 0.28 but would not be by eps_high 0.3.
    logp = jnp.array([[0.25]])
    old = jnp.zeros((1, 1))
    one = jnp.ones((1, 1))
    adv = jnp.array([1.0])
    loss_lo, m_lo = policy_loss(logp, old, adv, one, _rl(clip_eps_high=0.28))
    loss_hi, m_hi = policy_loss(logp, old, adv, one, _rl(clip_eps_high=0.3))
    assert float(loss_lo) == pytest.approx(-1.28) and float(m_lo["clip_frac"]) == 1.0
    assert float(loss_hi) == pytest.approx(-e(0.25)) and float(m_hi["clip_frac"]) == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty(estimator: str) -> None:
    ref = jnp.full_like(LOGP, -1.0)
    beta = 0.1
    loss, m = policy_loss(LOGP, OLD, ADV, MASK, _rl(kl_beta=beta, kl_estimator=estimator), ref_logp_BN=ref)
    lp = [[-1.0, -2.0, -0.5], [-1.5, -0.2]]
    if estimator == "k1":  # log pi - log ref
        kls = [x + 1.0 for row in lp for x in row]
    else:  # e^(ref - pi) - (ref - pi) - 1
        kls = [e(-1.0 - x) - (-1.0 - x) - 1 for row in lp for x in row]
    kl = sum(kls) / 5
    assert float(m["kl"]) == pytest.approx(kl, rel=1e-5)
    assert float(loss) == pytest.approx((sum(TOKEN_LOSSES[0]) + sum(TOKEN_LOSSES[1])) / 5 + beta * kl, rel=1e-5)


def test_k3_is_nonnegative_and_zero_at_equality() -> None:
    x = jnp.linspace(-3, 3, 13)
    assert float(jnp.min(kl_estimate(x, x[::-1], "k3"))) >= 0
    assert float(jnp.max(jnp.abs(kl_estimate(x, x, "k3")))) == 0


def test_gspo_sequence_ratio() -> None:
    rl = _rl(algo="gspo", clip_eps=3e-4, clip_eps_high=4e-4)
    loss, m = policy_loss(LOGP, OLD, ADV, MASK, rl)
    s0 = e((0.2 - 0.5 + 0.0) / 3)  # geometric mean of row 0's token ratios (0.905, far below 1 - 3e-4)
    s1 = e((-0.5 + 0.0) / 2)  # the masked third token does not count
    # row 0, A=+1: -min(s0, clip(s0)) = -s0 (min picks the smaller, unclipped value)
    # row 1, A=-2: -min(-2 s1, -2 (1 - 3e-4)) = 2 (1 - 3e-4)  (clipped)
    want = (-s0 + 2 * (1 - 3e-4)) / 2
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(0.5)
    assert float(m["ratio"]) == pytest.approx((s0 + s1) / 2, rel=1e-5)


def test_dr_grpo_sums_over_constant_length() -> None:
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, _rl(algo="dr_grpo"), max_len=4)
    want = (sum(TOKEN_LOSSES[0]) + sum(TOKEN_LOSSES[1])) / (2 * 4)  # B = 2 sequences, max_len 4
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_on_policy_ratio_is_one() -> None:
    """First mu iteration: logp == old, so nothing clips and the loss is -mean(A) over tokens."""
    loss, m = policy_loss(OLD, OLD, ADV, MASK, _rl())
    assert float(m["clip_frac"]) == 0 and float(m["ratio"]) == pytest.approx(1.0)
    assert float(loss) == pytest.approx(-(3 * 1.0 + 2 * -2.0) / 5)


def test_decoupled_with_proximal_equal_to_behaviour_is_clip() -> None:
    """rl.lag_correction=decoupled: with pi_prox == pi_behaviour the behaviour weight is 1 and the loss (and its
    gradient) is clip's, for each algo."""
    for algo in ("grpo", "gspo", "dr_grpo"):
        def clip(lp: jax.Array, algo: str = algo) -> jax.Array:
            return policy_loss(lp, OLD, ADV, MASK, _rl(algo=algo), max_len=3)[0]

        def dec(lp: jax.Array, algo: str = algo) -> jax.Array:
            return policy_loss(lp, OLD, ADV, MASK, _rl(algo=algo, lag_correction="decoupled"), prox_logp_BN=OLD,
                               max_len=3)[0]

        assert float(dec(LOGP)) == pytest.approx(float(clip(LOGP)), rel=1e-6)
        np.testing.assert_allclose(np.asarray(jax.grad(dec)(LOGP)), np.asarray(jax.grad(clip)(LOGP)), rtol=1e-6)


def test_decoupled_truncated_behaviour_weight_by_hand() -> None:
    """The ratio is taken against pi_prox and clipped there; each token's loss is scaled by min(pi_prox / pi_behaviour,
    cap), a constant: where the cap binds the gradient is cap times the clipped term's."""
    prox = jnp.array([[-1.0, -1.5, -0.5], [-1.5, -0.2, -2.0]])
    behaviour = jnp.array([[-1.0 - math.log(3.0), -1.5, -0.5 + math.log(2.0)], [-1.5, -0.2 - 0.1, -2.0]])
    # weights pi_prox / pi_behaviour: row 0: 3 (capped at 2), 1, 1/2; row 1: 1, e^0.1 (masked: 0)
    adv = jnp.array([1.0, 1.0])
    rl = _rl(lag_correction="decoupled", behavior_weight_cap=2.0)
    loss, m = policy_loss(LOGP, behaviour, adv, MASK, rl, prox_logp_BN=prox)
    # ratios pi / pi_prox: row 0: 1, e^-.5, 1; row 1: 1, 1 (A > 0: min(r, clip r) = r where r <= 1.28)
    want = -(2.0 * 1.0 + 1.0 * e(-0.5) + 0.5 * 1.0 + 1.0 * 1.0 + e(0.1) * 1.0) / 5
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(m["behavior_capped_frac"]) == pytest.approx(1 / 5)
    assert float(m["behavior_weight"]) == pytest.approx((2.0 + 1.0 + 0.5 + 1.0 + e(0.1)) / 5, rel=1e-6)
    grad = jax.grad(lambda lp: policy_loss(lp, behaviour, adv, MASK, rl, prox_logp_BN=prox)[0])(LOGP)
    # d/dlogp of -w r A / 5 = -w r / 5 (w a constant: no gradient reaches pi_prox or pi_behaviour)
    np.testing.assert_allclose(np.asarray(grad), [[-2.0 / 5, -e(-0.5) / 5, -0.5 / 5], [-1 / 5, -e(0.1) / 5, 0.0]],
                               rtol=1e-5, atol=1e-7)
    # Without a cap the first token keeps its weight of 3.
    uncapped = policy_loss(LOGP, behaviour, adv, MASK, _rl(lag_correction="decoupled", behavior_weight_cap=None),
                           prox_logp_BN=prox)[0]
    assert float(uncapped) == pytest.approx(want - 1.0 / 5, rel=1e-5)
