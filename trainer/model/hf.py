"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 checkpoints <-> the trainer's stacked parameter tree (NumPy, no torch).

Reads `config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json` from a local
directory (nothing is downloaded). The files are read lazily (trainer/model/tensors.py): opening one reads its header
only, so checking a 70B checkpoint reads no weight.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from trainer.base.config import ConfigError, ModelConfig
from trainer.model.tensors import LazyTensors, read_safetensors, write_safetensors

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


# ---------------------------------------------------------------------------------------------- checkpoint files


def read_checkpoint_tensors(path: str | Path) -> LazyTensors:
    """Tensors of a single-file or sharded (`model.safetensors.index.json`) checkpoint directory, lazily (see
    LazyTensors): only the headers are read."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{index}: not a safetensors index (no readable weight_map: {err!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: not a safetensors index (weight_map is not an object of file names)")
        tensors = LazyTensors({})
        for shard in sorted(set(weight_map.values())):
            tensors.update(read_safetensors(root / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index}: tensors listed but not found in the shards: {missing[:5]}")
        return tensors
    single = root / "model.safetensors"
    if single.is_file():
        return read_safetensors(single)
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {root}")


# ---------------------------------------------------------------------------------------------- config

# Per family: architecture name and the defaults transformers' config classes use for keys a config.json omits.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"arch": "LlamaForCausalLM", "max_position_embeddings": 2048},
    "mistral": {"arch": "MistralForCausalLM", "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"arch": "Qwen2ForCausalLM", "max_position_embeddings": 32768},
    "qwen3": {"arch": "Qwen3ForCausalLM", "max_position_embeddings": 32768, "head_dim": 128},
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_settings(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig's rope_* fields from either config layout.

    transformers < 4.56 writes `rope_theta` plus `rope_scaling` ({"rope_type" or "type", "factor", ...} or null);
    later versions write one `rope_parameters` dict that also holds `rope_theta`. As in transformers, a non-empty
    `rope_scaling` takes the place of `rope_parameters`, and the theta inside the dict wins over the top-level key.
    """
    rope: Mapping[str, Any] = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, Mapping) or any(isinstance(v, Mapping) for v in rope.values()):
        raise ValueError("unsupported rope_parameters: per-layer-type RoPE settings (nested dicts)")
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("unsupported partial_rotary_factor != 1 (the trainer rotates the whole head)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return out | {"rope_type": "default"}
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope scaling {rope_type!r}: the trainer implements default, linear and llama3")
    out |= {"rope_type": rope_type, "rope_factor": float(rope["factor"])}
    if rope_type == "llama3":
        # transformers falls back to max_position_embeddings when the original length is not given.
        original = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        out |= {
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_len": int(original or hf["max_position_embeddings"]),
        }
    return out


def _rope_scaling_dict(cfg: ModelConfig) -> dict[str, Any] | None:
    """HF rope scaling keys for cfg (without rope_theta), or None for plain RoPE."""
    if cfg.rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
    if cfg.rope_type == "llama3":
        out |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    return out


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, max_pos: int) -> None:
    """Refuse a sliding window that can bite within max_position_embeddings (the trainer attends causally to all)."""
    if model_type == "mistral":
        window = hf.get("sliding_window", _FAMILIES["mistral"]["sliding_window"])
        if window is not None and int(window) < max_pos:
            raise ValueError(
                f"unsupported config: sliding_window={window} < max_position_embeddings={max_pos} (Mistral "
                "sliding-window attention is not implemented; only configs with sliding_window null or >= "
                "max_position_embeddings import)"
            )
    elif model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        window = hf.get("sliding_window")
        n_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i >= int(hf.get("max_window_layers", 28)) else "full_attention"
            for i in range(n_layers)
        ]
        if window is not None and int(window) < max_pos and "sliding_attention" in layer_types:
            raise ValueError(
                f"unsupported config: use_sliding_window=true with sliding_window={window} < "
                f"max_position_embeddings={max_pos} (sliding-window attention is not implemented)"
            )


def model_config_from_hf(hf: Mapping[str, Any], param_dtype: str = "float32") -> ModelConfig:
    """Map a Hugging Face Llama / Mistral / Qwen2 / Qwen3 config.json onto ModelConfig; unsupported variants raise."""
    model_type = hf.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    defaults = _FAMILIES[model_type]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (SwiGLU with silu only)")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=true")
    if hf.get("attention_bias") and model_type in ("llama", "qwen3"):
        # Their attention_bias puts a bias on o_proj too; only q/k/v biases (Qwen2's layout) are implemented.
        raise ValueError(
            f"unsupported config: attention_bias=true ({model_type} then also has an o_proj bias, which the trainer "
            "does not implement; q/k/v biases alone, as in qwen2, are supported)"
        )
    n_heads = int(hf["num_attention_heads"])
    d_model = int(hf["hidden_size"])
    max_pos = int(hf.get("max_position_embeddings") or defaults["max_position_embeddings"])
    _check_sliding_window(hf, model_type, max_pos)
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or defaults.get("head_dim") or d_model // n_heads),
        d_ff=int(hf["intermediate_size"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=model_type == "qwen3",
        qkv_bias=model_type == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=param_dtype,
        max_seq_len=max_pos,
        family=model_type,
        **_rope_settings(dict(hf, max_position_embeddings=max_pos)),
    )


def model_family(cfg: ModelConfig) -> str:
    """The HF model_type cfg exports as: cfg.family, else qwen3 with QK-norm, qwen2 with q/k/v biases, else llama."""
    if cfg.family is not None:
        return cfg.family
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("no supported Hugging Face family has both QK-norm and q/k/v biases; cannot export")
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def hf_config_from_model(cfg: ModelConfig, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `cfg` as its family (see model_family); `base` keys are kept (eos ids...).

    RoPE settings follow base's layout (`rope_parameters` for transformers >= 4.56, else `rope_theta` +
    `rope_scaling`, which every transformers version reads); so does the dtype key (`dtype` / `torch_dtype`).
    """
    family = model_family(cfg)
    base = dict(base or {})
    out: dict[str, Any] = dict(base)
    for key in ("rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype"):
        out.pop(key, None)
    scaling = _rope_scaling_dict(cfg)
    if "rope_parameters" in base:
        out["rope_parameters"] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, **(scaling or {})}
    if "rope_parameters" not in base or "rope_theta" in base or "rope_scaling" in base:
        out["rope_theta"] = cfg.rope_theta
        out["rope_scaling"] = scaling
    dtype_keys = [k for k in ("dtype", "torch_dtype") if k in base] or ["dtype", "torch_dtype"]
    out.update(dict.fromkeys(dtype_keys, cfg.param_dtype))
    out.update(
        architectures=[_FAMILIES[family]["arch"]],
        model_type=family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
    )
    if family in ("llama", "qwen3"):
        out["attention_bias"] = False
    if family == "llama":
        out["mlp_bias"] = False
    if family in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
        out.setdefault("sliding_window", None)  # ignored while use_sliding_window is false
        if "layer_types" in out:
            out["layer_types"] = ["full_attention"] * cfg.n_layers
    if family == "mistral" and out.get("sliding_window") is not None and out["sliding_window"] < cfg.max_seq_len:
        out["sliding_window"] = None
    elif family == "mistral":
        out.setdefault("sliding_window", None)
    return out


# ---------------------------------------------------------------------------------------------- weights

# (our layer key, HF suffix under model.layers.{i}.)
_LAYER_NAMES: tuple[tuple[str, str], ...] = (
    ("attn_norm", "input_layernorm.weight"),
    ("wq", "self_attn.q_proj.weight"),
    ("wk", "self_attn.k_proj.weight"),
    ("wv", "self_attn.v_proj.weight"),
    ("bq", "self_attn.q_proj.bias"),
    ("bk", "self_attn.k_proj.bias"),
    ("bv", "self_attn.v_proj.bias"),
    ("wo", "self_attn.o_proj.weight"),
    ("q_norm", "self_attn.q_norm.weight"),
    ("k_norm", "self_attn.k_norm.weight"),
    ("mlp_norm", "post_attention_layernorm.weight"),
    ("w_gate", "mlp.gate_proj.weight"),
    ("w_up", "mlp.up_proj.weight"),
    ("w_down", "mlp.down_proj.weight"),
)


def _layer_keys(cfg: ModelConfig) -> list[tuple[str, str]]:
    skip: set[str] = set()
    if not cfg.qk_norm:
        skip |= {"q_norm", "k_norm"}
    if not cfg.qkv_bias:
        skip |= {"bq", "bk", "bv"}
    return [(k, s) for k, s in _LAYER_NAMES if k not in skip]


def _hf_shape(key: str, cfg: ModelConfig) -> tuple[int, ...]:
    d, dh, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    return {
        "attn_norm": (d,),
        "mlp_norm": (d,),
        "q_norm": (dh,),
        "k_norm": (dh,),
        "wq": (cfg.n_heads * dh, d),
        "wk": (cfg.n_kv_heads * dh, d),
        "wv": (cfg.n_kv_heads * dh, d),
        "bq": (cfg.n_heads * dh,),
        "bk": (cfg.n_kv_heads * dh,),
        "bv": (cfg.n_kv_heads * dh,),
        "wo": (d, cfg.n_heads * dh),
        "w_gate": (f, d),
        "w_up": (f, d),
        "w_down": (d, f),
    }[key]


def _from_hf(key: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One layer's HF tensor (torch Linear layout [out, in]) -> our per-layer layout."""
    d, dh = cfg.d_model, cfg.head_dim
    if key in ("wq", "wk", "wv"):
        heads = cfg.n_heads if key == "wq" else cfg.n_kv_heads
        return w.T.reshape(d, heads, dh)  # HF splits the out dim as (head, head_dim)
    if key in ("bq", "bk", "bv"):
        return w.reshape(-1, dh)
    if key == "wo":
        return w.T.reshape(cfg.n_heads, dh, d)
    if key in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def _to_hf(key: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    d, dh = cfg.d_model, cfg.head_dim
    if key in ("wq", "wk", "wv"):
        return w.reshape(d, -1).T
    if key in ("bq", "bk", "bv"):
        return w.reshape(-1)
    if key == "wo":
        return w.reshape(cfg.n_heads * dh, d).T
    if key in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # older Llama checkpoints store the RoPE table


def _read_config(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {root}")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_file}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(hf_cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object")
    return hf_cfg


def _validated(root: Path, param_dtype: str | None) -> tuple[ModelConfig, LazyTensors]:
    """The checkpoint's ModelConfig and its (lazily read) tensors, checked from config.json and the safetensors
    headers alone: every tensor the config implies is there with its shape, and nothing else is."""
    hf_cfg = _read_config(root)
    tensors = read_checkpoint_tensors(root)  # headers only: no weight is read here
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{root}: checkpoint has no tensor 'model.embed_tokens.weight'")
    if param_dtype is None:
        embed_dtype = tensors.lazy("model.embed_tokens.weight").dtype
        param_dtype = "bfloat16" if embed_dtype == ml_dtypes.bfloat16 else "float32"
    cfg = model_config_from_hf(hf_cfg, param_dtype)
    expected = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.d_model), "model.norm.weight": (cfg.d_model,)}
    expected.update({f"model.layers.{i}.{suffix}": _hf_shape(key, cfg)
                     for key, suffix in _layer_keys(cfg) for i in range(cfg.n_layers)})
    if not cfg.tie_embeddings:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{root}: checkpoint has no tensor {name!r}")
        if tensors.lazy(name).shape != shape:
            raise ValueError(f"{root}: tensor {name!r} has shape {tensors.lazy(name).shape}, config implies {shape}")
    # Some tied checkpoints still store lm_head.weight; the embedding wins.
    unexpected = sorted(n for n in set(tensors) - set(expected) - {"lm_head.weight"} if not _ignored(n))
    if unexpected:
        raise ValueError(
            f"{root}: unsupported tensors in checkpoint (biases the {cfg.family} layout lacks? another "
            f"architecture?): {unexpected[:8]}"
        )
    return cfg, tensors


# Read errors that say the storage failed, not that the checkpoint is wrong: a bucket mount answers a failed GCS call
# with EIO and a dead gcsfuse daemon with ENOTCONN. Worth a restart (the callers' exit 42), not a config error.
TRANSIENT_IO_ERRNOS = frozenset({errno.EIO, errno.ENOTCONN, errno.ETIMEDOUT, errno.ESTALE, errno.ECONNRESET,
                                 errno.ECONNABORTED, errno.EAGAIN, errno.EINTR, errno.ENETUNREACH,
                                 errno.EHOSTUNREACH})


def is_transient_io(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in TRANSIENT_IO_ERRNOS


@contextmanager
def init_path_errors(path: str | Path) -> Iterator[None]:
    """A missing, empty, truncated or mismatched checkpoint as a ConfigError naming init.path (no traceback); a
    storage failure (`is_transient_io`) propagates as it is."""
    try:
        yield
    except (OSError, ValueError, KeyError, TypeError) as err:
        if isinstance(err, ConfigError) or is_transient_io(err):
            raise
        msg = f"{path}: missing field {err}" if isinstance(err, KeyError) else str(err)
        raise ConfigError(f"init.path: {msg}") from None


def check_hf(path: str | Path, param_dtype: str | None = None) -> ModelConfig:
    """The ModelConfig `import_hf` would return, checked without reading a weight, so a bad checkpoint fails before
    any device is used. Raises ConfigError naming init.path."""
    with init_path_errors(path):
        return _validated(Path(path), param_dtype)[0]


def import_hf(path: str | Path, param_dtype: str | None = None) -> tuple[dict[str, Any], ModelConfig]:
    """Load a local Llama / Mistral / Qwen2 / Qwen3 checkpoint: the trainer's param tree (NumPy) and ModelConfig.

    `param_dtype` None keeps bf16 checkpoints in bf16 and loads everything else as float32.
    """
    cfg, tensors = _validated(Path(path), param_dtype)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(np.float32)

    def stacked(key: str, suffix: str) -> np.ndarray:
        # Filled layer by layer: besides the result, one layer's tensor is in memory at a time (np.stack of a list
        # would hold every layer twice).
        first = _from_hf(key, tensors[f"model.layers.0.{suffix}"], cfg)
        out = np.empty((cfg.n_layers, *first.shape), dtype)
        out[0] = first
        for i in range(1, cfg.n_layers):
            out[i] = _from_hf(key, tensors[f"model.layers.{i}.{suffix}"], cfg)
        return out

    # Each lookup reads that tensor from disk (a fresh array), so asarray converts it without another copy.
    params: dict[str, Any] = {"embed": np.asarray(tensors["model.embed_tokens.weight"], dtype)}
    params["layers"] = {key: stacked(key, suffix) for key, suffix in _layer_keys(cfg)}
    params["final_norm"] = np.asarray(tensors["model.norm.weight"], dtype)
    if not cfg.tie_embeddings:
        params["lm_head"] = np.asarray(tensors["lm_head.weight"].T, dtype)
    return params, cfg


def params_to_hf_tensors(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of import_hf's weight mapping: HF tensor names -> arrays in torch Linear layout."""
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": np.asarray(params["embed"])}
    layers = params["layers"]
    for key, suffix in _layer_keys(cfg):
        stacked = np.asarray(layers[key])
        for i in range(cfg.n_layers):
            out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(_to_hf(key, stacked[i], cfg))
    out["model.norm.weight"] = np.asarray(params["final_norm"])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def export_hf(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    base_config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write params as a Hugging Face checkpoint (config.json + safetensors, sharded above
    `max_shard_bytes`). With `source_dir`, its config.json keys (eos ids...) and tokenizer files are kept; without
    one, `base_config`'s keys are."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = base_config
    if source_dir is not None:
        src = Path(source_dir)
        if (src / "config.json").is_file():
            base = json.loads((src / "config.json").read_text())
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
    (out / "config.json").write_text(json.dumps(hf_config_from_model(cfg, base), indent=2) + "\n")

    tensors = params_to_hf_tensors(params, cfg)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}  # transformers refuses files without it
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0], meta)
        return out
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, shard, meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
