"""The jitted programs of one RL step: sampling, reference log-probs, and the mu-iteration policy update.

Built once per (model, rl, sampling, optim, steps, mesh) and cached, with explicit in/out shardings from the
rule table so params and optimizer state stay where `sharding.RULES` puts them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from trainer import model as M
from trainer.config import ModelConfig, OptimConfig, RLConfig, SamplingConfig
from trainer.losses import group_advantages, policy_loss
from trainer.optim import make_optimizer
from trainer.sampler import Samples, sample
from trainer.sharding import batch_sharding, named_shardings, opt_state_shardings, replicated

# Folded into the base key so parameter init and per-step sampling never share a stream.
INIT_STREAM, STEP_STREAM = 0, 1
BATCH_KEYS = ("prompt", "prompt_valid", "completion", "mask", "old_logp", "rewards")


@dataclass(frozen=True)
class Programs:
    """The jitted pieces of a run for one mesh, and the shardings they use."""

    param_sh: Any
    opt_sh: Any
    optimizer: optax.GradientTransformation
    init_params: Any
    init_opt: Any
    sample: Any
    ref_logprobs: Any
    update: Any


@functools.lru_cache(maxsize=4)
def build_programs(mcfg: ModelConfig, rl: RLConfig, sc: SamplingConfig, optim: OptimConfig, steps: int,
                    mesh: Mesh, pad_id: int, eos_id: int) -> Programs:
    """Cached on the (frozen, hashable) config sections, so a resumed or repeated run in the same process
    reuses the compiled programs."""
    optimizer = make_optimizer(optim, steps, rl.mu_iterations)
    param_sh = named_shardings(mesh, M.param_axes(mcfg), M.abstract_params(mcfg))
    opt_sh = opt_state_shardings(mesh, optimizer, param_sh, M.abstract_params(mcfg))
    b2 = batch_sharding(mesh, 2)
    rep = replicated(mesh)

    def sample_fn(
        params: M.Params, prompt: jax.Array, valid: jax.Array, base_key: jax.Array, step: jax.Array
    ) -> Samples:
        key = jax.random.fold_in(jax.random.fold_in(base_key, STEP_STREAM), step)
        return sample(params, mcfg, prompt, valid, key, max_new_tokens=sc.max_new_tokens, eos_id=eos_id,
                      pad_id=pad_id, temperature=sc.temperature, top_k=sc.top_k, top_p=sc.top_p)

    def logprobs(params: M.Params, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return M.completion_logprobs(params, mcfg, batch["prompt"], batch["prompt_valid"], batch["completion"],
                                     batch["mask"], sc.temperature)

    def update_fn(params: M.Params, opt_state: Any, batch: dict[str, jax.Array], ref_logp: jax.Array | None) -> Any:
        mask = batch["mask"].astype(jnp.float32)
        rewards_BR = batch["rewards"]
        total_B = jnp.sum(rewards_BR, axis=1)
        adv_B = group_advantages(total_B, rl.group_size, normalize_std=rl.algo != "dr_grpo", eps=rl.adv_eps)

        def loss_fn(p: M.Params) -> tuple[jax.Array, dict[str, jax.Array]]:
            logp, entropy = logprobs(p, batch)
            loss, m = policy_loss(logp, batch["old_logp"], adv_B, mask, rl, ref_logp_BN=ref_logp,
                                  max_len=sc.max_new_tokens)
            m["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
            return loss, m

        def one_update(carry: tuple[M.Params, Any], _: None) -> tuple[tuple[M.Params, Any], dict[str, jax.Array]]:
            p, s = carry
            (_, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
            updates, s = optimizer.update(grads, s, p)
            m["grad_norm"] = optax.global_norm(grads)
            return (optax.apply_updates(p, updates), s), m

        (params, opt_state), ms = jax.lax.scan(one_update, (params, opt_state), None, length=rl.mu_iterations)
        metrics = {k: jnp.mean(v) for k, v in ms.items()}
        metrics["loss_first"] = ms["loss"][0]  # on-policy loss of the first iteration (ratio 1)
        metrics["reward_mean"] = jnp.mean(total_B)
        metrics["reward_std"] = jnp.std(total_B)
        metrics["rewards_mean_R"] = jnp.mean(rewards_BR, axis=0)
        metrics["rewards_std_R"] = jnp.std(rewards_BR, axis=0)
        metrics["completion_len"] = jnp.mean(jnp.sum(mask, axis=1))
        metrics["tokens"] = jnp.sum(mask)
        return params, opt_state, metrics

    batch_sh = {k: b2 for k in BATCH_KEYS}
    sample_jit = jax.jit(sample_fn, in_shardings=(param_sh, b2, b2, rep, rep), out_shardings=Samples(b2, b2, b2))
    ref_jit = jax.jit(lambda p, b: logprobs(p, b)[0], in_shardings=(param_sh, batch_sh), out_shardings=b2)
    update_jit = jax.jit(update_fn, in_shardings=(param_sh, opt_sh, batch_sh, b2 if rl.kl_beta > 0 else None),
                         out_shardings=(param_sh, opt_sh, rep), donate_argnums=(0, 1))
    init_params = jax.jit(lambda key: M.init_params(mcfg, jax.random.fold_in(key, INIT_STREAM)),
                          in_shardings=(rep,), out_shardings=param_sh)
    init_opt = jax.jit(optimizer.init, in_shardings=(param_sh,), out_shardings=opt_sh)
    return Programs(param_sh, opt_sh, optimizer, init_params, init_opt, sample_jit, ref_jit, update_jit)
