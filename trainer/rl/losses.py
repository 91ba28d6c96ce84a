"""Policy-gradient losses: GRPO, GSPO (sequence-level ratio) and Dr.GRPO, with optional KL to a reference.

Rows are prompt-major: row b belongs to prompt b // group_size. Token arrays are [B, N] over the completion;
`mask_BN` is 1 for generated tokens (through EOS).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer.base.config import RLConfig

Metrics = dict[str, jax.Array]


def group_advantages(
    rewards_B: jax.Array, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> jax.Array:
    """(r - group mean) / (group std + eps); Dr.GRPO drops the std division. Std is the unbiased (n-1) one."""
    r_PG = rewards_B.reshape(-1, group_size).astype(jnp.float32)
    adv_PG = r_PG - jnp.mean(r_PG, axis=1, keepdims=True)
    if normalize_std:
        adv_PG = adv_PG / (jnp.std(r_PG, axis=1, keepdims=True, ddof=1) + eps)
    return adv_PG.reshape(-1)


def kl_estimate(logp_BN: jax.Array, ref_logp_BN: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(pi || ref) from samples of pi: k1 = log(pi/ref), k3 = r - 1 - log r, r = ref/pi."""
    log_r = ref_logp_BN - logp_BN
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return jnp.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown kl estimator {estimator!r}")


def _masked_sum(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    return jnp.sum(x * mask, axis=axis)


class Norm(NamedTuple):
    """Denominators of the means: the tokens and sequences of the whole (mini)batch.

    A micro-batch's loss divides its own sums by the whole batch's counts, so the micro-batch losses (and their
    gradients and metrics) add up to the single-pass values.
    """

    tokens: jax.Array
    seqs: jax.Array | int

    @staticmethod
    def of(mask_BN: jax.Array) -> Norm:
        return Norm(jnp.maximum(jnp.sum(mask_BN.astype(jnp.float32)), 1.0), mask_BN.shape[0])


def aggregate(
    loss_BN: jax.Array, mask_BN: jax.Array, mode: str, max_len: int | None = None, norm: Norm | None = None
) -> jax.Array:
    """token_mean: over all tokens; seq_mean_token_mean: per sequence, then over sequences;
    constant: sum / (B * max_len), the Dr.GRPO length-unbiased form."""
    mask = mask_BN.astype(jnp.float32)
    norm = norm or Norm.of(mask)
    if mode == "token_mean":
        return _masked_sum(loss_BN, mask) / norm.tokens
    if mode == "seq_mean_token_mean":
        per_seq = _masked_sum(loss_BN, mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return jnp.sum(per_seq) / norm.seqs
    if mode == "constant":
        assert max_len is not None
        return _masked_sum(loss_BN, mask) / (norm.seqs * max_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


Bound = jax.Array | float


def clamp(x: jax.Array, low: Bound, high: Bound) -> jax.Array:
    """jnp.clip's value with torch.clamp's gradient: 1 on [low, high], bounds included. jnp.clip (a max, then a min)
    splits a tie at a bound like any max or min, and passes only 1/2 of the gradient there."""
    inside = (x >= low) & (x <= high)
    return jnp.where(inside, x, jax.lax.stop_gradient(jnp.clip(x, low, high)))


def clipped_surrogate(ratio: jax.Array, adv: jax.Array, low: Bound, high: Bound) -> tuple[jax.Array, jax.Array]:
    """PPO's clipped surrogate min(r A, clip(r, low, high) A), to maximise, and where the clip binds (A > 0 and
    r > high, or A < 0 and r < low: no gradient there). The one copy the trainer and the service share.

    Its gradient is torch's for the usual `torch.min(r * A, torch.clamp(r, low, high) * A)` (the Tinker docs' ppo,
    and the papers' code): torch.min and jnp.minimum both split a tie evenly, and torch.clamp passes the gradient at
    a bound, so a ratio exactly on a bound keeps its full gradient (with jnp.clip it would keep 3/4).
    tests/trainer/test_clipped_surrogate.py checks it against torch.
    """
    binds = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    return jnp.minimum(ratio * adv, clamp(ratio, low, high) * adv), binds


def _clipped_objective(
    ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float
) -> tuple[jax.Array, jax.Array]:
    """-min(r A, clip(r) A) and whether the clip is the active term."""
    objective, is_clipped = clipped_surrogate(ratio, adv, 1.0 - eps_low, 1.0 + eps_high)
    return -objective, is_clipped


def behavior_weight(log_w: jax.Array, cap: float | None) -> tuple[jax.Array, jax.Array]:
    """The behaviour importance weight pi_prox / pi_behaviour from its log, truncated at `cap` (truncated IS), as a
    constant (no gradient), and where the cap binds."""
    w = jnp.exp(jax.lax.stop_gradient(log_w))
    if cap is None:
        return w, jnp.zeros(w.shape, bool)
    return jnp.minimum(w, cap), w > cap


def policy_loss(
    logp_BN: jax.Array,
    old_logp_BN: jax.Array,
    adv_B: jax.Array,
    mask_BN: jax.Array,
    rl: RLConfig,
    *,
    ref_logp_BN: jax.Array | None = None,
    prox_logp_BN: jax.Array | None = None,
    max_len: int | None = None,
    norm: Norm | None = None,
) -> tuple[jax.Array, Metrics]:
    """Scalar loss to minimise and metrics (kl, clip_frac, ratio).

    grpo: per-token clipped ratio, aggregated by `rl.loss_agg`. gspo: one clipped ratio per sequence, mean over
    sequences. dr_grpo: per-token clipped ratio summed and divided by B * `max_len` (a constant), and its
    advantages skip the std division (see `group_advantages`). The KL term is aggregated like the token
    loss (gspo: by `rl.loss_agg`). `norm` (default: this batch's counts) gives the denominators of every mean.

    The off-policy correction (`rl.lag_correction`; rollouts sampled `rl.lag` updates ago by the behaviour policy,
    whose log-probs are `old_logp_BN`): clip = the ratio pi / pi_behaviour, clipped as above (no extra pass).
    decoupled, given `prox_logp_BN` (the proximal policy: the weights before this step's update) = AReaL's decoupled
    PPO objective (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
    Reasoning", arXiv:2505.24298, eq. 5): the ratio pi / pi_prox clipped, times the behaviour weight
    w = pi_prox / pi_behaviour (a constant), truncated at `rl.behavior_weight_cap` as in truncated importance sampling
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):
    -min(w, cap) * min(r A, clip(r) A), r = pi / pi_prox. AReaL's code caps differently: it drops the tokens with
    w > cap (weight 0; `ppo_actor_loss_fn`, behav_imp_weight_cap), where this keeps them at weight cap. With
    pi_prox = pi_behaviour (w = 1) it is clip's loss.
    gspo takes both ratios per sequence (the geometric mean of the token ratios).
    """
    mask = mask_BN.astype(jnp.float32)
    norm = norm or Norm.of(mask)
    n_tokens = norm.tokens
    prox_BN = prox_logp_BN if rl.lag_correction == "decoupled" else None
    base_BN = old_logp_BN if prox_BN is None else prox_BN
    log_ratio_BN = (logp_BN - base_BN) * mask
    metrics: Metrics = {}
    if rl.algo == "gspo":
        # One importance ratio per sequence: the geometric mean of its token ratios.
        lengths_B = jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        s_B = jnp.exp(jnp.sum(log_ratio_BN, axis=1) / lengths_B)
        pg_B, clipped_B = _clipped_objective(s_B, adv_B, rl.clip_eps, rl.clip_eps_high)
        if prox_BN is not None:  # the behaviour weight per sequence, like the ratio
            log_w_B = jnp.sum((prox_BN - old_logp_BN) * mask, axis=1) / lengths_B
            w_B, capped_B = behavior_weight(log_w_B, rl.behavior_weight_cap)
            pg_B = pg_B * w_B
            metrics["behavior_weight"] = jnp.sum(w_B) / norm.seqs
            metrics["behavior_capped_frac"] = jnp.sum(capped_B.astype(jnp.float32)) / norm.seqs
        loss = jnp.sum(pg_B) / norm.seqs
        clip_frac = jnp.sum(clipped_B.astype(jnp.float32)) / norm.seqs
        ratio_mean = jnp.sum(s_B) / norm.seqs
    else:
        ratio_BN = jnp.exp(log_ratio_BN)
        pg_BN, clipped_BN = _clipped_objective(ratio_BN, adv_B[:, None], rl.clip_eps, rl.clip_eps_high)
        if prox_BN is not None:
            w_BN, capped_BN = behavior_weight((prox_BN - old_logp_BN) * mask, rl.behavior_weight_cap)
            pg_BN = pg_BN * w_BN
            metrics["behavior_weight"] = _masked_sum(w_BN, mask) / n_tokens
            metrics["behavior_capped_frac"] = _masked_sum(capped_BN.astype(jnp.float32), mask) / n_tokens
        mode = "constant" if rl.algo == "dr_grpo" else rl.loss_agg
        loss = aggregate(pg_BN, mask, mode, max_len, norm)
        clip_frac = _masked_sum(clipped_BN.astype(jnp.float32), mask) / n_tokens
        ratio_mean = _masked_sum(ratio_BN, mask) / n_tokens
    metrics.update({"pg_loss": loss, "clip_frac": clip_frac, "ratio": ratio_mean})
    if ref_logp_BN is not None:
        kl_BN = kl_estimate(logp_BN, ref_logp_BN, rl.kl_estimator)
        kl_mode = "constant" if rl.algo == "dr_grpo" else rl.loss_agg
        kl = aggregate(kl_BN, mask, kl_mode, max_len, norm)
        loss = loss + rl.kl_beta * kl
        metrics["kl"] = _masked_sum(kl_BN, mask) / n_tokens
    else:
        metrics["kl"] = jnp.zeros(())
    metrics["loss"] = loss
    return loss, metrics
