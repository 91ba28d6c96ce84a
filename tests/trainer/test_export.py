"""`gke-tpu-rl export` against transformers and PEFT: a run folder (a full-weights char model; a LoRA run on the tiny
Qwen3 fixture with its tokenizer) is exported, loaded with `AutoModelForCausalLM.from_pretrained` (and
`PeftModel.from_pretrained` for the adapter), and gives our model's logits and our sampler's greedy tokens.

The run folders are written by the trainer's own code (`write_run_config`, `saved_state`, `Checkpointer`) without a
training compile; tests/test_docs_commands.py exports a run the README's command trained, end to end."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from tests.tiny_model import FIXTURE
from tests.trainer.conftest import tiny_train_config
from trainer.base.config import ModelConfig, TrainConfig, config_from_dict, with_model
from trainer.model import decoder as M
from trainer.model import lora as L
from trainer.model.hf import import_hf, read_checkpoint_tensors
from trainer.rl.checkpoint import Checkpointer, Meta, checksums
from trainer.rl.optim import make_optimizer
from trainer.rl.sampler import sample
from trainer.rl.train import saved_state, write_run_config
from trainer.run import export as E

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Tolerance of the import tests against transformers (tests/trainer/test_lora_peft.py).
ATOL, RTOL = 2e-4, 1e-4


def _noisy(tree: Any, seed: int, scale: float) -> Any:
    """A tree moved away from where it started, as training moves it."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype), tree)


def _save_run(run_dir: Path, cfg: TrainConfig, steps: dict[int, Any], base: Any = None) -> None:
    """A run folder as train() leaves it: config.yaml, and per step the state a checkpoint holds (with lora: the
    adapters, not the base, and the base's checksums)."""
    run_dir.mkdir(parents=True)
    write_run_config(run_dir, cfg)
    ckpt = Checkpointer(run_dir / "checkpoints", every=0, keep=5, async_save=False)
    sums = None if cfg.lora is None else jnp.asarray(np.asarray(checksums(base), np.uint32))
    for step, trained in steps.items():
        opt_state = jax.jit(make_optimizer(cfg.optim, cfg.steps).init)(trained)
        params = trained if cfg.lora is None else {"base": base, "lora": trained}
        ckpt.save(saved_state(params, opt_state, cfg.lora, sums), Meta(step, step * cfg.rl.prompts_per_step, [0, 7]))
    ckpt.close()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig, dict[int, Any]]:
    """Steps 1 and 2 of a random-init char model (the README demo's tokenizer)."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    cfg = config_from_dict(tiny_train_config(run_dir, steps=2))
    start = jax.jit(M.init_params, static_argnums=0)(cfg.model_cfg, jax.random.PRNGKey(0))
    steps = {1: _noisy(start, 1, 0.02), 2: _noisy(start, 2, 0.05)}
    _save_run(run_dir, cfg, steps)
    return run_dir, cfg.model_cfg, steps


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainConfig, Any]:
    """A LoRA run on the tiny Qwen3 fixture (its tokenizer too), adapters on attention, MLP and lm_head."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    data = tiny_train_config(run_dir, init={"from": "hf", "path": str(FIXTURE)}, tokenizer=str(FIXTURE),
                             lora={"rank": 4, "alpha": 16, "targets": ["q_proj", "o_proj", "down_proj", "lm_head"]})
    del data["model"]  # read from the checkpoint, as train() does
    base, model = import_hf(FIXTURE)
    cfg = with_model(config_from_dict(data), model)
    assert cfg.lora is not None
    fresh = jax.jit(L.init_lora, static_argnums=(0, 1))(cfg.model_cfg, cfg.lora, jax.random.PRNGKey(3))
    # B starts at 0; a trained one is not (the merge and the adapter must change the logits).
    trained = {"layers": {k: {"a": ab["a"], "b": _noisy(ab["b"], 4, 0.05)} for k, ab in fresh["layers"].items()},
               "lm_head": {"a": fresh["lm_head"]["a"], "b": _noisy(fresh["lm_head"]["b"], 5, 0.05)}}
    _save_run(run_dir, cfg, {3: trained}, jax.tree.map(jnp.asarray, base))
    return run_dir, cfg, trained


def _export(tmp_path: Path, run: Path | str, *flags: str, name: str = "out") -> tuple[int, Path]:
    out = tmp_path / name
    return E.main([str(run), "--out", str(out), *flags]), out


def _hf(out: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def _their_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()


@functools.partial(jax.jit, static_argnums=1)
def _logits(params: Any, cfg: ModelConfig, t: jax.Array, adapter: Any) -> jax.Array:
    x, _ = M.forward(params, cfg, t, jnp.ones(t.shape, bool), adapter=adapter)
    return M.logits(params, cfg, x, adapter)


def _our_logits(params: Any, cfg: ModelConfig, tokens: np.ndarray, adapter: Any = None) -> np.ndarray:
    # One compiled program per model (eager, each op would compile on its own).
    return np.asarray(_logits(jax.tree.map(jnp.asarray, params), cfg, jnp.asarray(tokens[None], jnp.int32),
                              adapter))[0]


def _check_greedy(model: Any, params: Any, cfg: ModelConfig, prompt: list[int], eos: int, pad: int,
                  adapter: Any = None) -> None:
    """transformers' greedy generate (with the exported generation_config.json: eos, pad) equals our sampler at
    temperature 0, EOS included where it came."""
    n = 6
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()
        # Every choice wins by a margin far above fp32 rounding, so a mismatch is a real difference.
        logits = model(torch.tensor([prompt + theirs])).logits[0, len(prompt) - 1:-1]
        top2 = torch.topk(logits, 2).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
    greedy = jax.jit(functools.partial(sample, cfg=cfg, max_new_tokens=n, eos_id=eos, pad_id=pad, temperature=0.0))
    out = greedy(jax.tree.map(jnp.asarray, params), prompt_BP=jnp.asarray([prompt], jnp.int32),
                 prompt_valid_BP=jnp.ones((1, len(prompt)), bool), key=jax.random.key(0), adapter=adapter)
    ours = np.asarray(out.tokens_BN)[0][np.asarray(out.mask_BN)[0].astype(bool)].tolist()
    assert ours == theirs and len(ours) > 1


def test_full_weights_run_exports_what_transformers_loads_with_our_logits_and_greedy_tokens(
        tmp_path: Path, full_run: tuple[Path, ModelConfig, dict[int, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, cfg, steps = full_run
    code, out = _export(tmp_path, run_dir)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "built-in char tokenizer" in err and "CharTokenizer" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])  # QK-norm: qwen3
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # the char tokenizer's
    assert json.loads((out / "generation_config.json").read_text()) == ids
    assert {k: config[k] for k in ids} == ids
    model = _hf(out)
    params = jax.device_get(steps[2])  # the newest step by default
    tokens = np.array([1, 84, 73, 84, 4, 27, 30, 5, 9, 40, 41, 2], np.int64)
    ours = _our_logits(params, cfg, tokens)
    np.testing.assert_allclose(_their_logits(model, tokens), ours, atol=ATOL, rtol=RTOL)
    _check_greedy(model, params, cfg, [1, 84, 73, 84, 4, 27, 30], eos=2, pad=0)
    # --step picks another step.
    code, older = _export(tmp_path, run_dir, "--step", "1", name="step1")
    assert code == 0
    np.testing.assert_allclose(_their_logits(_hf(older), tokens), _our_logits(jax.device_get(steps[1]), cfg, tokens),
                               atol=ATOL, rtol=RTOL)
    assert not np.allclose(_our_logits(jax.device_get(steps[1]), cfg, tokens), ours, atol=1e-3)


def test_lora_run_exports_merged_and_as_adapter(tmp_path: Path, lora_run: tuple[Path, TrainConfig, Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, cfg, lora = lora_run
    lcfg = cfg.lora
    assert lcfg is not None
    base, model_cfg = import_hf(FIXTURE)
    tok = transformers.AutoTokenizer.from_pretrained(FIXTURE)
    tokens = np.asarray(tok("rep 7: 777 and 12 + 30 = 42")["input_ids"], np.int64)
    adapter = L.adapter(jax.tree.map(jnp.asarray, lora), jnp.zeros((1,), jnp.int32), lcfg)
    ours = _our_logits(base, model_cfg, tokens, adapter)
    assert not np.allclose(_our_logits(base, model_cfg, tokens), ours, atol=1e-2), "the adapter changes the logits"

    # Merged (the default for a LoRA run): a full checkpoint with the base's config keys, its generation config and
    # the run's tokenizer.
    code, out = _export(tmp_path, run_dir, name="merged")
    assert code == 0, capsys.readouterr().err
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names and "adapter_config.json" not in names
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (FIXTURE / name).read_bytes(), name
    base_config = json.loads((FIXTURE / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == base_config["eos_token_id"]
    model = _hf(out)
    np.testing.assert_allclose(_their_logits(model, tokens), ours, atol=ATOL, rtol=RTOL)
    assert transformers.AutoTokenizer.from_pretrained(out)("rep 7:")["input_ids"] == tok("rep 7:")["input_ids"]
    eos = base_config["eos_token_id"]
    _check_greedy(model, base, model_cfg, tok("rep 7:")["input_ids"], eos=eos, pad=eos, adapter=adapter)
    # The same with --lora merged spelled out.
    assert _export(tmp_path, run_dir, "--lora", "merged", name="merged2")[0] == 0
    assert read_checkpoint_tensors(tmp_path / "merged2").keys() == read_checkpoint_tensors(out).keys()

    # As a PEFT adapter on the base model.
    code, out = _export(tmp_path, run_dir, "--lora", "adapter", name="adapter")
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = peft.PeftModel.from_pretrained(_hf(FIXTURE), out).eval()
    np.testing.assert_allclose(_their_logits(peft_model, tokens), ours, atol=ATOL, rtol=RTOL)

    # Other base weights than the run's are refused, naming the flag; so is a slot the run does not have.
    from trainer.model.hf import export_hf

    other = export_hf(_noisy(base, 6, 0.01), model_cfg, tmp_path / "other-base", source_dir=FIXTURE)
    assert _export(tmp_path, run_dir, "--base", str(other), name="refused")[0] == 2
    assert "not the one this run trained its adapters on" in capsys.readouterr().err
    assert _export(tmp_path, run_dir, "--slot", "1", name="refused")[0] == 2
    assert "--slot 1: this run's adapters have slots 0..0" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())


def test_errors_name_the_flag_and_what_is_there(tmp_path: Path, full_run: tuple[Path, ModelConfig, Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = full_run[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    no_ckpt = tmp_path / "no-ckpt"
    no_ckpt.mkdir()
    shutil.copy(run / "config.yaml", no_ckpt / "config.yaml")
    cases: list[tuple[list[str], str]] = [
        ([str(run), "--step", "7"], f"--step 7: no finished checkpoint step 7 in {run / 'checkpoints'}; the steps "
         "there: 1, 2"),
        ([str(run), "--lora", "merged"], "--lora merged: this run trained full weights"),
        ([str(run), "--lora", "adapter"], "--lora adapter: this run trained full weights"),
        ([str(tmp_path / "nowhere")], "no such folder"),
        ([str(empty)], "neither a run folder (no config.yaml) nor a checkpoint folder"),
        ([str(no_ckpt)], f"no checkpoint: no step folder in {no_ckpt / 'checkpoints'}"),
    ]
    for argv, message in cases:
        assert E.main([*argv, "--out", str(tmp_path / "x")]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not (tmp_path / "x").exists()  # nothing written on an error
    # A non-empty --out is refused before anything is read.
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert E.main([str(run), "--out", str(tmp_path / "x")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_the_checkpoint_folder_and_a_pods_layout_both_find_the_run(
        tmp_path: Path, full_run: tuple[Path, ModelConfig, Any]) -> None:
    run_dir = full_run[0]
    # A local run: RUN/checkpoints/<step>; given the checkpoint folder, the config is found beside it.
    assert E.find_run(str(run_dir / "checkpoints")).steps == [1, 2]
    # A pod's: <bucket>/<name>/<step> with the run folder <bucket>/<name>/run, whose config names pod paths.
    bucket = tmp_path / "bucket"
    shutil.copytree(run_dir / "checkpoints", bucket / "grpo")
    (bucket / "grpo" / "run").mkdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["run_dir"] = "/checkpoints/grpo/run"
    (bucket / "grpo" / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    for given in (bucket / "grpo", bucket / "grpo" / "run"):
        run = E.find_run(str(given))
        assert (str(run.checkpoints), run.steps) == (str(bucket / "grpo"), [1, 2])
    # A path the pod's config names is looked up where the bucket is now.
    (bucket / "models" / "m").mkdir(parents=True)
    got = E.relocated("/checkpoints/models/m", "/checkpoints/grpo/run", E.epath.Path(str(bucket / "grpo" / "run")))
    assert str(got) == str(bucket / "models" / "m")
    assert E.moved_path("/checkpoints/models/m", "/checkpoints/grpo/run", "gs://b/grpo/run") == "gs://b/models/m"
    assert E.moved_path("/elsewhere/m", "/checkpoints/grpo/run", "gs://b/grpo/run") is None
    assert E.moved_path("tok", "runs/my-1", "/home/u/runs/my-1") == "/home/u/tok"  # relative to where it trained


def test_a_bucket_path_without_gcs_support_says_what_to_install(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    if E.gcs_readable():
        pytest.skip("gcsfs is installed: reading gs:// would reach the network")
    assert E.main(["gs://acme-rl-qa-qa-checkpoints/grpo/run", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "gs://acme-rl-qa-qa-checkpoints/grpo/run" in err and "pip install gcsfs" in err


def test_a_lora_run_on_a_random_base_merges_into_the_base_the_run_built(tmp_path: Path) -> None:
    # The run's own programs build the base and fresh adapters from the seed (step.py's init_params, as train() calls
    # it); the export rebuilds that base on its own and must pass the checkpoint's checksum check.
    from trainer.base.config import resolve_mesh
    from trainer.model.sharding import make_mesh
    from trainer.rl.batch import replicate
    from trainer.rl.step import build_programs

    run_dir = tmp_path / "run"
    cfg = config_from_dict(tiny_train_config(run_dir, seed=11, mesh={"slices": 1, "fsdp": 1, "tensor": 1},
                                             lora={"rank": 2, "alpha": 4, "targets": ["q_proj", "up_proj"]}))
    cfg = resolve_mesh(cfg, 1)
    assert cfg.lora is not None
    mesh = make_mesh(1, 1, 1, jax.devices()[:1])
    programs = build_programs(cfg, mesh, 0, 2)
    with jax.set_mesh(mesh):
        params = programs.init_params(replicate(mesh, np.asarray(jax.random.key_data(jax.random.PRNGKey(cfg.seed)))))
    base = jax.device_get(params["base"])
    lora = _noisy(jax.device_get(params["lora"]), 7, 0.05)
    _save_run(run_dir, cfg, {1: lora}, params["base"])
    code, out = _export(tmp_path, run_dir)
    assert code == 0  # the rebuilt base passed the checksum check
    # The targets' weights moved by the merge (test_lora_run_exports_merged_and_as_adapter checks the merge against
    # transformers); the others are the base's, bit for bit.
    merged, _ = import_hf(out)
    assert not np.allclose(merged["layers"]["wq"], base["layers"]["wq"], atol=1e-4)
    assert not np.allclose(merged["layers"]["w_up"], base["layers"]["w_up"], atol=1e-4)
    for key in ("wk", "wv", "wo", "w_gate", "w_down"):
        np.testing.assert_array_equal(merged["layers"][key], base["layers"][key])
