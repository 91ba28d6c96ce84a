"""The jitted programs of one RL step: sampling, reference log-probs, and the mu-iteration policy update.

Built once per (config sections, mesh) and cached, with explicit in/out shardings from the rule table so params
and optimizer state stay where `sharding.RULES` puts them. The loop calls them on real arrays; the preflight
(`trainer.fit.preflight`) lowers the very same programs on `abstract_args` for a TPU topology.

The update, top to bottom: advantages over the whole batch; then `mu_iterations` passes, each taking one
optimizer step per minibatch (`rl.minibatches`); each minibatch's gradient is summed over micro-batches
(`compute.train_micro_batch_size`) whose losses are normalised by the minibatch's token and sequence counts, so
accumulation equals one pass over the minibatch up to float rounding.

With `lora`, the programs' params are {"base": frozen weights, "lora": the adapter stack (trainer/model/lora.py)}:
gradients, optimizer state and updates cover the adapters alone, and the base passes through the update untouched. Each
batch row picks its adapter slot (`slot`, int32 [B]; -1 = the base model alone); the reference policy is the base model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.base.config import (
    ComputeConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RLConfig,
    SamplingConfig,
    TrainConfig,
)
from trainer.model import decoder as M
from trainer.model import lora as L
from trainer.model.sharding import (
    RULES,
    RULES_ACROSS_SLICES,
    RULES_GATHERED,
    MeshJit,
    batch_sharding,
    constrain,
    data_size,
    named_shardings,
    opt_state_shardings,
    regroup,
    replicated,
    split_strided,
)
from trainer.rl.losses import Norm, group_advantages, policy_loss
from trainer.rl.optim import make_optimizer
from trainer.rl.sampler import Samples, sample

# Folded into the base key so parameter init, adapter init, per-step sampling and the eval never share a stream.
INIT_STREAM, STEP_STREAM, LORA_STREAM, EVAL_STREAM = 0, 1, 2, 3
BATCH_KEYS = ("prompt", "prompt_valid", "completion", "mask", "old_logp", "rewards")
PROX_KEY = "prox_logp"  # in the batch with rl.lag_correction=decoupled: the proximal policy's log-probs
Batch = dict[str, jax.Array]


@dataclass(frozen=True)
class Programs:
    """The jitted pieces of a run for one mesh, and the shardings they use."""

    mesh: Mesh
    param_sh: Any
    opt_sh: Any
    optimizer: optax.GradientTransformation
    init_params: Any
    init_opt: Any
    sample: Any
    ref_logprobs: Any
    update: Any
    lora: LoraConfig | None = None
    init_lora: Any = None  # key -> a fresh adapter stack (lora only; for a base imported from Hugging Face)
    # (temperature, top_k, top_p) -> `sample` at those settings, same arguments (the eval's greedy and sampled runs);
    # `sample` itself at the config's settings.
    sampler: Any = None
    logprobs: Any = None  # (params, batch) -> the policy's own completion log-probs [B, N] (rl.lag_correction)


def build_programs(cfg: TrainConfig, mesh: Mesh, pad_id: int, eos_id: int) -> Programs:
    """The programs for a resolved config (mesh axes known) on `mesh`."""
    rules = RULES_ACROSS_SLICES if cfg.mesh.fsdp_across_slices else RULES
    platform = mesh.devices.flat[0].platform
    micro_rows = cfg.micro_batch_rows_on(platform, data_size(mesh))
    # Resolved before the cache: configs equal in value can resolve apart (a decode_block left unset on a GPU)
    return _build(cfg.model_cfg, cfg.compute.on_platform(platform), cfg.rl, cfg.sampling, cfg.optim, cfg.steps,
                  micro_rows, mesh, rules, pad_id, eos_id, cfg.lora)


UNSTACKED_SAMPLER_PLATFORMS = frozenset({"gpu"})


def gather_for_sampling(params: M.Params, dt: Any, sh: Any, by_layer: bool, unroll: bool = False) -> M.Params:
    """The sampler's compute-dtype copy of the weights, laid out by `sh`. `by_layer` (a regrouped sampler mesh): the
    stacked layers one at a time, each cast and resharded in a scan (`unroll`ed where the layers are: fit prices
    unrolled programs). XLA reshards a whole stacked leaf onto another mesh through a copy still split the old way:
    9.4 GiB per chip for Llama-3.1-70B's MLP on 2 x v6e 4x4."""
    if not by_layer:
        return jax.lax.with_sharding_constraint(M.cast_weights(params, dt), sh)
    one_layer = jax.tree.map(lambda s: NamedSharding(s.mesh, PartitionSpec(*s.spec[1:])), sh["layers"])

    def step(_: None, layer: M.Params) -> tuple[None, M.Params]:
        return None, jax.lax.with_sharding_constraint(M.cast_weights(layer, dt), one_layer)

    _, layers = jax.lax.scan(step, None, params["layers"], unroll=unroll)
    rest = M.cast_weights({k: v for k, v in params.items() if k != "layers"}, dt)
    return jax.lax.with_sharding_constraint({**rest, "layers": layers}, sh)


def split_rows(x: jax.Array, n_outer: int, n_inner: int) -> jax.Array:
    """[B, ...] -> [n_outer, n_inner, B / (n_outer n_inner), ...]: `split_strided` into n_outer x n_inner pieces,
    piece (o, i) = strided piece o + n_outer i, so every piece is spread over all the data devices."""
    pieces = split_strided(x, n_outer * n_inner)
    y = pieces.reshape(n_inner, n_outer, *pieces.shape[1:]).swapaxes(0, 1)
    return constrain(y, (None, None, "batch", *[None] * (x.ndim - 1)))


@functools.lru_cache(maxsize=4)
def _build(mcfg: ModelConfig, cc: ComputeConfig, rl: RLConfig, sc: SamplingConfig, optim: OptimConfig, steps: int,
           micro_rows: int, mesh: Mesh, rules: tuple, pad_id: int, eos_id: int, lcfg: LoraConfig | None = None
           ) -> Programs:
    """Cached on the (frozen, hashable) config sections, so a resumed or repeated run in the same process
    reuses the compiled programs."""
    n_mb = rl.minibatches
    cc = cc.on_platform(mesh.devices.flat[0].platform)
    base_sh = named_shardings(mesh, M.param_axes(mcfg), M.abstract_params(mcfg), rules)
    if lcfg is None:
        optimizer = make_optimizer(optim, steps, rl.mu_iterations * n_mb)
        train_sh = param_sh = base_sh
        abstract_train = M.abstract_params(mcfg)
    else:
        # Each slot clipped on its own: one adapter's large gradient must not shrink another's update.
        optimizer = make_optimizer(optim, steps, rl.mu_iterations * n_mb, clip=L.clip_by_slot_norm(optim.clip_norm))
        abstract_train = L.abstract_lora(mcfg, lcfg)
        train_sh = named_shardings(mesh, L.lora_axes(mcfg, lcfg), abstract_train, rules)
        param_sh = {"base": base_sh, "lora": train_sh}
    opt_sh = opt_state_shardings(mesh, optimizer, train_sh, abstract_train)
    b1, b2 = batch_sharding(mesh, 1), batch_sharding(mesh, 2)
    rep = replicated(mesh)
    # The sampler's mesh: the same devices, regrouped to sampling.tensor (the gathered weights' layout).
    smesh = regroup(mesh, sc.tensor)
    gathered_sh = named_shardings(smesh, M.param_axes(mcfg), M.abstract_params(mcfg), RULES_GATHERED)
    compute_dt = M.compute_dtype(mcfg, cc)
    # Unrolled layers on a GPU sample from per-layer arrays (`model.unstack_layers`); TPU reads slices in place.
    unstack_sampler = mesh.devices.flat[0].platform in UNSTACKED_SAMPLER_PLATFORMS and not cc.scans(mcfg.n_layers)

    def base_of(params: M.Params) -> M.Params:
        return params if lcfg is None else params["base"]

    def trainable(params: M.Params) -> M.Params:
        """What the optimizer updates: every weight, or with lora the adapters alone."""
        return params if lcfg is None else params["lora"]

    def with_trainable(params: M.Params, t: M.Params) -> M.Params:
        return t if lcfg is None else {"base": params["base"], "lora": t}

    def adapter_of(params: M.Params, slot_B: jax.Array | None) -> M.Adapter | None:
        return None if lcfg is None or slot_B is None else L.adapter(params["lora"], slot_B, lcfg)

    def sampler_weights(params: M.Params) -> M.Params:
        """The weights as the sampler reads them: one compute-dtype copy made before the decode loop (norm scales
        keep their dtype: they are applied in fp32), laid out as trained or, with sampling.gather_weights, gathered
        over fsdp. Cast inside the loop, fp32 master weights were read whole and cast at every decode step."""
        sh, by_layer = (gathered_sh, smesh is not mesh) if sc.gather_weights else (base_sh, False)
        w = gather_for_sampling(params, compute_dt, sh, by_layer, not cc.scans(mcfg.n_layers))
        return M.unstack_layers(w) if unstack_sampler else w

    def onto_sampler_mesh(params: M.Params, prompt: jax.Array, valid: jax.Array, base_key: jax.Array,
                          step: jax.Array, slot: jax.Array | None) -> tuple[Any, ...]:
        """A regrouped sampler's inputs, moved onto its mesh (an op takes operands of one mesh): rows over its data
        axes, adapters laid out on it, keys replicated. The weights go by `sampler_weights`."""
        if smesh is mesh:
            return params, prompt, valid, base_key, step, slot
        put = jax.lax.with_sharding_constraint
        if lcfg is not None:
            lora_ssh = named_shardings(smesh, L.lora_axes(mcfg, lcfg), abstract_train, rules)
            params = {"base": params["base"], "lora": put(params["lora"], lora_ssh)}
        rows, rep_s = batch_sharding(smesh, 2), replicated(smesh)
        return (params, put(prompt, rows), put(valid, rows), put(base_key, rep_s), put(step, rep_s),
                None if slot is None else put(slot, batch_sharding(smesh, 1)))

    def sample_fn(temperature: float, top_k: int, top_p: float) -> Any:
        def fn(params: M.Params, prompt: jax.Array, valid: jax.Array, base_key: jax.Array, step: jax.Array,
               slot: jax.Array | None = None) -> Samples:
            params, prompt, valid, base_key, step, slot = onto_sampler_mesh(params, prompt, valid, base_key, step,
                                                                            slot)
            key = jax.random.fold_in(jax.random.fold_in(base_key, STEP_STREAM), step)
            return sample(sampler_weights(base_of(params)), mcfg, prompt, valid, key,
                          max_new_tokens=sc.max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature,
                          top_k=top_k, top_p=top_p, cc=cc, max_num_sequences=sc.max_num_sequences,
                          adapter=adapter_of(params, slot), continuous=sc.continuous_batching,
                          refill_rows=data_size(smesh))
        return fn

    def logprobs(params: M.Params, batch: Batch, with_adapter: bool = True) -> tuple[jax.Array, jax.Array]:
        adapter = adapter_of(params, batch.get("slot")) if with_adapter else None
        return M.completion_logprobs(base_of(params), mcfg, batch["prompt"], batch["prompt_valid"],
                                     batch["completion"], batch["mask"], sc.temperature, cc, adapter)

    def loss_fn(t: M.Params, p: M.Params, rows: Batch, norm: Norm) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The loss as a function of the trainable part `t` of the params `p` (so only it gets gradients)."""
        logp, entropy = logprobs(with_trainable(p, t), rows)
        mask = rows["mask"].astype(jnp.float32)
        loss, m = policy_loss(logp, rows["old_logp"], rows["adv"], mask, rl, ref_logp_BN=rows.get("ref_logp"),
                              prox_logp_BN=rows.get("prox_logp"), max_len=sc.max_new_tokens, norm=norm)
        m["entropy"] = jnp.sum(entropy * mask) / norm.tokens
        return loss, m

    def minibatch_grads(p: M.Params, micro: Batch) -> tuple[M.Params, dict[str, jax.Array]]:
        """Summed gradient and metrics of one minibatch, given as [n_micro, rows, ...] micro-batches."""
        n_micro = micro["mask"].shape[0]
        norm = Norm.of(micro["mask"].reshape(-1, micro["mask"].shape[-1]))  # the whole minibatch's counts
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        t = trainable(p)
        if n_micro == 1:
            (_, m), g = grad_fn(t, p, jax.tree.map(lambda x: x[0], micro), norm)
            return g, m

        acc_dt = jnp.dtype(cc.grad_accum_dtype)

        def accumulate(acc: Any, xs: Batch) -> tuple[Any, None]:
            (_, m), g = grad_fn(t, p, xs, norm)
            g = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: x.astype(acc_dt), g), train_sh)
            return jax.tree.map(jnp.add, acc, (g, m)), None

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, acc_dt), t)
        m0 = jax.eval_shape(lambda: grad_fn(t, p, jax.tree.map(lambda x: x[0], micro), norm)[0][1])
        acc0 = (jax.lax.with_sharding_constraint(zeros, train_sh), jax.tree.map(lambda s: jnp.zeros(s.shape), m0))
        (g, m), _ = jax.lax.scan(accumulate, acc0, micro)
        return jax.tree.map(lambda x, q: x.astype(q.dtype), g, t), m

    def update_fn(params: M.Params, opt_state: Any, batch: Batch, ref_logp: jax.Array | None) -> Any:
        rewards_BR = batch["rewards"]
        total_B = jnp.sum(rewards_BR, axis=1)
        adv_B = group_advantages(total_B, rl.group_size, normalize_std=rl.algo != "dr_grpo", eps=rl.adv_eps)
        rows: Batch = {k: batch[k] for k in ("prompt", "prompt_valid", "completion", "mask", "old_logp", "slot",
                                             PROX_KEY) if k in batch}
        rows["adv"] = adv_B
        if ref_logp is not None:
            rows["ref_logp"] = ref_logp
        B = adv_B.shape[0]
        n_micro = B // n_mb // micro_rows
        pieces = jax.tree.map(lambda x: split_rows(x, n_mb, n_micro), rows)  # [n_mb, n_micro, rows, ...]

        def optimizer_step(carry: tuple[M.Params, Any], micro: Batch) -> tuple[tuple[M.Params, Any], Any]:
            p, s = carry
            grads, m = minibatch_grads(p, micro)
            t = trainable(p)
            updates, s = optimizer.update(grads, s, t)
            m["grad_norm"] = optax.global_norm(grads)
            new_t = optax.apply_updates(t, updates)
            if lcfg is not None:  # an adapter no row of this minibatch used stays as it was
                new_t = L.keep_idle_slots(new_t, t, L.active_slots(micro["slot"], lcfg.slots))
            return (with_trainable(p, new_t), s), m

        def one_pass(carry: tuple[M.Params, Any], _: None) -> tuple[tuple[M.Params, Any], Any]:
            return jax.lax.scan(optimizer_step, carry, pieces)

        (params, opt_state), ms = jax.lax.scan(one_pass, (params, opt_state), None, length=rl.mu_iterations)
        metrics = {k: jnp.mean(v) for k, v in ms.items()}  # ms: [mu_iterations, minibatches]
        metrics["loss_first"] = jnp.mean(ms["loss"][0])  # the first pass (on-policy: ratio 1 at its first step)
        metrics["reward_mean"] = jnp.mean(total_B)
        metrics["reward_std"] = jnp.std(total_B)
        metrics["rewards_mean_R"] = jnp.mean(rewards_BR, axis=0)
        metrics["rewards_std_R"] = jnp.std(rewards_BR, axis=0)
        len_B = jnp.sum(batch["mask"], axis=1)
        metrics["completion_len"] = jnp.mean(len_B)
        metrics["tokens"] = jnp.sum(batch["mask"])
        return params, opt_state, metrics

    rollout_sh = {k: b2 for k in BATCH_KEYS} | ({"slot": b1} if lcfg is not None else {})  # the forward passes'
    batch_sh = rollout_sh | ({PROX_KEY: b2} if rl.lag_correction == "decoupled" else {})  # the update's
    sample_in = (param_sh, b2, b2, rep, rep) + ((b1,) if lcfg is not None else ())
    # Samples as a tree of shardings, not of arrays.
    sample_kw: dict[str, Any] = dict(in_shardings=sample_in, out_shardings=Samples(b2, b2, b2, rep))  # type: ignore[arg-type]
    samplers: dict[tuple[float, int, float], Any] = {}

    def sampler(temperature: float, top_k: int, top_p: float) -> Any:
        """The sample program at these settings (compiled once each; greedy ignores top_k and top_p)."""
        settings = (0.0, 0, 1.0) if temperature == 0 else (float(temperature), int(top_k), float(top_p))
        if settings not in samplers:
            fn = sample_fn(*settings)
            samplers[settings] = jax.jit(fn, **sample_kw) if smesh is mesh else MeshJit(smesh, fn, **sample_kw)
        return samplers[settings]

    sample_jit = sampler(sc.temperature, sc.top_k, sc.top_p)
    # The reference policy: the initial weights, which with lora are the base model alone (fresh adapters are 0).
    ref_jit = jax.jit(lambda p, b: logprobs(p, b, with_adapter=False)[0], in_shardings=(param_sh, rollout_sh),
                      out_shardings=b2)
    # With lora the frozen base is donated and passed through: its output aliases its input, nothing is copied.
    # decoupled: the proximal policy's log-probs (this step's weights before the update, adapters included)
    logprobs_jit = jax.jit(lambda p, b: logprobs(p, b)[0], in_shardings=(param_sh, rollout_sh), out_shardings=b2)
    update_jit = jax.jit(update_fn, in_shardings=(param_sh, opt_sh, batch_sh, b2 if rl.kl_beta > 0 else None),
                         out_shardings=(param_sh, opt_sh, rep), donate_argnums=(0, 1))

    def fresh_lora(key: jax.Array) -> M.Params:
        # Called only with lora (lcfg is not None).
        return L.init_lora(mcfg, lcfg, jax.random.fold_in(key, LORA_STREAM))  # type: ignore[arg-type]

    def fresh(key: jax.Array) -> M.Params:
        base = M.init_params(mcfg, jax.random.fold_in(key, INIT_STREAM))
        return base if lcfg is None else {"base": base, "lora": fresh_lora(key)}

    init_params = jax.jit(fresh, in_shardings=(rep,), out_shardings=param_sh)
    init_lora = None if lcfg is None else jax.jit(fresh_lora, in_shardings=(rep,), out_shardings=train_sh)
    init_opt = jax.jit(lambda p: optimizer.init(trainable(p)), in_shardings=(param_sh,), out_shardings=opt_sh)
    return Programs(mesh, param_sh, opt_sh, optimizer, init_params, init_opt, sample_jit, ref_jit, update_jit, lcfg,
                    init_lora, sampler, logprobs_jit)


def abstract_args(cfg: TrainConfig, programs: Programs, n_rewards: int) -> dict[str, tuple[Any, ...]]:
    """Arguments (ShapeDtypeStructs carrying shardings) of `programs.sample`, `.ref_logprobs` and `.update`, for
    lowering them without any real array, e.g. for a TPU topology on a CPU machine."""
    mcfg = cfg.model_cfg
    B, P, N = cfg.batch_size, cfg.prompt_len, cfg.sampling.max_new_tokens
    b2, rep = batch_sharding(programs.mesh, 2), replicated(programs.mesh)

    def sds(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    lcfg = programs.lora
    abstract = M.abstract_params(mcfg)
    train = abstract if lcfg is None else L.abstract_lora(mcfg, lcfg)
    if lcfg is not None:
        abstract = {"base": abstract, "lora": train}
    params = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), abstract, programs.param_sh)
    opt_shape = jax.eval_shape(programs.optimizer.init, train)
    opt = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), opt_shape, programs.opt_sh)
    batch = {
        "prompt": sds((B, P), jnp.int32, b2),
        "prompt_valid": sds((B, P), jnp.int32, b2),
        "completion": sds((B, N), jnp.int32, b2),
        "mask": sds((B, N), jnp.int32, b2),
        "old_logp": sds((B, N), jnp.float32, b2),
        "rewards": sds((B, n_rewards), jnp.float32, b2),
    }
    slot: tuple[jax.ShapeDtypeStruct, ...] = ()
    if lcfg is not None:
        batch["slot"] = sds((B,), jnp.int32, batch_sharding(programs.mesh, 1))
        slot = (batch["slot"],)
    rollout = dict(batch)  # what the forward passes take
    if cfg.rl.lag_correction == "decoupled":
        batch[PROX_KEY] = sds((B, N), jnp.float32, b2)
    ref = sds((B, N), jnp.float32, b2) if cfg.rl.kl_beta > 0 else None
    key = sds((2,), jnp.uint32, rep)
    return {
        "sample": (params, batch["prompt"], batch["prompt_valid"], key, sds((), jnp.int32, rep), *slot),
        "ref_logprobs": (params, rollout),
        "update": (params, opt, batch, ref),
    }

