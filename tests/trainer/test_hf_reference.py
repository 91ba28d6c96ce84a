"""Imported Hugging Face checkpoints against transformers' own outputs.

The checkpoints and reference numbers under tests/fixtures/hf/ come from tests/fixtures/hf/make_fixtures.py,
run by hand in a separate venv with transformers + CPU torch; these tests need neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trainer.base.config import ModelConfig
from trainer.model.decoder import forward, logits, rope_inv_freq
from trainer.model.hf import export_hf, import_hf, read_checkpoint_tensors
from trainer.rl.sampler import sample

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
# name -> ModelConfig fields the import must produce
EXPECTED: dict[str, dict[str, Any]] = {
    "qwen3_tied_bf16": {
        "family": "qwen3", "qk_norm": True, "qkv_bias": False, "tie_embeddings": True, "param_dtype": "bfloat16",
        "rope_type": "default", "rope_theta": 1e6,
    },
    "llama3_untied_sharded": {
        "family": "llama", "qk_norm": False, "qkv_bias": False, "tie_embeddings": False, "param_dtype": "float32",
        "rope_type": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_max_len": 64,
    },
    "qwen2_bias": {
        "family": "qwen2", "qk_norm": False, "qkv_bias": True, "tie_embeddings": True, "param_dtype": "float32",
        "rope_type": "default",
    },
    "mistral_linear_rope": {
        "family": "mistral", "qk_norm": False, "qkv_bias": False, "tie_embeddings": False,
        "param_dtype": "float32", "rope_type": "linear", "rope_factor": 2.0, "head_dim": 32,
    },
}
NAMES = list(EXPECTED)


def load(name: str) -> tuple[Path, dict[str, Any], np.ndarray]:
    root = FIXTURES / name
    return root, json.loads((root / "reference.json").read_text()), np.load(root / "logits.npy")


def model_logits(params: Any, cfg: ModelConfig, ref: dict[str, Any], **update: Any) -> np.ndarray:
    cfg = cfg.model_copy(update=update)
    x, _ = forward(
        params, cfg, jnp.asarray(ref["tokens"]), jnp.asarray(ref["valid"], bool), jnp.asarray(ref["position_ids"])
    )
    return np.asarray(logits(params, cfg, x))


def test_fixtures_cover_the_brief() -> None:
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(NAMES)
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 2 << 20, f"fixtures are {total} bytes"
    index = json.loads((FIXTURES / "llama3_untied_sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2


@pytest.mark.parametrize("name", NAMES)
def test_import_config(name: str) -> None:
    root, _, _ = load(name)
    params, cfg = import_hf(root)
    for key, value in EXPECTED[name].items():
        assert getattr(cfg, key) == value, key
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (128, 64, 2, 4, 2)
    assert cfg.max_seq_len == 512
    dtype = ml_dtypes.bfloat16 if cfg.param_dtype == "bfloat16" else np.float32
    assert all(a.dtype == dtype for a in jax.tree.leaves(params))
    assert ("bq" in params["layers"]) == cfg.qkv_bias
    if cfg.qkv_bias:
        assert params["layers"]["bq"].shape == (2, 4, cfg.head_dim)
        assert params["layers"]["bk"].shape == params["layers"]["bv"].shape == (2, 2, cfg.head_dim)


@pytest.mark.parametrize("name", NAMES)
def test_rope_inv_freq_matches_transformers(name: str) -> None:
    root, ref, _ = load(name)
    _, cfg = import_hf(root)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), np.asarray(ref["rope_inv_freq"], np.float32),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_fp32_logits_match_transformers(name: str) -> None:
    root, ref, want = load(name)
    params, cfg = import_hf(root, param_dtype="float32")  # bf16 checkpoints upcast exactly
    got = model_logits(params, cfg, ref)
    valid = np.asarray(ref["valid"], bool)  # logits at pad positions are not comparable
    assert np.abs(want[valid]).max() > 5.0  # the check is not vacuous
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_logits_close_to_transformers(name: str) -> None:
    root, ref, want = load(name)
    params, cfg = import_hf(root, param_dtype="bfloat16")
    got = model_logits(params, cfg, ref)
    valid = np.asarray(ref["valid"], bool)
    scale = np.abs(want[valid]).max()
    assert np.abs(got[valid] - want[valid]).max() < 0.04 * scale
    assert np.mean(got[valid].argmax(-1) == want[valid].argmax(-1)) > 0.9


@pytest.mark.parametrize(("name", "update"), [
    ("llama3_untied_sharded", {"rope_type": "default"}),
    ("mistral_linear_rope", {"rope_type": "default"}),
    ("qwen2_bias", {"qkv_bias": False}),
])
def test_reference_depends_on_the_new_features(name: str, update: dict[str, Any]) -> None:
    """Dropping RoPE scaling or the biases must break the match, so the tests above really check them."""
    root, ref, want = load(name)
    params, cfg = import_hf(root)
    if "qkv_bias" in update:
        update["family"] = None
    got = model_logits(params, cfg, ref, **update)
    valid = np.asarray(ref["valid"], bool)
    assert np.abs(got[valid] - want[valid]).max() > 0.5


@pytest.mark.parametrize("name", NAMES)
def test_greedy_sampling_matches_transformers_generate(name: str) -> None:
    root, ref, _ = load(name)
    params, cfg = import_hf(root, param_dtype="float32")
    assert ref["min_greedy_gap"] > 1e-3  # fp32 rounding cannot flip a greedy choice
    out = sample(
        jax.tree.map(jnp.asarray, params),  # NumPy tables cannot be indexed by traced tokens
        cfg,
        jnp.asarray(ref["prompt"]),
        jnp.asarray(ref["prompt_valid"], bool),
        jax.random.key(0),
        max_new_tokens=ref["max_new_tokens"],
        eos_id=ref["eos_id"],
        pad_id=ref["pad_id"],
        temperature=0.0,
    )
    tokens, mask = np.asarray(out.tokens_BN), np.asarray(out.mask_BN).astype(bool)
    got = [tokens[b][mask[b]].tolist() for b in range(tokens.shape[0])]
    assert got == ref["greedy"]
    assert any(row[-1] == ref["eos_id"] for row in ref["greedy"])  # EOS handling is exercised


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 60_000])
def test_export_round_trips_fixture_bitwise(name: str, max_shard_bytes: int, tmp_path: Path) -> None:
    root, _, _ = load(name)
    params, cfg = import_hf(root)
    src_tensors = read_checkpoint_tensors(root)
    src_config = json.loads((root / "config.json").read_text())
    for source_dir in (root, None):
        out = export_hf(params, cfg, tmp_path / str(source_dir is None), source_dir=source_dir,
                        max_shard_bytes=max_shard_bytes)
        assert (out / "model.safetensors.index.json").is_file() == (max_shard_bytes < 4 << 30)
        got = read_checkpoint_tensors(out)
        assert sorted(got) == sorted(src_tensors)
        for key, want in src_tensors.items():
            assert got[key].dtype == want.dtype and got[key].tobytes() == want.tobytes(), key
        hf_out = json.loads((out / "config.json").read_text())
        assert hf_out["model_type"] == cfg.family and hf_out["architectures"] == src_config["architectures"]
        if source_dir is not None:  # every key of the source config survives unchanged
            assert {k: hf_out.get(k) for k in src_config} == src_config
        _, cfg2 = import_hf(out)
        assert cfg2 == cfg


def test_exported_rope_layouts() -> None:
    """Without a source config, RoPE goes out in the rope_theta + rope_scaling layout every transformers reads."""
    from trainer.model.hf import hf_config_from_model

    _, cfg = import_hf(FIXTURES / "llama3_untied_sharded")
    plain = hf_config_from_model(cfg)
    assert "rope_parameters" not in plain and plain["rope_theta"] == 10000.0
    assert plain["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    _, cfg = import_hf(FIXTURES / "qwen2_bias")
    plain = hf_config_from_model(cfg)
    assert plain["rope_scaling"] is None and plain["use_sliding_window"] is False
    assert plain["architectures"] == ["Qwen2ForCausalLM"]


def _llama3_inv_freq_f64(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3.1's frequency rule written out per band, in float64 (an independent statement of the rule)."""
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / theta ** (i / dim)
        wavelen = 2 * np.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def test_llama3_inv_freq_matches_llama_3_1_rule() -> None:
    # Llama-3.1-8B's settings: head_dim 128, theta 5e5, factor 8, low 1, high 4, original context 8192.
    cfg = ModelConfig(vocab_size=8, d_model=128, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=128, d_ff=8,
                      max_seq_len=131072, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192)
    got = np.asarray(rope_inv_freq(cfg))
    want = _llama3_inv_freq_f64(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    plain = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    assert np.sum(np.isclose(got, plain, rtol=1e-6)) not in (0, 64)  # some bands kept, some scaled
    linear = np.asarray(rope_inv_freq(cfg.model_copy(update={"rope_type": "linear"})))
    np.testing.assert_allclose(linear, plain / 8.0, rtol=2e-6)


@pytest.mark.parametrize("name", ["qwen2_bias", "llama3_untied_sharded"])
def test_sharded_forward_matches_transformers(name: str) -> None:
    """Params (q/k/v biases included) placed on a (1, 2, 4) mesh by param_axes give the same logits under jit."""
    from trainer.model.decoder import abstract_params, param_axes
    from trainer.model.sharding import make_mesh, named_shardings

    root, ref, want = load(name)
    params, cfg = import_hf(root)
    mesh = make_mesh(1, 2, 4)
    shardings = named_shardings(mesh, param_axes(cfg), abstract_params(cfg))
    placed = jax.device_put(params, shardings)
    if cfg.qkv_bias:
        assert placed["layers"]["bq"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)

    @jax.jit
    def run(p: Any, tokens: jax.Array, valid: jax.Array, pos: jax.Array) -> jax.Array:
        x, _ = forward(p, cfg, tokens, valid, pos)
        return logits(p, cfg, x)

    with jax.set_mesh(mesh):
        got = np.asarray(run(placed, jnp.asarray(ref["tokens"]), jnp.asarray(ref["valid"], bool),
                             jnp.asarray(ref["position_ids"])))
    valid = np.asarray(ref["valid"], bool)
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4)


def test_biases_get_gradients() -> None:
    from trainer.model.decoder import completion_logprobs

    root, ref, _ = load("qwen2_bias")
    params, cfg = import_hf(root)
    params = jax.tree.map(jnp.asarray, params)
    prompt = jnp.asarray(ref["prompt"])
    completion = jnp.asarray(np.random.default_rng(0).integers(1, 128, size=(prompt.shape[0], 4)))

    def loss(p: Any) -> jax.Array:
        logp, _ = completion_logprobs(p, cfg, prompt, jnp.asarray(ref["prompt_valid"], bool), completion,
                                      jnp.ones(completion.shape, jnp.int32))
        return jnp.sum(logp)

    grads = jax.grad(loss)(params)
    for key in ("bq", "bk", "bv"):
        assert grads["layers"][key].shape == params["layers"][key].shape
        assert float(jnp.abs(grads["layers"][key]).max()) > 1e-4, key
