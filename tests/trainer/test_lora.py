"""LoRA adapters: slots on one frozen base model, per-row selection, PEFT import/export, merging, training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from trainer.base.config import ConfigError, LoraConfig, ModelConfig, config_from_dict, lora_alpha, lora_scale
from trainer.model import decoder as M
from trainer.model import lora as L
from trainer.model.hf import export_hf, import_hf, params_to_hf_tensors
from trainer.model.tensors import read_safetensors
from trainer.rl.sampler import sample
from trainer.rl.train import train

from .conftest import TINY_MODEL

CFG = ModelConfig(**TINY_MODEL)  # untied, QK-norm, GQA 4/2: D 32, H 4 x E 8, K 2, F 64, V 100, L 2
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
LCFG = LoraConfig(rank=4, alpha=8, targets=ALL, slots=3)  # scale 2
TOKENS = (np.array([[1, 17, 42, 5, 93, 3, 64, 8]] * 6, np.int32) + np.arange(6, dtype=np.int32)[:, None]) % 100
merge = jax.jit(L.merge, static_argnums=(2, 3))


def _trained(weights: dict, seed: int = 7) -> dict:
    """An adapter as training leaves it: B no longer zero, each slot different (NumPy: no per-op compiles)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: np.asarray(x) + (0.1 * rng.standard_normal(x.shape)).astype(np.float32) if p[-1].key == "b"
        else np.asarray(x), weights)


@pytest.fixture(scope="module")
def base() -> dict:
    """Random base weights: norms near 1, matrices ~ N(0, 1/fan_in)."""
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda p, s: (1 + 0.1 * rng.standard_normal(s) if "norm" in jax.tree_util.keystr(p)
                      else rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1)).astype(np.float32),
        M.param_shapes(CFG), is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x))


@pytest.fixture(scope="module")
def fresh() -> dict:
    return jax.jit(L.init_lora, static_argnums=(0, 1))(CFG, LCFG, jax.random.PRNGKey(1))


@jax.jit
def _logits(params: dict, weights: dict | None, slot_B: jax.Array, tokens: jax.Array) -> jax.Array:
    adapter = None if weights is None else L.adapter(weights, slot_B, LCFG)
    x, _ = M.forward(params, CFG, tokens, jnp.ones(tokens.shape, bool), adapter=adapter)
    return M.logits(params, CFG, x, adapter)


def test_fresh_adapter_is_peft_init_and_the_base_model(base: dict, fresh: dict) -> None:
    a = np.asarray(fresh["layers"]["wo"]["a"])  # [L, S, H, E, r]: fan_in H x E = 32
    assert a.shape == (2, 3, 4, 8, 4) and 0.9 / 32**0.5 < np.abs(a).max() <= 1 / 32**0.5  # U(+-1/sqrt(in))
    assert all(not np.asarray(ab["b"]).any() for ab in [*fresh["layers"].values(), fresh["lm_head"]])
    mixed = _logits(base, fresh, jnp.array([0, 1, 2, -1, 0, 1]), TOKENS)
    none = _logits(base, fresh, jnp.full((6,), -1), TOKENS)
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(none))  # B = 0: every slot adds exactly 0
    # Without an adapter XLA compiles another program (its own fusions), so equal to float rounding there.
    np.testing.assert_allclose(np.asarray(mixed), np.asarray(_logits(base, None, None, TOKENS)), atol=1e-5)


NONE = jnp.full((6,), -1)  # every row on the base model: the adapter program, reused, computes the plain model


def test_each_row_uses_its_own_slot_as_merged_weights_would(base: dict, fresh: dict) -> None:
    weights = _trained(fresh)
    slots = [2, 0, -1, 1, 0, 2]
    got = np.asarray(_logits(base, weights, jnp.array(slots), TOKENS))
    plain = np.asarray(_logits(base, weights, NONE, TOKENS))
    for slot in (-1, 0, 1, 2):
        want = plain if slot < 0 else np.asarray(_logits(merge(base, weights, CFG, LCFG, slot), weights, NONE, TOKENS))
        rows = [i for i, s in enumerate(slots) if s == slot]
        np.testing.assert_allclose(got[rows], want[rows], rtol=1e-5, atol=1e-5)
        if slot >= 0:
            assert np.abs(got[rows] - plain[rows]).max() > 0.05  # the adapter does change the output

    # The sampler (prefill + cached decode, rows split into chunks) and the chunked log-probs take the same path.
    prompt, valid = jnp.asarray(TOKENS[:, :5]), jnp.ones((6, 5), bool)
    run = jax.jit(lambda p, ad: sample(p, CFG, prompt, valid, jax.random.PRNGKey(0), max_new_tokens=3, eos_id=1,
                                       pad_id=0, temperature=0.0, max_num_sequences=2, adapter=ad))
    tokens = np.asarray(run(base, L.adapter(weights, jnp.array(slots), LCFG)).tokens_BN)
    off = L.adapter(weights, NONE, LCFG)
    logp = jax.jit(lambda p, ad: M.completion_logprobs(p, CFG, prompt, valid, jnp.asarray(TOKENS[:, 5:]),
                                                       jnp.ones((6, 3), bool), adapter=ad)[0])
    got_lp = np.asarray(logp(base, L.adapter(weights, jnp.array(slots), LCFG)))
    for slot in (-1, 0, 2):
        merged = base if slot < 0 else merge(base, weights, CFG, LCFG, slot)
        rows = [i for i, s in enumerate(slots) if s == slot]
        np.testing.assert_array_equal(tokens[rows], np.asarray(run(merged, off).tokens_BN)[rows])
        np.testing.assert_allclose(got_lp[rows], np.asarray(logp(merged, off))[rows], rtol=1e-5, atol=1e-5)


def test_peft_files_are_what_peft_writes(tmp_path: Path, base: dict, fresh: dict) -> None:
    weights = _trained(fresh)
    out = L.export_peft(weights, LCFG, tmp_path / "adapter", slot=1, base_model_name_or_path="org/base")
    # peft v0.20.0: utils/constants.py CONFIG_NAME / SAFETENSORS_WEIGHTS_NAME; peft_model.py save_pretrained writes
    # the safetensors with metadata {"format": "pt"} and the config with json.dumps(indent=2, sort_keys=True).
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    text = (out / "adapter_config.json").read_text()
    conf = json.loads(text)
    assert text == json.dumps(conf, indent=2, sort_keys=True) + "\n"
    assert {k: conf[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "target_modules", "bias",
                                 "fan_in_fan_out", "use_rslora", "use_dora", "modules_to_save", "inference_mode",
                                 "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "target_modules": sorted(ALL),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "inference_mode": True, "base_model_name_or_path": "org/base"}
    raw = (out / "adapter_model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header.pop("__metadata__") == {"format": "pt"}
    # PeftModelForCausalLM.base_model (LoraModel) .model (the *ForCausalLM), modules as transformers names them;
    # lora_A = nn.Linear(in, r) and lora_B = nn.Linear(r, out): weights [r, in] and [out, r].
    D, HE, KE, F, V, r = 32, 32, 16, 64, 100, 4
    io = {"self_attn.q_proj": (D, HE), "self_attn.k_proj": (D, KE), "self_attn.v_proj": (D, KE),
          "self_attn.o_proj": (HE, D), "mlp.gate_proj": (D, F), "mlp.up_proj": (D, F), "mlp.down_proj": (F, D)}
    want = {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight": [r, n_in] if ab == "A" else [n_out, r]
            for i in range(2) for m, (n_in, n_out) in io.items() for ab in "AB"}
    want |= {"base_model.model.lm_head.lora_A.weight": [r, D], "base_model.model.lm_head.lora_B.weight": [V, r]}
    assert {k: v["shape"] for k, v in header.items()} == want
    assert all(v["dtype"] == "F32" for v in header.values())

    # PEFT merges W + (lora_B @ lora_A) * scaling on the torch weights (tuners/lora/layer.py get_delta_weight): that,
    # from the files alone, is our merged checkpoint.
    tensors = read_safetensors(out / "adapter_model.safetensors")
    hf_base = params_to_hf_tensors(jax.device_get(base), CFG)
    hf_merged = params_to_hf_tensors(jax.device_get(merge(base, weights, CFG, LCFG, 1)), CFG)
    for name, w in hf_base.items():
        module = name.removesuffix(".weight")
        a = tensors.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(hf_merged[name], w)  # norms, embedding: untouched
            continue
        peft = w + (tensors[f"base_model.model.{module}.lora_B.weight"] @ a) * LCFG.scale
        np.testing.assert_allclose(hf_merged[name], peft, rtol=1e-6, atol=1e-6)


def test_peft_round_trip_is_bit_exact_and_imports_into_any_slot(tmp_path: Path, base: dict, fresh: dict) -> None:
    weights = _trained(fresh)
    L.export_peft(weights, LCFG, tmp_path / "a", slot=1)
    single, lcfg = L.import_peft(tmp_path / "a", CFG)
    assert lcfg == LCFG.model_copy(update={"slots": 1, "targets": tuple(sorted(ALL))})
    stack = L.put_slot(fresh, LCFG, 0, single, lcfg)
    for (path, got), want, old in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(stack)),
                                      jax.device_get(jax.tree.leaves(weights)), jax.device_get(jax.tree.leaves(fresh)),
                                      strict=True):
        axis = 1 if path[0].key == "layers" else 0
        np.testing.assert_array_equal(np.take(got, 0, axis), np.take(want, 1, axis))  # slot 1 -> slot 0, bit-exact
        np.testing.assert_array_equal(np.take(got, [1, 2], axis), np.take(old, [1, 2], axis))  # others untouched

    # An adapter of lower rank, other alpha and fewer targets fits a slot too: zero-padded, its scale folded into B.
    small_cfg = LoraConfig(rank=2, alpha=6, targets=("q_proj", "down_proj"), slots=1)
    small = _trained(L.init_lora(CFG, small_cfg, jax.random.PRNGKey(3)), seed=4)
    L.export_peft(small, small_cfg, tmp_path / "small")
    stack = L.put_slot(_trained(fresh), LCFG, 2, *L.import_peft(tmp_path / "small", CFG))
    want = _logits(merge(base, small, CFG, small_cfg, 0), stack, NONE, TOKENS)
    np.testing.assert_allclose(_logits(base, stack, jnp.full((6,), 2), TOKENS), want, rtol=1e-5, atol=1e-5)

    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        L.import_peft(tmp_path / "a", CFG)


def test_merged_export_loads_as_the_adapted_model(tmp_path: Path, base: dict, fresh: dict) -> None:
    weights = _trained(fresh)
    L.export_merged(base, weights, CFG, LCFG, tmp_path / "merged", slot=2)
    params, cfg = import_hf(tmp_path / "merged")
    assert cfg.model_copy(update={"family": None}) == CFG
    want = _logits(base, weights, jnp.full((6,), 2), TOKENS)
    np.testing.assert_allclose(_logits(params, weights, NONE, TOKENS), want, rtol=1e-5, atol=1e-5)
    tied = ModelConfig(**{**TINY_MODEL, "tie_embeddings": True})
    with pytest.raises(ValueError, match="tied embeddings"):
        jax.eval_shape(lambda p, w: L.merge(p, w, tied, LCFG), M.abstract_params(tied), L.abstract_lora(tied, LCFG))


def test_slots_are_clipped_on_their_own() -> None:
    rng = np.random.default_rng(0)
    shapes = L.lora_shapes(CFG, LoraConfig(rank=2, targets=ALL, slots=2))
    grads = jax.tree_util.tree_map_with_path(  # slot 0 huge, slot 1 small
        lambda p, s: rng.standard_normal(s).astype(np.float32) * _slot_scale(p, s, np.array([100.0, 0.01])),
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    clipped, _ = jax.jit(L.clip_by_slot_norm(1.0).update)(grads, None)
    np.testing.assert_allclose(L.slot_norms(clipped), [1.0, float(L.slot_norms(grads)[1])], rtol=1e-6)
    for (p, c), g in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(clipped)),
                         jax.device_get(jax.tree.leaves(grads)), strict=True):
        axis = 1 if p[0].key == "layers" else 0
        np.testing.assert_array_equal(np.take(c, 1, axis), np.take(g, 1, axis))  # the small slot is left alone
    one = jax.tree.map(lambda x: 50 * x[:, :1] if x.ndim > 3 else 50 * x[:1], grads)
    for a, b in zip(jax.tree.leaves(jax.jit(L.clip_by_slot_norm(1.0).update)(one, None)[0]),
                    jax.tree.leaves(jax.jit(optax.clip_by_global_norm(1.0).update)(one, None)[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)  # one slot: the global-norm clip


def _slot_scale(path: Any, shape: tuple[int, ...], scale_S: np.ndarray) -> np.ndarray:
    axis = 1 if path[0].key == "layers" else 0
    return scale_S.reshape((1,) * axis + (-1,) + (1,) * (len(shape) - axis - 1)).astype(np.float32)


def test_adapter_steps_reduce_a_cross_entropy_loss(base: dict) -> None:
    lcfg = LoraConfig(rank=4, alpha=8, slots=1)
    weights = L.init_lora(CFG, lcfg, jax.random.PRNGKey(2))
    tokens = jnp.asarray(TOKENS[:2])

    def loss(w: dict) -> jax.Array:
        x, _ = M.forward(base, CFG, tokens, jnp.ones(tokens.shape, bool), adapter=L.adapter(w, jnp.zeros(2, int), lcfg))
        logp = jax.nn.log_softmax(M.logits(base, CFG, x), -1)
        return -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1))

    opt = optax.adam(1e-2)

    @jax.jit
    def step(w: dict, s: Any) -> tuple[dict, Any, jax.Array]:
        value, g = jax.value_and_grad(loss)(w)
        updates, s = opt.update(g, s, w)
        return optax.apply_updates(w, updates), s, value

    state = opt.init(weights)
    losses = []
    for _ in range(25):
        weights, state, value = step(weights, state)
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0], losses


def test_lora_run_on_a_hf_base_trains_only_the_adapters_and_resumes_exactly(tmp_path: Path,
                                                                           tiny_train_dict: dict) -> None:
    model = ModelConfig(**tiny_train_dict.pop("model"))
    export_hf(M.init_params(model, jax.random.PRNGKey(5)), model, tmp_path / "hf")
    hf_base, _ = import_hf(tmp_path / "hf")
    tiny_train_dict["init"] = {"from": "hf", "path": str(tmp_path / "hf")}
    tiny_train_dict["rl"]["kl_beta"] = 0.05  # the reference policy is the base model, no copy of it
    tiny_train_dict["lora"] = {"rank": 4, "alpha": 16, "targets": ["q_proj", "o_proj", "down_proj", "lm_head"],
                               "slots": 2}  # the digits task names no lora_slot: every row trains slot 0
    tiny_train_dict["eval"] = {"prompts": 2, "samples": 2}  # after the last step
    run = lambda d, **kw: train(config_from_dict({**tiny_train_dict, "run_dir": str(tmp_path / d), "steps": 3}), **kw)  # noqa: E731

    straight = run("a")  # on the 2 x 2 x 2 mesh of all 8 devices
    assert run("b", stop_after=1).stopped_early
    resumed = run("b")
    assert [r["step"] for r in resumed.records] == [1, 2]
    for a, b in zip(jax.tree.leaves(straight.params["lora"]), jax.tree.leaves(resumed.params["lora"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert straight.records[0]["kl"] == pytest.approx(0.0, abs=1e-6) and straight.records[-1]["kl"] > 0
    # The held-out eval ran on the adapters; `eval` on the checkpoint (config.yaml of an hf run: the model read from
    # init.path again, the base checked against the adapters') repeats its scores.
    from trainer.run.eval_cli import main as eval_main

    logged = {k: v for k, v in straight.records[-1].items() if k.startswith("eval/")}
    assert {"eval/greedy_reward", "eval/pass_at_2"} <= set(logged) and logged == {
        k: v for k, v in resumed.records[-1].items() if k.startswith("eval/")}
    assert eval_main([str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "eval" / "step-3.json").read_text())["scores"] == logged

    # The base is frozen; slot 0 trained; slot 1, which no row used, is still a fresh adapter (B = 0).
    for a, b in zip(jax.tree.leaves(hf_base), jax.tree.leaves(straight.params["base"]), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    lora = straight.params["lora"]
    b_wq = np.asarray(lora["layers"]["wq"]["b"])
    assert b_wq[:, 0].any() and not b_wq[:, 1].any()
    # The adapters shard like the weights they adapt (their in/out dims), slots and rank replicated.
    specs = jax.tree.map(lambda x: x.sharding.spec, lora)
    assert specs["layers"]["wq"] == {"a": P(None, None, "fsdp", None), "b": P(None, None, None, "tensor", None)}
    assert specs["layers"]["wo"] == {"a": P(None, None, "tensor", None, None), "b": P(None, None, None, "fsdp")}
    assert specs["layers"]["w_down"] == {"a": P(None, None, "tensor", None), "b": P(None, None, None, "fsdp")}
    assert specs["lm_head"] == {"a": P(None, "fsdp", None), "b": P(None, None, "tensor")}

    # The checkpoint holds the adapters, their optimizer state (Adam's two moments: nothing base-sized) and the
    # base's checksums, not the base.
    saved = ocp.StandardCheckpointHandler().metadata(tmp_path / "b" / "checkpoints" / "3" / "state")
    saved = jax.tree.map(lambda x: x.shape, dict(saved), is_leaf=lambda x: hasattr(x, "shape"))
    assert set(saved) == {"base_checksums", "lora", "opt_state"}
    lora_shapes = sorted(x.shape for x in jax.tree.leaves(lora))
    assert sorted(s for s in jax.tree.leaves(saved["opt_state"], is_leaf=lambda x: isinstance(x, tuple)) if s) == \
        sorted(lora_shapes * 2)

    # A finished run leaves each slot as a PEFT adapter, naming the base it was trained on.
    single, lcfg = L.import_peft(tmp_path / "a" / "adapters" / "slot-0", model)
    assert lcfg.scale == 4.0 and (tmp_path / "a" / "adapters" / "slot-1" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "a" / "adapters" / "slot-0" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(tmp_path / "hf")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(single), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(a, np.take(np.asarray(b), [0], 1 if path[0].key == "layers" else 0))
    # Resuming the adapters onto other base weights is refused.
    export_hf(M.init_params(model, jax.random.PRNGKey(6)), model, tmp_path / "hf")
    with pytest.raises(ConfigError, match="other base weights"):
        run("b", stop_after=1)


@pytest.mark.parametrize("rslora", [False, True])
def test_one_scale_for_a_config_and_a_service_slot(rslora: bool) -> None:
    # PEFT's scale (alpha / r, alpha / sqrt(r) with rslora); a service slot kept by its scale gets the same config
    # back (programs.slot_config). Rank 2921 is one where math.sqrt and **0.5 differ in the last bit.
    from trainer.service.programs import slot_config

    for rank, alpha in ((16, 4.0), (7, 3.0), (2921, 5.0)):
        want = alpha / (rank**0.5 if rslora else rank)
        assert lora_scale(alpha, rank, rslora) == want == LoraConfig(rank=rank, alpha=alpha, rslora=rslora).scale
        stack = LoraConfig(rank=rank, alpha=1.0, rslora=rslora, slots=2)
        assert slot_config(stack, want).scale == pytest.approx(want, rel=1e-15)
        assert lora_alpha(want, rank, rslora) == pytest.approx(alpha, rel=1e-15)


def test_config_and_each_rows_slot() -> None:
    from trainer.rl.task_data import row_slots
    from trainer.rl.tasks import Example

    base = {"model": dict(TINY_MODEL), "sampling": {"max_new_tokens": 4, "max_prompt_len": 8}}
    assert config_from_dict({**base, "lora": {}}).lora == LoraConfig()  # PEFT's defaults: r 8, alpha 8
    assert LoraConfig().targets == ALL[:-1] and LoraConfig(rank=16, alpha=4, rslora=True).scale == 1.0
    with pytest.raises(ConfigError, match="names a module twice"):
        config_from_dict({**base, "lora": {"targets": ["q_proj", "q_proj"]}})
    with pytest.raises(ConfigError, match=r"lora\.targets"):
        config_from_dict({**base, "lora": {"targets": ["wq"]}})
    # A prompt's rows train the slot its example names (a task's lora_slot field), else slot 0; -1 is the base.
    examples = {0: Example("a", {"lora_slot": 2}), 1: Example("b", {}), 2: Example("c", {"lora_slot": -1})}
    rows = [(r // 2, examples[r // 2]) for r in range(6)]
    assert row_slots(rows, 3).tolist() == [2, 2, 0, 0, -1, -1]
    with pytest.raises(ConfigError, match="example 0: lora_slot=3"):
        row_slots([(0, Example("a", {"lora_slot": 3}))], 3)
