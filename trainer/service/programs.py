"""The engine's jitted programs: the trainer's model, sharding rules and sampler on a stack of LoRA slots.

One base model (frozen, sharded by `sharding.RULES`) carries `lora.slots` adapters (trainer/model/lora.py layout, every
target, rank `lora.rank`, float32). A client's model holds one slot; its own rank r <= lora.rank lives in the first r
columns (the rest stay exactly zero: zero A columns and B rows get zero gradients and zero Adam updates) and its own
targets (train_attn / train_mlp / train_unembed) likewise. Each slot has its own scale (alpha / r), so a batch row
gates its slot with one_hot(slot) x scale[slot]; -1 is the base model alone.

Programs (all with explicit shardings, inputs placed by `put`, so they run the same on one host or many):
  logprobs_and_loss  forward only: target log-probs [B, T] and each row's Tinker loss (service/losses.py)
  forward_backward   the same, and the adapters' gradient added into the per-slot accumulator
  optim_step         AdamW on one slot (torch's AdamW with Tinker's AdamParams), its accumulator zeroed
  put_slot/take_slot write a one-slot adapter into the stack / read one slot out (for saving)
  sample             trainer.rl.sampler.sample with each row's slot
`fit` lowers the same programs for a TPU topology (`abstract_args`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from trainer.base.config import LoraConfig, ModelConfig, TrainConfig, lora_alpha
from trainer.model import decoder as M
from trainer.model import lora as L
from trainer.model.sharding import (
    RULES,
    RULES_ACROSS_SLICES,
    MeshJit,
    batch_sharding,
    data_size,
    named_shardings,
    replicated,
)
from trainer.rl.sampler import RowSettings, Samples, sample
from trainer.service.losses import LossInputs, tinker_losses
from trainer.service.shapes import rows, stack_config

f32 = jnp.float32
@dataclass(frozen=True)
class AdamHyper:
    """Tinker's AdamParams as the program's traced scalars (so a new learning rate does not recompile)."""

    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float

    def array(self) -> np.ndarray:
        return np.array([self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay,
                         self.grad_clip_norm], np.float32)


@dataclass(frozen=True)
class EnginePrograms:
    mesh: Mesh
    mcfg: ModelConfig
    stack: LoraConfig
    param_sh: Any
    lora_sh: Any
    data_parallel: int  # rows of a batch must be a multiple of this (they shard over the data axes)
    logprobs_and_loss: Any
    forward_backward: Any
    optim_step: Any
    put_slot: Any
    take_slot: Any
    sample: Any
    prompt_topk: Any

    def put(self, value: np.ndarray | np.generic, *, batch: bool = False) -> jax.Array:
        """A host array as a global array: rows over the data axes (batch) or replicated. Every process passes the
        same value (process 0's work, broadcast)."""
        arr = np.asarray(value)
        sh = batch_sharding(self.mesh, arr.ndim) if batch else replicated(self.mesh)
        return jax.make_array_from_callback(arr.shape, sh, lambda idx: arr[idx])

    def rows(self, n: int) -> int:
        """The row bucket for n rows (shapes.rows on this mesh)."""
        return rows(n, self.data_parallel)

    def zeros_like_stack(self) -> Any:
        shapes = L.lora_shapes(self.mcfg, self.stack)
        return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s, f32), shapes, is_leaf=L._is_shape),
                       out_shardings=self.lora_sh)()


def _gate(slot_B: jax.Array, scale_S: jax.Array) -> jax.Array:
    return jax.nn.one_hot(slot_B, scale_S.shape[0], dtype=f32) * scale_S[None, :]


def build(cfg: TrainConfig, mesh: Mesh) -> EnginePrograms:
    """The programs for a resolved service config (mesh axes known) on `mesh`."""
    rules = RULES_ACROSS_SLICES if cfg.mesh.fsdp_across_slices else RULES
    cc = cfg.compute.on_platform(mesh.devices.flat[0].platform)  # `auto` kernels, as the trainer resolves them
    return _build(cfg.model_cfg, cc, stack_config(cfg), mesh, tuple(rules))


@functools.lru_cache(maxsize=8)
def _build(mcfg: ModelConfig, cc: Any, stack: LoraConfig, mesh: Mesh, rules: tuple[Any, ...]) -> EnginePrograms:
    param_sh = named_shardings(mesh, M.param_axes(mcfg), M.abstract_params(mcfg), rules)
    lora_abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, f32), L.lora_shapes(mcfg, stack),
                                 is_leaf=L._is_shape)
    lora_sh = named_shardings(mesh, L.lora_axes(mcfg, stack), lora_abstract, rules)
    rep = replicated(mesh)
    b1, b2 = batch_sharding(mesh, 1), batch_sharding(mesh, 2)
    # LossInputs, RowSettings and Samples below as trees of shardings (their fields are typed as the arrays).
    inputs_sh = LossInputs(loss_id=b1, mask=b2, weights=b2, sampling_logprobs=b2, advantages=b2, ratio_mask=b2,  # type: ignore[arg-type]
                           clip_low=b2, clip_high=b2, beta=b1)  # type: ignore[arg-type]
    data_parallel = data_size(mesh)

    def logp(params: Any, lora: Any, scale_S: jax.Array, tokens_BT: jax.Array, slot_B: jax.Array,
             targets_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
        adapter = M.Adapter(lora, _gate(slot_B, scale_S))
        x, _ = M.forward(params, mcfg, tokens_BT, mask_BT != 0, cc=cc, adapter=adapter)
        out, _ = M.chunked_logprobs(params, mcfg, x, targets_BT, 1.0, cc.logprob_chunk, adapter)
        return out

    def loss(lora: Any, params: Any, scale_S: jax.Array, tokens_BT: jax.Array, slot_B: jax.Array,
             targets_BT: jax.Array, inputs: LossInputs) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        out = tinker_losses(logp(params, lora, scale_S, tokens_BT, slot_B, targets_BT, inputs.mask), inputs)
        return out.total, (out.logprobs, out.row_loss)

    def logprobs_and_loss(params: Any, lora: Any, scale_S: jax.Array, tokens_BT: jax.Array, slot_B: jax.Array,
                          targets_BT: jax.Array, inputs: LossInputs) -> tuple[jax.Array, jax.Array]:
        return loss(lora, params, scale_S, tokens_BT, slot_B, targets_BT, inputs)[1]

    def forward_backward(params: Any, lora: Any, grads: Any, scale_S: jax.Array, tokens_BT: jax.Array,
                         slot_B: jax.Array, targets_BT: jax.Array, inputs: LossInputs
                         ) -> tuple[Any, jax.Array, jax.Array]:
        # Tinker sums: the gradient of the summed loss is added, never averaged (service/losses.py docstring).
        (_, (lp, row_loss)), g = jax.value_and_grad(loss, has_aux=True)(
            lora, params, scale_S, tokens_BT, slot_B, targets_BT, inputs)
        return jax.tree.map(lambda a, b: a + b.astype(f32), grads, g), lp, row_loss

    def optim_step(lora: Any, m: Any, v: Any, grads: Any, slot: jax.Array, t: jax.Array, hyper: jax.Array
                   ) -> tuple[Any, Any, Any, Any, jax.Array]:
        """torch.optim.AdamW on slot `slot` at step t (1-based): grad clipping to grad_clip_norm (0: off) over the
        slot's global norm, p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps). Other slots are untouched."""
        lr, beta1, beta2, eps, wd, clip = (hyper[i] for i in range(6))
        sel_S = jax.nn.one_hot(slot, stack.slots, dtype=jnp.bool_)
        norm = L.slot_norms(grads)[slot]
        factor = jnp.where((clip > 0) & (norm > clip), clip / jnp.maximum(norm, 1e-30), 1.0)
        tf = t.astype(f32)

        def one(path: Any, p: jax.Array, m1: jax.Array, v1: jax.Array, g: jax.Array) -> tuple[jax.Array, ...]:
            sel = L._along_slots(sel_S, p, L._slot_axis(path))
            gc = g * factor
            m2 = beta1 * m1 + (1 - beta1) * gc
            v2 = beta2 * v1 + (1 - beta2) * gc * gc
            m_hat = m2 / (1 - beta1**tf)
            v_hat = v2 / (1 - beta2**tf)
            p2 = p * (1 - lr * wd) - lr * m_hat / (jnp.sqrt(v_hat) + eps)
            return (jnp.where(sel, p2, p), jnp.where(sel, m2, m1), jnp.where(sel, v2, v1),
                    jnp.where(sel, 0.0, g))

        out = jax.tree_util.tree_map_with_path(one, lora, m, v, grads)
        is_out = lambda x: isinstance(x, tuple) and len(x) == 4 and all(isinstance(a, jax.Array) for a in x)  # noqa: E731
        pick = [jax.tree.map(lambda x, i=i: x[i], out, is_leaf=is_out) for i in range(4)]
        return (*pick, norm)

    def take_slot(tree: Any, slot: jax.Array) -> Any:
        return jax.tree_util.tree_map_with_path(lambda p, x: jnp.take(x, slot, axis=L._slot_axis(p)), tree)

    def sample_rows(params: Any, lora: Any, scale_S: jax.Array, prompt_BP: jax.Array, valid_BP: jax.Array,
                    slot_B: jax.Array, key: jax.Array, per_row: RowSettings, max_new_tokens: int, pad_id: int,
                    chunk: int) -> Samples:
        """Only the shapes are static (the token bucket, the batch chunk): every user's settings are data."""
        return sample(params, mcfg, prompt_BP, valid_BP, key, max_new_tokens=max_new_tokens, eos_id=(), pad_id=pad_id,
                      cc=cc, max_num_sequences=chunk, adapter=M.Adapter(lora, _gate(slot_B, scale_S)),
                      per_row=per_row)

    def prompt_topk(params: Any, lora: Any, scale_S: jax.Array, tokens_BT: jax.Array, slot_B: jax.Array,
                    valid_BT: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """The k likeliest next tokens after each position and their log-probs: [B, T, k] ids and float32."""
        adapter = M.Adapter(lora, _gate(slot_B, scale_S))
        x, _ = M.forward(params, mcfg, tokens_BT, valid_BT, cc=cc, adapter=adapter)
        logp = jax.nn.log_softmax(M.logits(params, mcfg, x, adapter), axis=-1)
        values, ids = jax.lax.top_k(logp, k)
        return ids.astype(jnp.int32), values

    batch_in = (param_sh, lora_sh, rep, b2, b1, b2, inputs_sh)
    jit = functools.partial(MeshJit, mesh)
    return EnginePrograms(
        mesh=mesh, mcfg=mcfg, stack=stack, param_sh=param_sh, lora_sh=lora_sh, data_parallel=data_parallel,
        logprobs_and_loss=jit(logprobs_and_loss, in_shardings=batch_in, out_shardings=(rep, rep)),
        forward_backward=jit(forward_backward, in_shardings=(param_sh, lora_sh, lora_sh, *batch_in[2:]),
                                 out_shardings=(lora_sh, rep, rep), donate_argnums=(2,)),
        optim_step=jit(optim_step, in_shardings=(lora_sh, lora_sh, lora_sh, lora_sh, rep, rep, rep),
                           out_shardings=(lora_sh, lora_sh, lora_sh, lora_sh, rep), donate_argnums=(0, 1, 2, 3)),
        put_slot=jit(L.put_slot, static_argnums=(1, 4), donate_argnums=(0,), out_shardings=lora_sh),
        take_slot=jit(take_slot, out_shardings=rep),
        sample=jit(sample_rows, in_shardings=(param_sh, lora_sh, rep, b2, b2, b1, rep, RowSettings(b1, b1, b1, b2, b1)),  # type: ignore[arg-type]
                   out_shardings=Samples(rep, rep, rep, rep), static_argnums=(8, 9, 10)),  # type: ignore[arg-type]
        prompt_topk=jit(prompt_topk, in_shardings=(param_sh, lora_sh, rep, b2, b1, b2), out_shardings=(rep, rep),
                        static_argnums=(6,)),
    )


def slot_config(stack: LoraConfig, scale: float) -> LoraConfig:
    """The stack's config with the scale of one slot (put_slot folds any scale difference into B; a slot written with
    its own scale is copied exactly)."""
    return stack.model_copy(update={"alpha": lora_alpha(scale, stack.rank, stack.rslora)})


def single_adapter(slot_tree: Any, rank: int, targets: Sequence[str]) -> Any:
    """A slot read out by take_slot (no slot dim) as a one-slot adapter of its own rank and targets (numpy)."""
    keys = {L.TARGET_KEYS[t] for t in targets if t != L.HEAD}
    out: dict[str, Any] = {}
    layers = {k: {"a": np.asarray(ab["a"])[:, None, ..., :rank], "b": np.asarray(ab["b"])[:, None, :rank]}
              for k, ab in slot_tree.get("layers", {}).items() if k in keys}
    if layers:
        out["layers"] = layers
    if L.HEAD in targets and L.HEAD in slot_tree:
        out[L.HEAD] = {"a": np.asarray(slot_tree[L.HEAD]["a"])[None, ..., :rank],
                       "b": np.asarray(slot_tree[L.HEAD]["b"])[None, :rank]}
    return out


def abstract_args(progs: EnginePrograms, rows: int, length: int) -> dict[str, tuple[Any, ...]]:
    """ShapeDtypeStructs (with shardings) for lowering forward_backward and optim_step without arrays (fit)."""
    def sds(shape: tuple[int, ...], dtype: Any, sh: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    params = jax.tree.map(lambda a, sh: sds(a.shape, a.dtype, sh), M.abstract_params(progs.mcfg), progs.param_sh)
    lora = jax.tree.map(lambda s, sh: sds(s, f32, sh), L.lora_shapes(progs.mcfg, progs.stack), progs.lora_sh,
                        is_leaf=L._is_shape)
    rep = replicated(progs.mesh)
    b1, b2 = batch_sharding(progs.mesh, 1), batch_sharding(progs.mesh, 2)
    bt = (rows, length)
    # LossInputs as a tree of ShapeDtypeStructs (its fields are typed as the arrays).
    inputs = LossInputs(loss_id=sds((rows,), jnp.int32, b1), mask=sds(bt, f32, b2), weights=sds(bt, f32, b2),  # type: ignore[arg-type]
                        sampling_logprobs=sds(bt, f32, b2), advantages=sds(bt, f32, b2), ratio_mask=sds(bt, f32, b2),  # type: ignore[arg-type]
                        clip_low=sds(bt, f32, b2), clip_high=sds(bt, f32, b2), beta=sds((rows,), f32, b1))  # type: ignore[arg-type]
    scale = sds((progs.stack.slots,), f32, rep)
    fb = (params, lora, lora, scale, sds(bt, jnp.int32, b2), sds((rows,), jnp.int32, b1), sds(bt, jnp.int32, b2),
          inputs)
    opt = (lora, lora, lora, lora, sds((), jnp.int32, rep), sds((), jnp.int32, rep), sds((6,), f32, rep))
    return {"forward_backward": fb, "optim_step": opt}
