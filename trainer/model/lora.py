"""LoRA adapters on the one decoder: a stack of adapter slots on frozen base weights, PEFT import/export, merging.

Layout. The adapters are a pytree of their own beside the base params, so gradients and optimizer state exist for
them alone. Per target, layer-stacked like the base weight it adapts (the layer scan slices both alike):

    weights["layers"][key] = {"a": [L, S, *in, r], "b": [L, S, r, *out]}   key: wq wk wv wo w_gate w_up w_down
    weights["lm_head"]     = {"a": [S, D, r],      "b": [S, r, V]}

for a base weight [L, *in, *out] (wq: in (D,), out (H, E); wo: in (H, E), out (D,)), S slots and rank r. Their
logical axes reuse the base weight's names for the in/out dims (so `sharding.RULES` shards them the same way) and
`lora_slots` / `lora_rank` (replicated) for the rest.

Slot selection. Row b uses slot slot_B[b]; -1 (any index outside [0, S)) is the base model alone. The model masks the
low-rank activations by one-hot(slot) x scale (`model.lora_delta`): dense matmuls, no gather.

Initialisation follows PEFT's default (init_lora_weights=True; peft v0.20.0 src/peft/tuners/lora/layer.py lines
328-339, `reset_lora_parameters`): `nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))` on the [r, in] weight,
which is U(-1/sqrt(in), 1/sqrt(in)) (gain sqrt(2 / (1 + 5)), bound gain x sqrt(3 / fan_in)), and B = 0, so a fresh
adapter is exactly the base model. scale = alpha / r, or alpha / sqrt(r) with rslora (layer.py lines 274-277).

PEFT format (what `PeftModel.save_pretrained` writes, peft v0.20.0):
- adapter_model.safetensors (utils/constants.py line 397) with metadata {"format": "pt"} (peft_model.py line 381);
- tensor names `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]: the PeftModel's
  `base_model` (LoraModel) wraps `model` (the *ForCausalLM), whose modules are `model.layers.{i}.self_attn.q_proj`,
  ..., `lm_head`; LoRA keeps the keys holding "lora_" (utils/save_and_load.py lines 167-173, bias "none") and drops
  the adapter name (`.default`, save_and_load.py lines 470-500). lora_A / lora_B are nn.Linear(in, r) / (r, out)
  (layer.py lines 259-260), hence the torch [out, in] shapes;
- adapter_config.json (constants.py line 398): LoraConfig's fields as JSON, sorted, indent 2 (config.py
  `save_pretrained`, lines 132-163), inference_mode true (peft_model.py line 401).
vLLM reads the same files: `PEFTHelper.from_dict` needs r, lora_alpha and target_modules and refuses modules_to_save
and use_dora (vllm/lora/peft_helper.py); `parse_fine_tuned_lora_name` strips `base_model.model.` and `.lora_A.weight`
/ `.lora_B.weight` (vllm/lora/utils.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainer.base.config import LoraConfig, ModelConfig
from trainer.model import decoder as M
from trainer.model import hf
from trainer.model.tensors import read_safetensors, write_safetensors

Params = M.Params
f32 = jnp.float32
HEAD = "lm_head"
# Hugging Face module name -> the base weight it adapts.
TARGET_KEYS: dict[str, str] = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                               "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_N_IN = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}  # leading dims that are inputs
# key -> module path under model.layers.{i}. (hf's names, less ".weight")
_MODULES = {key: suffix.removesuffix(".weight") for key, suffix in hf._LAYER_NAMES if key in _N_IN}
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _layer_keys(lcfg: LoraConfig) -> list[str]:
    return [TARGET_KEYS[t] for t in lcfg.targets if t != HEAD]


def lora_shapes(cfg: ModelConfig, lcfg: LoraConfig) -> Params:
    base = M.param_shapes(cfg)["layers"]
    S, r = lcfg.slots, lcfg.rank
    out: Params = {}
    layers = {}
    for key in _layer_keys(lcfg):
        L, *dims = base[key]
        n = _N_IN[key]
        layers[key] = {"a": (L, S, *dims[:n], r), "b": (L, S, r, *dims[n:])}
    if layers:
        out["layers"] = layers
    if HEAD in lcfg.targets:
        out[HEAD] = {"a": (S, cfg.d_model, r), "b": (S, r, cfg.vocab_size)}
    return out


def lora_axes(cfg: ModelConfig, lcfg: LoraConfig) -> Params:
    """Logical axes: the base weight's names for the in/out dims, so the rule table shards an adapter like it."""
    base = M.param_axes(cfg)["layers"]
    out: Params = {}
    layers = {}
    for key in _layer_keys(lcfg):
        layer_axis, *dims = base[key]
        n = _N_IN[key]
        layers[key] = {"a": (layer_axis, "lora_slots", *dims[:n], "lora_rank"),
                       "b": (layer_axis, "lora_slots", "lora_rank", *dims[n:])}
    if layers:
        out["layers"] = layers
    if HEAD in lcfg.targets:
        out[HEAD] = {"a": ("lora_slots", "embed", "lora_rank"), "b": ("lora_slots", "lora_rank", "vocab")}
    return out


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def abstract_lora(cfg: ModelConfig, lcfg: LoraConfig) -> Params:
    dt = M.dtype_of(cfg)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dt), lora_shapes(cfg, lcfg), is_leaf=_is_shape)


def _slot_axis(path: tuple[Any, ...]) -> int:
    """Where the slot dim sits in a leaf: after the layer dim under "layers", first for lm_head."""
    return 1 if getattr(path[0], "key", None) == "layers" else 0


def init_lora(cfg: ModelConfig, lcfg: LoraConfig, key: jax.Array) -> Params:
    """Every slot a fresh adapter as PEFT makes one: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform, a=sqrt(5)),
    B = 0 (see the module docstring)."""
    dt = M.dtype_of(cfg)
    shapes = lora_shapes(cfg, lcfg)
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(shapes, is_leaf=_is_shape)]
    keys = iter(jax.random.split(key, max(len(paths), 1)))

    def one(path: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
        if path[-1].key == "b":
            return jnp.zeros(shape, dt)
        fan_in = math.prod(shape[_slot_axis(path) + 1:-1])
        bound = fan_in**-0.5
        return jax.random.uniform(next(keys), shape, f32, -bound, bound).astype(dt)

    return jax.tree_util.tree_map_with_path(one, shapes, is_leaf=_is_shape)


def gate(slot_B: jax.Array, lcfg: LoraConfig) -> jax.Array:
    """[B, S]: one-hot of each row's slot times the scale; a row with slot -1 (or any index outside the stack) is all
    zero, the base model."""
    return jax.nn.one_hot(slot_B, lcfg.slots, dtype=f32) * lcfg.scale


def adapter(weights: Params, slot_B: jax.Array, lcfg: LoraConfig) -> M.Adapter:
    return M.Adapter(weights, gate(slot_B, lcfg))


# ---------------------------------------------------------------------------------------------- per-slot training


def _per_slot(tree: Params, fn: Any) -> list[jax.Array]:
    return [fn(x, _slot_axis(p)) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def slot_norms(tree: Params) -> jax.Array:
    """[S]: the global norm of each slot's part of an adapter-shaped tree."""
    def sq(x: jax.Array, axis: int) -> jax.Array:
        return jnp.sum(jnp.square(x.astype(f32)), axis=tuple(i for i in range(x.ndim) if i != axis))

    return jnp.sqrt(sum(_per_slot(tree, sq)))


def _along_slots(v_S: jax.Array, x: jax.Array, axis: int) -> jax.Array:
    return v_S.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))


def clip_by_slot_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm for each slot on its own: one user's large gradient does not shrink another's
    update (with one slot it is the global-norm clip)."""

    def update(updates: Params, state: optax.EmptyState, params: Params | None = None) -> tuple[Params, Any]:
        del params
        norm_S = slot_norms(updates)
        factor_S = jnp.where(norm_S < max_norm, 1.0, max_norm / jnp.maximum(norm_S, 1e-30))
        out = jax.tree_util.tree_map_with_path(
            lambda p, x: x * _along_slots(factor_S, x, _slot_axis(p)).astype(x.dtype), updates)
        return out, state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def keep_idle_slots(new: Params, old: Params, active_S: jax.Array) -> Params:
    """`new` for the slots some row used, `old` for the rest: an adapter no row trained is left as it was (Adam's
    momentum and weight decay would otherwise move it)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, n, o: jnp.where(_along_slots(active_S, n, _slot_axis(p)), n, o), new, old)


def active_slots(slot_B: jax.Array, slots: int) -> jax.Array:
    return jnp.any(jax.nn.one_hot(slot_B.reshape(-1), slots, dtype=jnp.bool_), axis=0)


# ---------------------------------------------------------------------------------------------- merge


def merge(params: Params, weights: Params, cfg: ModelConfig, lcfg: LoraConfig, slot: int = 0) -> Params:
    """Base params with one slot merged in: W + scale x A B, computed in float32 and stored in W's dtype (PEFT's
    merge adds get_delta_weight = (B A) x scaling the same way; layer.py lines 1000-1030)."""
    out = dict(params)
    layers = dict(params["layers"])
    for key, ab in weights.get("layers", {}).items():
        w = params["layers"][key]
        a = jnp.asarray(ab["a"])[:, slot].astype(f32)
        b = jnp.asarray(ab["b"])[:, slot].astype(f32)
        L, r = a.shape[0], a.shape[-1]
        delta = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r), b.reshape(L, r, -1)).reshape(w.shape)
        layers[key] = (jnp.asarray(w).astype(f32) + lcfg.scale * delta).astype(w.dtype)
    out["layers"] = layers
    if HEAD in weights:
        if cfg.tie_embeddings:
            raise ValueError("an lm_head adapter cannot be merged into tied embeddings (the merged head would change "
                             "the input embedding too); export the adapter in PEFT format instead")
        a, b = (jnp.asarray(weights[HEAD][k])[slot].astype(f32) for k in ("a", "b"))
        w = params["lm_head"]
        out["lm_head"] = (jnp.asarray(w).astype(f32) + lcfg.scale * (a @ b)).astype(w.dtype)
    return out


def export_merged(params: Params, weights: Params, cfg: ModelConfig, lcfg: LoraConfig, out_dir: str | Path, *,
                  slot: int = 0, source_dir: str | Path | None = None,
                  base_config: Mapping[str, Any] | None = None) -> Path:
    """One slot merged into the base weights, written as a full Hugging Face checkpoint (hf.export_hf)."""
    merged = jax.device_get(jax.jit(merge, static_argnums=(2, 3))(params, weights, cfg, lcfg, slot))
    return hf.export_hf(merged, cfg, out_dir, source_dir=source_dir, base_config=base_config)


# ---------------------------------------------------------------------------------------------- PEFT format


def _module_name(key: str, layer: int | None) -> str:
    if key == HEAD:
        return f"{PEFT_PREFIX}{HEAD}"
    return f"{PEFT_PREFIX}model.layers.{layer}.{_MODULES[key]}"


def peft_tensors(weights: Params, slot: int = 0) -> dict[str, np.ndarray]:
    """One slot's tensors under PEFT's names, in torch Linear layout: lora_A.weight [r, in], lora_B.weight [out, r]."""
    out: dict[str, np.ndarray] = {}
    for key, ab in weights.get("layers", {}).items():
        a, b = np.asarray(ab["a"])[:, slot], np.asarray(ab["b"])[:, slot]  # [L, *in, r], [L, r, *out]
        r = a.shape[-1]
        for i in range(a.shape[0]):
            name = _module_name(key, i)
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    if HEAD in weights:
        name = _module_name(HEAD, None)
        out[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(weights[HEAD]["a"])[slot].T)
        out[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(weights[HEAD]["b"])[slot].T)
    return out


def peft_config(lcfg: LoraConfig, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """adapter_config.json: the LoraConfig fields (peft v0.20.0 tuners/lora/config.py, PeftConfig in config.py) that
    say what this adapter is; PEFT fills the rest with its defaults and vLLM ignores them."""
    alpha: float | int = int(lcfg.alpha) if float(lcfg.alpha).is_integer() else lcfg.alpha
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": lcfg.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(lcfg.targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": lcfg.rslora,
    }


def export_peft(weights: Params, lcfg: LoraConfig, out_dir: str | Path, *, slot: int = 0,
                base_model_name_or_path: str | None = None) -> Path:
    """Write one slot as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), loadable with
    `PeftModel.from_pretrained(base, out_dir)` and by vLLM's LoRA loader. `weights` must be host-readable (on one
    process, or gathered)."""
    if not 0 <= slot < lcfg.slots:
        raise ValueError(f"slot {slot} is not in the stack of {lcfg.slots}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / ADAPTER_WEIGHTS, peft_tensors(weights, slot), {"format": "pt"})
    text = json.dumps(peft_config(lcfg, base_model_name_or_path), indent=2, sort_keys=True)
    (out / ADAPTER_CONFIG).write_text(text + "\n")
    return out


def _config_from_peft(data: Mapping[str, Any], where: Path) -> LoraConfig:
    def refuse(why: str) -> ValueError:
        return ValueError(f"{where}: unsupported PEFT adapter: {why}")

    if data.get("peft_type") != "LORA":
        raise refuse(f"peft_type {data.get('peft_type')!r} (only LORA)")
    for key, ok in (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False)):
        if data.get(key, ok) != ok:
            raise refuse(f"{key}={data[key]!r} (only {ok!r})")
    for key in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern", "target_parameters"):
        if data.get(key):
            raise refuse(f"{key} is set")
    targets = data.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise refuse(f"target_modules {targets!r} (a list of module names is supported, not a pattern)")
    unknown = sorted(set(targets) - {*TARGET_KEYS, HEAD})
    if unknown:
        raise refuse(f"target_modules {unknown} (supported: {', '.join([*TARGET_KEYS, HEAD])})")
    return LoraConfig(rank=int(data["r"]), alpha=float(data["lora_alpha"]), targets=tuple(sorted(targets)),
                      rslora=bool(data.get("use_rslora", False)), slots=1)


def import_peft(path: str | Path, cfg: ModelConfig) -> tuple[Params, LoraConfig]:
    """A PEFT LoRA adapter directory as a one-slot stack (NumPy) and its LoraConfig; checked against `cfg` (every
    tensor the config implies, with its shape, and nothing else)."""
    root = Path(path)
    data = json.loads((root / ADAPTER_CONFIG).read_text())
    lcfg = _config_from_peft(data, root / ADAPTER_CONFIG)
    return adapter_from_tensors(read_safetensors(root / ADAPTER_WEIGHTS), cfg, lcfg, root / ADAPTER_WEIGHTS), lcfg


def adapter_from_tensors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, lcfg: LoraConfig,
                         where: str | Path = "adapter") -> Params:
    """Tensors under PEFT's names (`peft_tensors`' inverse) as a one-slot stack, checked against cfg and lcfg."""
    shapes = lora_shapes(cfg, lcfg.model_copy(update={"slots": 1}))
    expected: dict[str, tuple[int, ...]] = {}
    for key, ab in shapes.get("layers", {}).items():
        L, _, *rest = ab["a"]
        n_in, n_out, r = math.prod(rest[:-1]), math.prod(ab["b"][3:]), lcfg.rank
        for i in range(L):
            expected[f"{_module_name(key, i)}.lora_A.weight"] = (r, n_in)
            expected[f"{_module_name(key, i)}.lora_B.weight"] = (n_out, r)
    if HEAD in shapes:
        expected[f"{_module_name(HEAD, None)}.lora_A.weight"] = (lcfg.rank, cfg.d_model)
        expected[f"{_module_name(HEAD, None)}.lora_B.weight"] = (cfg.vocab_size, lcfg.rank)
    # each looked up once: a lazily read file (trainer/model/hf.py) reads at each lookup
    got: dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{where}: no tensor {name!r}")
        got[name] = tensors[name]
        if tuple(got[name].shape) != shape:
            raise ValueError(f"{where}: {name!r} has shape {tuple(got[name].shape)}, the model "
                             f"and adapter_config.json imply {shape}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{where}: tensors this model has no place for: {extra[:5]}")

    weights: Params = {}
    layers = {}
    for key, ab in shapes.get("layers", {}).items():
        L = ab["a"][0]
        a = np.stack([got[f"{_module_name(key, i)}.lora_A.weight"].T for i in range(L)])
        b = np.stack([got[f"{_module_name(key, i)}.lora_B.weight"].T for i in range(L)])
        layers[key] = {"a": a.reshape(ab["a"]), "b": b.reshape(ab["b"])}
    if layers:
        weights["layers"] = layers
    if HEAD in shapes:
        weights[HEAD] = {"a": np.asarray(got[f"{_module_name(HEAD, None)}.lora_A.weight"]).T[None],
                         "b": np.asarray(got[f"{_module_name(HEAD, None)}.lora_B.weight"]).T[None]}
    return weights


def put_slot(stack: Params, lcfg: LoraConfig, slot: int | jax.Array, single: Params, single_cfg: LoraConfig) -> Params:
    """`stack` with slot `slot` replaced by the one-slot adapter `single` (e.g. from import_peft).

    `single` may have a lower rank (zero-padded: the update is the same) and a subset of the stack's targets (the others
    are zero in that slot); a different scale is folded into its B. Same rank and scale: an exact copy. `slot` may be
    traced (one compiled program for every slot); a Python int is range-checked here.
    """
    if isinstance(slot, int) and not 0 <= slot < lcfg.slots:
        raise ValueError(f"slot {slot} is not in the stack of {lcfg.slots}")
    extra = sorted(set(single_cfg.targets) - set(lcfg.targets))
    if extra:
        raise ValueError(f"the adapter targets {extra}, which the stack (lora.targets) lacks")
    if single_cfg.rank > lcfg.rank:
        raise ValueError(f"the adapter's rank {single_cfg.rank} exceeds the stack's {lcfg.rank}")
    ratio = single_cfg.scale / lcfg.scale
    pad = lcfg.rank - single_cfg.rank

    def place(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        names = [getattr(k, "key", None) for k in path]
        node: Any = single
        for n in names:
            node = node.get(n) if isinstance(node, Mapping) else None
        axis = _slot_axis(path)
        if node is None:  # a target this adapter does not have
            return _set_slot(x, axis, slot, jnp.zeros(x.shape[:axis] + x.shape[axis + 1:], x.dtype))
        new = jnp.take(jnp.asarray(node), 0, axis=axis)
        if names[-1] == "a":
            new = jnp.pad(new, [(0, 0)] * (new.ndim - 1) + [(0, pad)])
        else:
            rank_axis = axis  # b: [(L,) r, *out] once the slot dim is gone
            new = jnp.pad(new, [(0, pad) if i == rank_axis else (0, 0) for i in range(new.ndim)])
            if ratio != 1.0:
                new = (new.astype(f32) * ratio).astype(new.dtype)
        return _set_slot(x, axis, slot, new.astype(x.dtype))

    return jax.tree_util.tree_map_with_path(place, stack)


def _set_slot(x: jax.Array, axis: int, slot: int | jax.Array, value: jax.Array) -> jax.Array:
    index = (slice(None),) * axis + (slot,)
    return jnp.asarray(x).at[index].set(value)

