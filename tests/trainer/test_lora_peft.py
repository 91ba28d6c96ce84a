"""LoRA adapters against PEFT itself (peft 0.20 on transformers + CPU torch, on the tiny Qwen3 fixture): an adapter we
write loads with `PeftModel.from_pretrained` and gives our logits; one PEFT writes loads here and gives PEFT's; our
merged export is PEFT's merge_and_unload."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny_model import FIXTURE
from trainer.base.config import LoraConfig
from trainer.model import decoder as M
from trainer.model import lora as L
from trainer.model.hf import import_hf

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
TOKENS = np.array([[3, 17, 420, 5, 93, 1001, 64, 8, 250, 11]], np.int64)


@pytest.fixture(scope="module")
def base() -> tuple[dict, object]:
    return import_hf(FIXTURE)


def _ours(params: dict, cfg: object, weights: dict | None, lcfg: LoraConfig | None) -> np.ndarray:
    tokens = jnp.asarray(TOKENS, jnp.int32)
    adapter = None if weights is None else L.adapter(jax.tree.map(jnp.asarray, weights), jnp.zeros((1,), jnp.int32),
                                                      lcfg)  # type: ignore[arg-type]
    x, _ = M.forward(params, cfg, tokens, jnp.ones(tokens.shape, bool), adapter=adapter)  # type: ignore[arg-type]
    return np.asarray(M.logits(params, cfg, x, adapter))[0]  # type: ignore[arg-type]


def _hf_model() -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(FIXTURE, torch_dtype=torch.float32).eval()


def _theirs(model: object) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits[0].numpy()  # type: ignore[operator]


def _random_adapter(cfg: object, lcfg: LoraConfig) -> dict:
    weights = jax.device_get(L.init_lora(cfg, lcfg, jax.random.PRNGKey(3)))  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (0.05 * rng.standard_normal(x.shape)).astype(np.float32) if p[-1].key == "b"
        else np.asarray(x, np.float32), weights)


@pytest.mark.parametrize("rslora", [False, True])
def test_our_adapter_loads_in_peft_with_our_logits(tmp_path: Path, base: tuple[dict, object], rslora: bool) -> None:
    params, cfg = base
    lcfg = LoraConfig(rank=4, alpha=32, targets=list(ALL), rslora=rslora, slots=1)
    weights = _random_adapter(cfg, lcfg)
    L.export_peft(weights, lcfg, tmp_path / "adapter", base_model_name_or_path="Qwen/Qwen3-8B")
    model = peft.PeftModel.from_pretrained(_hf_model(), tmp_path / "adapter").eval()
    ours = _ours(params, cfg, weights, lcfg)
    np.testing.assert_allclose(_theirs(model), ours, atol=2e-4, rtol=1e-4)
    assert not np.allclose(_ours(params, cfg, None, None), ours, atol=1e-2), "the adapter must change the logits"
    # Merging: PEFT's merge_and_unload equals our merge of the same adapter.
    merged = jax.device_get(L.merge(params, jax.tree.map(jnp.asarray, weights), cfg, lcfg))  # type: ignore[arg-type]
    np.testing.assert_allclose(_theirs(model.merge_and_unload()), _ours(merged, cfg, None, None), atol=2e-4, rtol=1e-4)


def test_an_adapter_peft_wrote_loads_here_with_peft_logits(tmp_path: Path, base: tuple[dict, object]) -> None:
    params, cfg = base
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)  # random A and B, so the adapter is not the identity
    model = peft.get_peft_model(_hf_model(), config).eval()
    model.save_pretrained(tmp_path / "peft")
    weights, lcfg = L.import_peft(tmp_path / "peft", cfg)  # type: ignore[arg-type]
    assert (lcfg.rank, lcfg.alpha, set(lcfg.targets)) == (8, 16.0, {"q_proj", "v_proj", "down_proj"})
    np.testing.assert_allclose(_ours(params, cfg, weights, lcfg), _theirs(model), atol=2e-4, rtol=1e-4)
