"""The clipped surrogate the trainer and the service share (trainer/rl/losses.py `clipped_surrogate`) against torch.

The reference is PPO's loss as it is usually written in torch, `-torch.min(r * A, torch.clamp(r, lo, hi) * A)`: at
a tie (r exactly on a bound, or the two terms of the min equal) torch.min splits the gradient evenly and torch.clamp
passes it at a bound, so a token on a bound keeps its full gradient, where jnp.clip + jnp.minimum would keep 3/4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from trainer.base.config import RLConfig
from trainer.rl.losses import clipped_surrogate, policy_loss
from trainer.service import losses as service_losses

f32 = np.float32


def torch_surrogate(ratio: np.ndarray, adv: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-token -min(r A, clamp(r) A) and its gradient in r, as torch computes them (float32)."""
    r = torch.tensor(ratio, dtype=torch.float32, requires_grad=True)
    a = torch.tensor(adv, dtype=torch.float32)
    loss = -torch.min(r * a, torch.clamp(r, low, high) * a)
    loss.sum().backward()
    assert r.grad is not None
    return loss.detach().numpy(), r.grad.numpy()


def ours(ratio: np.ndarray, adv: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    def loss(r: jax.Array) -> jax.Array:
        return -clipped_surrogate(r, jnp.asarray(adv), low, high)[0]

    value = loss(jnp.asarray(ratio))
    grad = jax.grad(lambda r: jnp.sum(loss(r)))(jnp.asarray(ratio))
    return np.asarray(value), np.asarray(grad)


def rounding_ties(high: float) -> list[tuple[float, float]]:
    """Ratios just above `high` with advantages for which r A and high A round to the same float32: the min's two
    terms are equal although the clip binds (torch gives half the gradient there). None when high is a power of
    two (its next float times A is always at least an ulp away)."""
    r = f32(np.nextafter(f32(high), f32(np.inf)))
    advs = np.random.default_rng(0).uniform(0.5, 2.0, 1000).astype(f32)
    return [(float(r), float(a)) for a in advs if r * a == f32(high) * a][:3]


@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.2, 0.2), (0.2, 0.28), (0.0, 0.0), (0.0, 0.5)])
def test_value_and_gradient_equal_torchs_at_ties_and_elsewhere(eps_low: float, eps_high: float) -> None:
    low, high = float(f32(1.0 - eps_low)), float(f32(1.0 + eps_high))  # float32 bounds: a ratio can sit on them
    inside = float(f32((low + high) / 2))
    ratios = [low, high, inside, 1.0, 0.5, 2.0, float(f32(low) - 1e-3), float(f32(high) + 1e-3)]
    cases = [(r, a) for r in ratios for a in (1.0, -1.0, 0.0, 2.5, -0.3)]
    ties = rounding_ties(high)
    assert ties or high == 1.0
    cases += ties
    ratio = np.array([r for r, _ in cases], f32)
    adv = np.array([a for _, a in cases], f32)
    want_value, want_grad = torch_surrogate(ratio, adv, low, high)
    value, grad = ours(ratio, adv, low, high)
    np.testing.assert_array_equal(value, want_value)
    np.testing.assert_array_equal(grad, want_grad)
    on_bound = ((ratio == f32(high)) & (adv > 0)) | ((ratio == f32(low)) & (adv < 0))
    assert on_bound.any()
    np.testing.assert_array_equal(grad[on_bound], -adv[on_bound])  # the full gradient, not 3/4 of it


def test_the_clip_mask_is_where_the_clip_binds() -> None:
    ratio = jnp.asarray([0.7, 0.8, 1.0, 1.2, 1.3, 0.7, 1.3], jnp.float32)
    adv = jnp.asarray([-1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0], jnp.float32)
    _, binds = clipped_surrogate(ratio, adv, float(f32(0.8)), float(f32(1.2)))
    assert np.asarray(binds).tolist() == [True, False, False, False, True, False, False]


def test_the_trainers_loss_has_torchs_gradient_on_a_bound() -> None:
    # logp == old: every ratio is exactly 1, and with both clip eps 0 both bounds are 1. torch: the full gradient,
    # -A / n per token (jnp.clip's ties at both bounds would leave 5/8 of it).
    logp = jnp.asarray([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]], jnp.float32)
    adv = jnp.asarray([1.0, -2.0], jnp.float32)
    mask = jnp.ones((2, 3), jnp.int32)
    for eps_low, eps_high in ((0.0, 0.0), (0.2, 0.0), (0.0, 0.28)):
        rl = RLConfig(clip_eps=eps_low, clip_eps_high=eps_high)
        grad = jax.grad(lambda x, rl=rl: policy_loss(x, logp, adv, mask, rl)[0])(logp)
        lp = torch.tensor(np.asarray(logp), requires_grad=True)
        r = torch.exp(lp - torch.tensor(np.asarray(logp)))
        a = torch.tensor(np.asarray(adv))[:, None]
        (-torch.min(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a).sum() / 6).backward()
        assert lp.grad is not None
        np.testing.assert_array_equal(np.asarray(grad), lp.grad.numpy())


def test_the_services_ppo_has_torchs_gradient_on_a_bound() -> None:
    logp = jnp.asarray([[-0.5, -2.0, -1.0]], jnp.float32)
    q = np.asarray(logp[0])  # ratio exactly 1 on every token, both bounds 1
    adv = np.array([1.0, -1.0, 0.5], f32)
    row = service_losses.Row("ppo", {"target_tokens": [0, 0, 0], "logprobs": q, "advantages": adv},
                             {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0})
    inputs = service_losses.pack_rows([row]).inputs
    grad = jax.grad(lambda x: service_losses.tinker_losses(x, inputs).total)(logp)
    np.testing.assert_array_equal(np.asarray(grad)[0], -adv)
