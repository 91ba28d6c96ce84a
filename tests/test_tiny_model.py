"""The tiny Qwen3 fixture published as `Qwen/Qwen3-8B` (tests/tiny_model.py) against its transformers reference.

tests/fixtures/tiny_qwen3/reference.json comes from make_fixture.py there, run by hand with transformers + CPU
torch; these tests need neither torch nor a network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.tiny_model import FIXTURE, HF_FILES, commit_hash, publish, reference

jax.config.update("jax_platforms", "cpu")  # as tests/trainer/conftest.py: no TPU probing when run alone

# Run with HF_HOME=<published cache> HF_HUB_OFFLINE=1: the seed script's process_example byte for byte, on the
# tokenizer the tinker SDK's get_tokenizer() would load, plus the Hub client's offline snapshot lookup.
CLIENT = '''
import json, sys
import huggingface_hub
from tinker import types
from transformers import AutoTokenizer

examples = [{"input": "banana split", "output": "anana-bay plit-say"}, {"input": "quantum physics", "output": "uantum-qay ysics-phay"}, {"input": "coding wizard", "output": "oding-cay izard-way"}]
def process_example(example, tokenizer):
    prompt = f"English: {example['input']}\\nPig Latin:"
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
    completion_tokens = tokenizer.encode(f" {example['output']}\\n\\n", add_special_tokens=False)
    tokens = prompt_tokens + completion_tokens
    weights = [0] * len(prompt_tokens) + [1] * len(completion_tokens)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens=tokens[:-1]), loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]))

tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")
data = [process_example(e, tokenizer) for e in examples]
json.dump({
    "snapshot": huggingface_hub.snapshot_download("Qwen/Qwen3-8B", local_files_only=True),
    "class": type(tokenizer).__name__,
    "eos": [tokenizer.eos_token, tokenizer.eos_token_id],
    "pad": [tokenizer.pad_token, tokenizer.pad_token_id],
    "bos": tokenizer.bos_token,
    "im": tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]),
    "data": [{"model_input": d.model_input.to_ints(),
              "target_tokens": d.loss_fn_inputs["target_tokens"].data,
              "weights": d.loss_fn_inputs["weights"].data} for d in data],
}, sys.stdout)
'''  # noqa: E501 (the seed script's lines as written)


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    publish(home)
    return home


def test_fixture_is_small_and_complete(ref: dict) -> None:
    assert all((FIXTURE / name).is_file() for name in HF_FILES)
    total = sum(f.stat().st_size for f in FIXTURE.iterdir() if f.is_file())
    assert total < 2 << 20, f"fixture is {total} bytes"
    hf = json.loads((FIXTURE / "config.json").read_text())
    assert hf["model_type"] == "qwen3" and hf["tie_word_embeddings"] is False
    assert hf["vocab_size"] == ref["vocab_size"] and hf["vocab_size"] % 64 == 0
    assert ref["n_tokenizer_tokens"] <= hf["vocab_size"] < ref["n_tokenizer_tokens"] + 64
    assert [len(d["model_input"]) == len(d["target_tokens"]) == len(d["weights"]) for d in ref["data"]] == [True] * 3
    assert ref["first_loss_printed"] == f"{ref['first_loss']:.4f}"


def test_publish_layout_is_a_hub_cache_entry(tmp_path: Path) -> None:
    snap = publish(tmp_path)
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    assert snap == repo / "snapshots" / commit_hash() and len(snap.name) == 40
    assert (repo / "refs" / "main").read_text() == snap.name
    assert sorted(p.name for p in snap.iterdir()) == sorted(HF_FILES)
    for name in HF_FILES:
        assert (snap / name).read_bytes() == (FIXTURE / name).read_bytes()
        assert (snap / name).resolve().parent == (repo / "blobs").resolve()
    assert publish(tmp_path) == snap  # idempotent
    other = publish(tmp_path, "Qwen/Qwen3-8B-Base")
    assert other.parts[-3] == "models--Qwen--Qwen3-8B-Base"


def test_offline_client_tokenizer_reproduces_reference_tokens(hf_home: Path, ref: dict) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert Path(got["snapshot"]) == hf_home / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / commit_hash()
    assert got["class"] == "Qwen2Tokenizer"
    ids = ref["special_ids"]
    assert got["eos"] == ["<|im_end|>", ids["<|im_end|>"]] and got["pad"] == ["<|endoftext|>", ids["<|endoftext|>"]]
    assert got["bos"] is None and got["im"] == [ids["<|im_start|>"], ids["<|im_end|>"]]
    for mine, want in zip(got["data"], ref["data"], strict=True):
        assert mine["model_input"] == want["model_input"]
        assert mine["target_tokens"] == want["target_tokens"]
        assert mine["weights"] == want["weights"]
        assert want["model_input"][0] != ids["<|endoftext|>"]  # no BOS, as with Qwen3


def test_tokenizers_library_alone_gives_the_same_tokens(ref: dict) -> None:
    """What a server that reads tokenizer.json with `tokenizers` (no transformers) gets."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    for d in ref["data"]:
        prompt = tok.encode(d["prompt"], add_special_tokens=True).ids
        assert prompt == d["model_input"][: d["n_prompt_tokens"]]
        assert tok.decode(d["model_input"] + d["target_tokens"][-1:]) == d["text"]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert (ids[0], ids[-1]) == (ref["special_ids"]["<|im_start|>"], ref["special_ids"]["<|im_end|>"])


def test_jax_forward_reproduces_transformers_logprobs(hf_home: Path, ref: dict) -> None:
    """Our importer reads the published snapshot; our forward gives transformers' fp32 log-probs and entropies
    (the three data right-padded into one batch: causal attention leaves the valid positions unchanged)."""
    from trainer.model.decoder import forward, logits, logprobs_and_entropy
    from trainer.model.hf import import_hf

    params, cfg = import_hf(hf_home / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / commit_hash())
    assert (cfg.family, cfg.vocab_size, cfg.tie_embeddings, cfg.qk_norm) == ("qwen3", ref["vocab_size"], False, True)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (64, 2, 4, 2, 16)
    assert cfg.param_dtype == "float32"
    data = ref["data"]
    T = max(len(d["model_input"]) for d in data)
    tokens, targets, valid = (np.zeros((len(data), T), dt) for dt in (np.int32, np.int32, bool))
    for row, d in enumerate(data):
        n = len(d["model_input"])
        tokens[row, :n], targets[row, :n], valid[row, :n] = d["model_input"], d["target_tokens"], True

    @jax.jit
    def run(p: dict, tokens: jax.Array, valid: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, _ = forward(p, cfg, tokens, valid)
        return logprobs_and_entropy(logits(p, cfg, x), targets)

    lp, ent = (np.asarray(a) for a in run(params, tokens, valid, targets))
    all_lp, all_w = [], []
    for row, d in enumerate(data):
        n = len(d["model_input"])
        np.testing.assert_allclose(lp[row, :n], d["logprobs"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(ent[row, :n], d["entropies"], rtol=0, atol=1e-5)
        all_lp += lp[row, :n].astype(np.float64).tolist()
        all_w += d["weights"]
    loss = -float(np.dot(all_lp, all_w)) / sum(all_w)
    assert abs(loss - ref["first_loss"]) < 1e-5
    assert f"{loss:.4f}" == ref["first_loss_printed"]
