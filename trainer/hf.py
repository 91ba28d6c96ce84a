"""Hugging Face Qwen3 / Llama checkpoints <-> the trainer's stacked parameter tree (NumPy, no torch).

Reads `config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json` from a local
directory (nothing is downloaded). Safetensors files are parsed here (header + memory map) so bf16 works
with any safetensors version; ml_dtypes (a JAX dependency) provides the bfloat16 NumPy dtype.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from trainer.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


# ---------------------------------------------------------------------------------------------- safetensors


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as read-only memory-mapped NumPy arrays."""
    path = Path(path)
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    if not header:
        return {}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[name] = data[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def write_safetensors(
    path: str | Path, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors in the safetensors layout (little-endian, header padded to 8 bytes)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    arrays: list[np.ndarray] = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {
            "dtype": _ST_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def read_checkpoint_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Tensors of a single-file or sharded (`model.safetensors.index.json`) checkpoint directory."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, np.ndarray] = {}
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


def _rope_theta(hf: Mapping[str, Any]) -> float:
    # transformers >= 4.56 may nest RoPE settings under rope_parameters instead of rope_theta/rope_scaling.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type != "default":
        raise ValueError(f"unsupported rope scaling {rope_type!r}: the trainer implements plain RoPE only")
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def model_config_from_hf(hf: Mapping[str, Any], param_dtype: str = "float32") -> ModelConfig:
    """Map a Hugging Face Llama / Qwen3 config.json onto ModelConfig; unsupported variants raise."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (SwiGLU with silu only)")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(flag):
            raise ValueError(f"unsupported config: {flag}=true")
    n_heads = int(hf["num_attention_heads"])
    d_model = int(hf["hidden_size"])
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or d_model // n_heads),
        d_ff=int(hf["intermediate_size"]),
        rope_theta=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=param_dtype,  # type: ignore[arg-type]
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
    )


def hf_config_from_model(cfg: ModelConfig, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `cfg`: Qwen3 when it uses QK-norm, else Llama; `base` keys are kept (eos ids...)."""
    model_type = "qwen3" if cfg.qk_norm else "llama"
    out: dict[str, Any] = dict(base or {})
    for key in ("rope_scaling", "rope_parameters", "torch_dtype", "dtype"):
        out.pop(key, None)
    out.update(
        architectures=["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rope_theta=cfg.rope_theta,
        rope_scaling=None,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
        attention_bias=False,
        torch_dtype=cfg.param_dtype,
    )
    return out


# ---------------------------------------------------------------------------------------------- weights

# (our layer key, HF suffix under model.layers.{i}.)
_LAYER_NAMES: tuple[tuple[str, str], ...] = (
    ("attn_norm", "input_layernorm.weight"),
    ("wq", "self_attn.q_proj.weight"),
    ("wk", "self_attn.k_proj.weight"),
    ("wv", "self_attn.v_proj.weight"),
    ("wo", "self_attn.o_proj.weight"),
    ("q_norm", "self_attn.q_norm.weight"),
    ("k_norm", "self_attn.k_norm.weight"),
    ("mlp_norm", "post_attention_layernorm.weight"),
    ("w_gate", "mlp.gate_proj.weight"),
    ("w_up", "mlp.up_proj.weight"),
    ("w_down", "mlp.down_proj.weight"),
)


def _layer_keys(cfg: ModelConfig) -> list[tuple[str, str]]:
    return [(k, s) for k, s in _LAYER_NAMES if cfg.qk_norm or k not in ("q_norm", "k_norm")]


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
    if key == "wo":
        return w.T.reshape(cfg.n_heads, dh, d)
    if key in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def _to_hf(key: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    d, dh = cfg.d_model, cfg.head_dim
    if key in ("wq", "wk", "wv"):
        return w.reshape(d, -1).T
    if key == "wo":
        return w.reshape(cfg.n_heads * dh, d).T
    if key in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # older Llama checkpoints store the RoPE table


def import_hf(path: str | Path, param_dtype: str | None = None) -> tuple[dict[str, Any], ModelConfig]:
    """Load a local Qwen3 / Llama checkpoint into the trainer's param tree (NumPy) and its ModelConfig.

    `param_dtype` None keeps bf16 checkpoints in bf16 and loads everything else as float32.
    """
    root = Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {root}")
    hf_cfg = json.loads(cfg_file.read_text())
    tensors = read_checkpoint_tensors(root)
    if param_dtype is None:
        param_dtype = "bfloat16" if tensors["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16 else "float32"
    cfg = model_config_from_hf(hf_cfg, param_dtype)
    dtype = np.dtype(ml_dtypes.bfloat16) if param_dtype == "bfloat16" else np.dtype(np.float32)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{root}: checkpoint has no tensor {name!r}")
        w = tensors[name]
        if tuple(w.shape) != shape:
            raise ValueError(f"{root}: tensor {name!r} has shape {tuple(w.shape)}, config implies {shape}")
        used.add(name)
        return w

    params: dict[str, Any] = {
        "embed": np.array(take("model.embed_tokens.weight", (cfg.vocab_size, cfg.d_model)), dtype)
    }
    layers: dict[str, np.ndarray] = {}
    for key, suffix in _layer_keys(cfg):
        per_layer = [
            _from_hf(key, take(f"model.layers.{i}.{suffix}", _hf_shape(key, cfg)), cfg) for i in range(cfg.n_layers)
        ]
        layers[key] = np.stack(per_layer).astype(dtype)
    params["layers"] = layers
    params["final_norm"] = np.array(take("model.norm.weight", (cfg.d_model,)), dtype)
    if not cfg.tie_embeddings:
        params["lm_head"] = np.array(take("lm_head.weight", (cfg.vocab_size, cfg.d_model)).T, dtype)
    elif "lm_head.weight" in tensors:
        used.add("lm_head.weight")  # some tied checkpoints still store a copy; the embedding wins
    unexpected = sorted(n for n in set(tensors) - used if not _ignored(n))
    if unexpected:
        raise ValueError(f"{root}: unsupported tensors in checkpoint (biases? another architecture?): {unexpected[:8]}")
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
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write params as a Hugging Face checkpoint (config.json + safetensors, sharded above
    `max_shard_bytes`). With `source_dir`, its config.json keys (eos ids...) and tokenizer files are kept."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = None
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
