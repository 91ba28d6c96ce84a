from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from trainer.base.config import ConfigError
from trainer.model.hf import (
    check_hf,
    export_hf,
    hf_config_from_model,
    import_hf,
    model_config_from_hf,
    model_family,
    read_checkpoint_tensors,
)
from trainer.model.tensors import LazyTensor, read_safetensors, write_safetensors
from trainer.model.tokenizer import HFTokenizer, load_tokenizer

VOCAB = 48

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # Qwen3 decouples head_dim from hidden_size / heads (4 * 16 != 32)
    "hidden_act": "silu",
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 128,
    "attention_bias": False,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 2,
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 24,
    "intermediate_size": 56,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 64,
    "torch_dtype": "float32",
}


def hf_tensors(hf: dict[str, Any], dtype: Any, seed: int) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face names, torch Linear layout [out, in]."""
    rng = np.random.default_rng(seed)
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hq, hkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    dh = hf.get("head_dim", d // hq)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(dtype)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.1).astype(dtype)

    t = {"model.embed_tokens.weight": w(v, d, scale=1.0), "model.norm.weight": norm(d)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = w(hq * dh, d)
        t[p + "self_attn.k_proj.weight"] = w(hkv * dh, d)
        t[p + "self_attn.v_proj.weight"] = w(hkv * dh, d)
        t[p + "self_attn.o_proj.weight"] = w(d, hq * dh)
        t[p + "mlp.gate_proj.weight"] = w(f, d)
        t[p + "mlp.up_proj.weight"] = w(f, d)
        t[p + "mlp.down_proj.weight"] = w(d, f)
        if hf["model_type"] == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(dh)
            t[p + "self_attn.k_norm.weight"] = norm(dh)
    if not hf["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    return t


def write_checkpoint(root: Path, hf: dict[str, Any], tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for s, chunk in enumerate(np.array_split(np.array(names), shards), start=1):
            fname = f"model-{s:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in chunk}, str(root / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(chunk.tolist(), fname))
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    vocab = {"<unk>": 0, "<pad>": 1, "<|endoftext|>": 2} | {f"t{i}": i for i in range(3, hf["vocab_size"])}
    tok = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return root


@pytest.fixture
def qwen3_dir(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    t = hf_tensors(QWEN3, ml_dtypes.bfloat16, seed=0)
    return write_checkpoint(tmp_path / "qwen3", QWEN3, t), t


@pytest.fixture
def llama_dir(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    t = hf_tensors(LLAMA, np.float32, seed=1)
    return write_checkpoint(tmp_path / "llama", LLAMA, t, shards=3), t


def test_import_qwen3_places_every_tensor(qwen3_dir: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, t = qwen3_dir
    params, cfg = import_hf(path)
    assert cfg.model_dump() == {
        "vocab_size": VOCAB,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "d_ff": 40,
        "rope_theta": 1e6,
        "norm_eps": 1e-6,
        "qk_norm": True,
        "tie_embeddings": True,
        "param_dtype": "bfloat16",
        "max_seq_len": 128,
        "family": "qwen3",
        "qkv_bias": False,
        "rope_type": "default",
        "rope_factor": 1.0,
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_original_max_len": None,
    }
    assert set(params) == {"embed", "layers", "final_norm"}  # tied: no lm_head
    lay = params["layers"]
    assert {k: v.shape for k, v in lay.items()} == {
        "attn_norm": (2, 32),
        "wq": (2, 32, 4, 16),
        "wk": (2, 32, 2, 16),
        "wv": (2, 32, 2, 16),
        "wo": (2, 4, 16, 32),
        "q_norm": (2, 16),
        "k_norm": (2, 16),
        "mlp_norm": (2, 32),
        "w_gate": (2, 32, 40),
        "w_up": (2, 32, 40),
        "w_down": (2, 40, 32),
    }
    assert all(a.dtype == ml_dtypes.bfloat16 for a in [params["embed"], params["final_norm"], *lay.values()])
    np.testing.assert_array_equal(params["embed"], t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], t["model.norm.weight"])
    rng = np.random.default_rng(0)
    for i in range(2):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(lay["q_norm"][i], t[p + "self_attn.q_norm.weight"])
        np.testing.assert_array_equal(lay["k_norm"][i], t[p + "self_attn.k_norm.weight"])
        np.testing.assert_array_equal(lay["attn_norm"][i], t[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(lay["mlp_norm"][i], t[p + "post_attention_layernorm.weight"])
        # Element-wise index checks: HF out index = head * head_dim + j, in index = model dim.
        for _ in range(20):
            d, h, j, f = rng.integers(32), rng.integers(4), rng.integers(16), rng.integers(40)
            hk = h // 2
            assert lay["wq"][i, d, h, j] == t[p + "self_attn.q_proj.weight"][h * 16 + j, d]
            assert lay["wk"][i, d, hk, j] == t[p + "self_attn.k_proj.weight"][hk * 16 + j, d]
            assert lay["wv"][i, d, hk, j] == t[p + "self_attn.v_proj.weight"][hk * 16 + j, d]
            assert lay["wo"][i, h, j, d] == t[p + "self_attn.o_proj.weight"][d, h * 16 + j]
            assert lay["w_gate"][i, d, f] == t[p + "mlp.gate_proj.weight"][f, d]
            assert lay["w_up"][i, d, f] == t[p + "mlp.up_proj.weight"][f, d]
            assert lay["w_down"][i, f, d] == t[p + "mlp.down_proj.weight"][d, f]


def test_import_llama_sharded_untied_gqa(llama_dir: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, t = llama_dir
    assert len(list(path.glob("model-*.safetensors"))) == 3
    params, cfg = import_hf(path)
    assert (cfg.qk_norm, cfg.tie_embeddings, cfg.param_dtype) == (False, False, "float32")
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers, cfg.norm_eps) == (6, 2, 4, 3, 1e-5)
    assert "q_norm" not in params["layers"] and "k_norm" not in params["layers"]
    assert params["lm_head"].shape == (24, VOCAB)
    np.testing.assert_array_equal(params["lm_head"], t["lm_head.weight"].T)
    for i in range(3):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(params["layers"]["wk"][i].reshape(24, 8).T, t[p + "self_attn.k_proj.weight"])
        np.testing.assert_array_equal(params["layers"]["wo"][i].reshape(24, 24).T, t[p + "self_attn.o_proj.weight"])
        np.testing.assert_array_equal(params["layers"]["w_down"][i], t[p + "mlp.down_proj.weight"].T)
    # Casting on import: bf16 params from an fp32 checkpoint.
    p16, c16 = import_hf(path, param_dtype="bfloat16")
    assert c16.param_dtype == "bfloat16" and p16["layers"]["wq"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(p16["embed"], t["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("which", ["qwen3", "llama"])
@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 4000])
def test_export_round_trips_bitwise(
    which: str, max_shard_bytes: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    src, t = request.getfixturevalue(f"{which}_dir")
    params, cfg = import_hf(src)
    out = export_hf(params, cfg, tmp_path / "export", source_dir=src, max_shard_bytes=max_shard_bytes)
    files = sorted(out.glob("*.safetensors"))
    assert (len(files) > 1) == (max_shard_bytes == 4000)
    assert (out / "model.safetensors.index.json").is_file() == (len(files) > 1)
    got: dict[str, np.ndarray] = {}
    for fname in files:  # read back with the safetensors library itself, not our parser
        with safe_open(str(fname), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            got.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    assert sorted(got) == sorted(t)
    for name, want in t.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name
    hf_in = json.loads((src / "config.json").read_text())
    hf_out = json.loads((out / "config.json").read_text())
    for key, value in hf_in.items():
        if key not in ("torch_dtype", "use_sliding_window"):
            assert hf_out[key] == value, key
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    params2, cfg2 = import_hf(out)
    assert cfg2 == cfg
    flat = read_checkpoint_tensors(out)
    assert sorted(flat) == sorted(t)


def test_tokenizer_loads_from_checkpoint_dir(qwen3_dir: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = qwen3_dir
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == VOCAB
    assert tok.eos_id == 2 and tok.pad_id == 2
    ids = tok.encode("t5 t7 t40")
    assert ids == [5, 7, 40] and tok.decode(ids) == "t5 t7 t40"


def test_import_errors(tmp_path: Path) -> None:
    t = hf_tensors(LLAMA, np.float32, seed=2)
    bad = dict(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 8.0})
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        import_hf(write_checkpoint(tmp_path / "rope", bad, t))
    with pytest.raises(ValueError, match="unsupported model_type 'gemma'"):
        import_hf(write_checkpoint(tmp_path / "gemma", dict(LLAMA, model_type="gemma"), t))
    extra = dict(t, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(24, np.float32)})
    with pytest.raises(ValueError, match=r"unsupported tensors.*q_proj.bias"):
        import_hf(write_checkpoint(tmp_path / "bias", LLAMA, extra))
    missing = {k: v for k, v in t.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.2.mlp.up_proj.weight'"):
        import_hf(write_checkpoint(tmp_path / "missing", LLAMA, missing))
    wrong = dict(t, **{"model.norm.weight": np.ones(23, np.float32)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(23,\), config implies \(24,\)"):
        import_hf(write_checkpoint(tmp_path / "shape", LLAMA, wrong))
    with pytest.raises(FileNotFoundError, match="nothing is not a directory"):
        import_hf(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        import_hf(tmp_path / "empty")


def test_safetensors_round_trip_through_the_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    square = rng.standard_normal((5, 7)).astype(np.float32)
    tensors = {
        "bf16": rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
        "transposed": square.T,  # a strided view: must be written in logical order, not memory order
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "f16": rng.standard_normal(3).astype(np.float16),
        "u16": np.array([1, 65535], np.uint16),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float64),
        "empty": np.zeros((0, 4), np.int8),
    }
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    with safe_open(str(path), framework="numpy") as f:  # the library's reader agrees with ours
        assert f.metadata() == {"format": "pt"}
        lib = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    ours = read_safetensors(path)
    assert sorted(ours) == sorted(lib) == sorted(tensors)
    for name, want in tensors.items():
        want = want.astype(want.dtype.newbyteorder("<"))  # safetensors is little-endian
        for got in (lib[name], ours[name], np.asarray(ours.lazy(name))):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tobytes() == np.ascontiguousarray(want).tobytes(), name
        assert (ours.lazy(name).shape, ours.lazy(name).dtype) == (want.shape, want.dtype)
    np.testing.assert_array_equal(ours["transposed"], square.T)
    assert np.asarray(ours.lazy("bf16"), np.float32).dtype == np.float32
    with pytest.raises(ValueError, match="'c': dtype complex128 cannot be written"):
        write_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex128)})


def _sparse_safetensors(path: Path, rows: int, cols: int, written: dict[int, np.ndarray]) -> None:
    """A BF16 tensor 'big' [rows, cols] stored as a file hole except for the `written` rows, and an F32 'small'."""
    n = rows * cols * 2
    header = {
        "big": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, n]},
        "small": {"dtype": "F32", "shape": [3], "data_offsets": [n, n + 12]},
    }
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        start = f.tell()
        f.truncate(start + n + 12)  # sparse: the big tensor takes no disk and no page cache
        for row, values in written.items():
            f.seek(start + row * cols * 2)
            f.write(values.astype(ml_dtypes.bfloat16).tobytes())
        f.seek(start + n)
        f.write(np.array([1.0, 2.0, 3.0], np.float32).tobytes())


def test_reads_are_lazy_and_slices_read_only_their_rows(tmp_path: Path) -> None:
    import tracemalloc

    rows, cols = 1 << 14, 1 << 13  # 256 MiB of bf16
    row5 = np.arange(cols, dtype=np.float32) % 256
    path = tmp_path / "sparse.safetensors"
    _sparse_safetensors(path, rows, cols, {5: row5, rows - 1: -row5})
    tracemalloc.start()  # safetensors returns arrays in Python-allocated buffers, which tracemalloc counts
    try:
        tensors = read_safetensors(path)
        big = tensors.lazy("big")
        assert "big" in tensors and (big.shape, big.dtype) == ((rows, cols), ml_dtypes.bfloat16)
        assert big.nbytes == 256 << 20
        np.testing.assert_array_equal(tensors["small"], [1.0, 2.0, 3.0])
        part = big[4:7]
        last = big[-1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"reading 3 rows and a 12-byte tensor allocated {peak} bytes"
    assert part.shape == (3, cols) and part.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(part[1], row5.astype(ml_dtypes.bfloat16))
    assert not part[0].any() and not part[2].any()
    np.testing.assert_array_equal(last, (-row5).astype(ml_dtypes.bfloat16))
    with pytest.raises(IndexError, match=rf"^{re.escape(str(path))}: tensor 'big' \[16384, 8192\]:.*out of bounds"):
        big[rows]


def test_check_hf_reads_no_weight_and_import_reads_each_once(
    qwen3_dir: tuple[Path, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, t = qwen3_dir
    reads: list[str] = []
    real_read, real_getitem = LazyTensor.read, LazyTensor.__getitem__

    def read(self: LazyTensor) -> np.ndarray:
        reads.append(self.name)
        return real_read(self)

    def getitem(self: LazyTensor, index: Any) -> np.ndarray:
        reads.append(self.name)
        return real_getitem(self, index)

    monkeypatch.setattr(LazyTensor, "read", read)
    monkeypatch.setattr(LazyTensor, "__getitem__", getitem)
    assert check_hf(path).param_dtype == "bfloat16"  # the dtype comes from the header
    assert reads == []
    import_hf(path)
    assert sorted(reads) == sorted(t)


def test_damaged_safetensors_are_clear_errors(tmp_path: Path) -> None:
    t = hf_tensors(LLAMA, np.float32, seed=8)
    single = write_checkpoint(tmp_path / "single", LLAMA, t)
    weights = single / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    for content, why in [
        (b"", "header too small"),
        (b"this is not a safetensors file, only text", "header"),
        (data[:-100], "incomplete metadata"),  # truncated weights
        (data[:header_end], "incomplete metadata"),  # the header alone
    ]:
        weights.write_bytes(content)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(weights))}: not a safetensors file \(.*{why}"):
            read_checkpoint_tensors(single)
        with pytest.raises(ConfigError, match=rf"^init.path: {re.escape(str(weights))}: not a safetensors file"):
            check_hf(single)
    f8 = tmp_path / "f8.safetensors"
    save_file({"x": np.zeros(4, ml_dtypes.float8_e4m3fn)}, str(f8))  # the library writes it; NumPy cannot read it
    with pytest.raises(ValueError, match=rf"^{re.escape(str(f8))}: tensor 'x' has unsupported dtype F8_E4M3"):
        read_safetensors(f8)
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(tmp_path / 'nope'))}: no such file"):
        read_safetensors(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(tmp_path))}: not a file"):
        read_safetensors(tmp_path)
    write_safetensors(tmp_path / "ok.safetensors", {"x": np.zeros(2, np.float32)})
    with pytest.raises(KeyError, match="'model.nothing'"):
        read_safetensors(tmp_path / "ok.safetensors")["model.nothing"]

    sharded = write_checkpoint(tmp_path / "sharded", LLAMA, t, shards=3)
    index = sharded / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": weight_map | {"model.extra": "x.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(sharded / 'x.safetensors'))}: no such file"):
        read_checkpoint_tensors(sharded)
    index.write_text(json.dumps({"weight_map": weight_map | {"model.extra": "model-00001-of-00003.safetensors"}}))
    with pytest.raises(ValueError, match=r"tensors listed but not found in the shards: \['model.extra'\]"):
        read_checkpoint_tensors(sharded)
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00003.safetensors"]}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(index))}: not a safetensors index \(weight_map is not"):
        read_checkpoint_tensors(sharded)
    index.write_text("{")
    with pytest.raises(ConfigError, match=rf"^init.path: {re.escape(str(index))}: not a safetensors index"):
        check_hf(sharded)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def hf_reference_logits(hf: dict[str, Any], t: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Hugging Face LlamaForCausalLM / Qwen3ForCausalLM forward in float64, straight from HF tensor names."""
    w = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps, theta = hf["rms_norm_eps"], hf["rope_theta"]
    hq, hkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    dh = hf.get("head_dim", hf["hidden_size"] // hq)
    b, n = ids.shape
    inv_freq = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
    freqs = np.arange(n)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., dh // 2 :], x[..., : dh // 2]], axis=-1)

    causal = np.tril(np.ones((n, n), bool))
    x = w["model.embed_tokens.weight"][ids]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(b, n, hq, dh)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(b, n, hkv, dh)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(b, n, hkv, dh)
        if hf["model_type"] == "qwen3":
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, hq // hkv, axis=2)  # repeat_kv: query head j uses kv head j // (hq / hkv)
        v = np.repeat(v, hq // hkv, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, hq * dh)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("which", ["qwen3", "llama"])
def test_model_forward_on_imported_params_matches_hf_reference(which: str, request: pytest.FixtureRequest) -> None:
    import jax.numpy as jnp

    from trainer.model.decoder import forward, logits

    path, t = request.getfixturevalue(f"{which}_dir")
    hf = QWEN3 if which == "qwen3" else LLAMA
    params, cfg = import_hf(path, param_dtype="float32")  # bf16 Qwen3 weights upcast exactly
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(2, 11))
    x, _ = forward(params, cfg, jnp.asarray(ids), jnp.ones(ids.shape, bool))
    got = np.asarray(logits(params, cfg, x))
    want = hf_reference_logits(hf, t, ids)
    assert np.abs(want).max() > 1.0  # the check is not vacuous
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_import_tolerates_tied_lm_head_copy_and_rope_table(tmp_path: Path) -> None:
    t = hf_tensors(QWEN3, np.float32, seed=4)
    extra = dict(
        t,
        **{
            "lm_head.weight": t["model.embed_tokens.weight"].copy(),  # tied checkpoints sometimes keep it
            "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),  # old Llama exports
        },
    )
    params, cfg = import_hf(write_checkpoint(tmp_path / "tied", QWEN3, extra))
    assert cfg.tie_embeddings and "lm_head" not in params
    assert cfg.param_dtype == "float32" and params["embed"].dtype == np.float32
    np.testing.assert_array_equal(params["embed"], t["model.embed_tokens.weight"])


LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    "layout",
    [
        # transformers < 4.56: rope_theta beside rope_scaling; "type" is the even older spelling of rope_type
        {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA31_SCALING}},
        {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA31_SCALING}},
        # transformers >= 4.56: one rope_parameters dict holding the theta too
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA31_SCALING}},
        {"rope_theta": 1.0, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA31_SCALING}},
    ],
)
def test_llama3_rope_scaling_layouts(layout: dict[str, Any]) -> None:
    base = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    cfg = model_config_from_hf(base | layout)
    assert (cfg.family, cfg.rope_type, cfg.rope_theta, cfg.rope_factor) == ("llama", "llama3", 5e5, 8.0)
    assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len) == (1.0, 4.0, 16)
    # Back out in the layout it came in (rope_parameters when the base has it), and in again unchanged.
    out = hf_config_from_model(cfg, base | layout)
    assert ("rope_parameters" in out) == ("rope_parameters" in layout)
    assert model_config_from_hf(out) == cfg


def test_rope_defaults_and_linear() -> None:
    no_original = dict(LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0})
    assert model_config_from_hf(no_original).rope_original_max_len == 64  # transformers: max_position_embeddings
    linear = model_config_from_hf(dict(LLAMA, rope_scaling={"type": "linear", "factor": 2.0}))
    assert (linear.rope_type, linear.rope_factor) == ("linear", 2.0)
    assert hf_config_from_model(linear)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    plain = model_config_from_hf(dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 7.0}))
    assert (plain.rope_type, plain.rope_theta) == ("default", 7.0)


QWEN2 = dict(LLAMA, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
             sliding_window=8, max_window_layers=1)
MISTRAL = dict(LLAMA, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)


def test_qwen2_and_mistral_configs() -> None:
    qwen2 = model_config_from_hf(QWEN2)  # sliding_window is ignored while use_sliding_window is false
    assert (qwen2.family, qwen2.qkv_bias, qwen2.qk_norm) == ("qwen2", True, False)
    # use_sliding_window with no sliding layer (max_window_layers >= layers) or a window >= the context is fine
    assert model_config_from_hf(dict(QWEN2, use_sliding_window=True, max_window_layers=3)).family == "qwen2"
    assert model_config_from_hf(dict(QWEN2, use_sliding_window=True, sliding_window=64)).family == "qwen2"
    mistral = model_config_from_hf(MISTRAL)
    assert (mistral.family, mistral.qkv_bias, mistral.qk_norm) == ("mistral", False, False)
    assert model_config_from_hf(dict(MISTRAL, sliding_window=64)).family == "mistral"  # = max_position_embeddings
    out = hf_config_from_model(mistral)
    assert out["architectures"] == ["MistralForCausalLM"] and out["sliding_window"] is None


@pytest.mark.parametrize(
    ("hf", "match"),
    [
        (dict(MISTRAL, sliding_window=32), "sliding_window=32 < max_position_embeddings=64"),
        # MistralConfig's default window is 4096, so a config without the key has one
        ({k: v for k, v in MISTRAL.items() if k != "sliding_window"} | {"max_position_embeddings": 8192},
         "sliding_window=4096"),
        (dict(QWEN2, use_sliding_window=True), "use_sliding_window=true with sliding_window=8"),
        (dict(QWEN2, use_sliding_window=True, layer_types=["full_attention", "sliding_attention", "full_attention"],
              max_window_layers=9), "sliding_window=8"),
        (dict(LLAMA, attention_bias=True), "attention_bias=true .*o_proj bias"),
        (dict(QWEN3, attention_bias=True), "attention_bias=true .*o_proj bias"),
        (dict(LLAMA, mlp_bias=True), "mlp_bias"),
        (dict(LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
         "partial_rotary_factor"),
        (dict(LLAMA, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1.0}}), "nested"),
    ],
)
def test_unsupported_configs_are_refused(hf: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(hf)


def test_qwen2_checkpoint_biases(tmp_path: Path) -> None:
    t = hf_tensors(QWEN2, np.float32, seed=5)
    rng = np.random.default_rng(6)
    for i in range(3):
        for proj, n in (("q", 24), ("k", 8), ("v", 8)):
            t[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(n).astype(np.float32)
    params, cfg = import_hf(write_checkpoint(tmp_path / "qwen2", QWEN2, t))
    assert params["layers"]["bq"].shape == (3, 6, 4) and params["layers"]["bk"].shape == (3, 2, 4)
    np.testing.assert_array_equal(params["layers"]["bq"][1].reshape(-1), t["model.layers.1.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(params["layers"]["bv"][2].reshape(-1), t["model.layers.2.self_attn.v_proj.bias"])
    out = export_hf(params, cfg, tmp_path / "out", source_dir=tmp_path / "qwen2")
    back = read_checkpoint_tensors(out)
    assert sorted(back) == sorted(t) and all(back[k].tobytes() == t[k].tobytes() for k in t)
    # A missing bias, or an o_proj bias (Llama/Qwen3 attention_bias layout), is an error.
    no_bias = {k: v for k, v in t.items() if k != "model.layers.0.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match="no tensor 'model.layers.0.self_attn.k_proj.bias'"):
        import_hf(write_checkpoint(tmp_path / "missing", QWEN2, no_bias))
    o_bias = dict(t, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(24, np.float32)})
    with pytest.raises(ValueError, match=r"unsupported tensors.*o_proj.bias"):
        import_hf(write_checkpoint(tmp_path / "obias", QWEN2, o_bias))


def test_family_inference_and_validation() -> None:
    from trainer.base.config import ModelConfig

    shape = dict(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8, max_seq_len=8)
    assert model_family(ModelConfig(**shape)) == "llama"
    assert model_family(ModelConfig(**shape, qk_norm=True)) == "qwen3"
    assert model_family(ModelConfig(**shape, qkv_bias=True)) == "qwen2"
    assert model_family(ModelConfig(**shape, family="mistral")) == "mistral"
    with pytest.raises(ValueError, match="both QK-norm and q/k/v biases"):
        model_family(ModelConfig(**shape, qk_norm=True, qkv_bias=True))
    with pytest.raises(ValueError, match="family=qwen2 needs qk_norm=False and qkv_bias=True"):
        ModelConfig(**shape, family="qwen2")
    with pytest.raises(ValueError, match="family=llama needs"):
        ModelConfig(**shape, family="llama", qk_norm=True)
    with pytest.raises(ValueError, match="rope_original_max_len"):
        ModelConfig(**shape, rope_type="llama3")
