"""`gke-tpu-rl fit` with a `lora:` section: the state is base + adapters, and the optimizer state, the gradient and the
FLOPs of the backward pass are the adapters' (trainer/fit/estimate.py); the compiled programs agree (a small model on
v6e 2x2, a few seconds per compile)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import jax
import pytest

from trainer.base.config import LoraConfig, config_from_dict, load_config, resolve_mesh
from trainer.fit import estimate as E
from trainer.fit import preflight as F
from trainer.fit.advice import with_settings
from trainer.model.lora import lora_axes, lora_shapes
from trainer.model.sharding import logical_to_spec

GiB = 1 << 30
V6E_2X2 = F.Target("v6e", "2x2", 1, 4, 32 * GiB, 918e12, 1638e9)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
# Every dim a multiple of 128 (the rank too): TPU layouts pad a minor dim to 128, which for smaller adapters would
# outweigh them in the compiled argument sizes.
SMALL = {"vocab_size": 512, "d_model": 256, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 128,
         "d_ff": 512, "max_seq_len": 64, "qk_norm": True, "tie_embeddings": False, "param_dtype": "float32"}
LORA = {"rank": 128, "alpha": 128, "slots": 2, "targets": ALL}


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _adapters(m: Any, lcfg: LoraConfig, mesh_shape: dict[str, int]) -> tuple[int, float]:
    """(parameters, parameters one device holds) of the adapter stack, straight from trainer/model/lora.py's shapes and
    logical axes through trainer/model/sharding.py's rule table."""
    mesh = SimpleNamespace(shape=mesh_shape)
    shapes = jax.tree.leaves(lora_shapes(m, lcfg), is_leaf=_is_shape)
    axes = jax.tree.leaves(lora_axes(m, lcfg), is_leaf=lambda x: isinstance(x, tuple))
    total, per_device = 0, 0.0
    for shape, names in zip(shapes, axes, strict=True):
        spec = logical_to_spec(names, shape, mesh)  # type: ignore[arg-type]
        split = [math.prod(mesh_shape[a] for a in ((s,) if isinstance(s, str) else s or ())) for s in spec]
        total += math.prod(shape)
        per_device += math.prod(d / k for d, k in zip(shape, split, strict=True))
    return total, per_device


def _qwen3_8b(lora: dict[str, Any] | None = None) -> Any:
    """The bundled Qwen3-8B GRPO config on v6e 4x4 (float32 master weights), optionally with lora, pinned to fsdp 4 x
    tensor 4 with micro-batches of 64 (the config's layout before session 8: gradients accumulate, heads split)."""
    pinned = ["mesh.tensor=4", "compute.train_micro_batch_size=64"]
    cfg = load_config("qwen3-8b-grpo-v6e-4x4.yaml", pinned + ([f"lora={lora}"] if lora is not None else []))
    cfg, _ = F.resolve_model(cfg)
    return resolve_mesh(cfg, 16, exact=True)


def test_lora_estimate_optimizer_and_gradients_are_the_adapters_alone() -> None:
    full, lora = _qwen3_8b(), _qwen3_8b({"rank": 32, "alpha": 32})
    m = full.model_cfg
    assert m.param_dtype == "float32" and full.micro_batch_rows < full.minibatch_rows  # accumulates micro-batches
    n = F.param_count(m)
    dense, adapted = E.state(full), E.state(lora)
    # Full fine-tuning: Adam's two float32 moments of all ~8.2 B weights, over 16 chips; gradient and accumulator too.
    assert dense.optimizer == pytest.approx(n * 2 * 4 / 16, rel=1e-6)
    assert dense.gradients == dense.accumulator == dense.base == pytest.approx(n * 4 / 16)
    assert dense.adapters == 0
    # LoRA rank 32 on the 7 linear targets: the base stays (frozen), the adapters are added, and the optimizer state,
    # gradient and accumulator are the adapters' alone.
    count, per_device = _adapters(m, lora.lora, {"slices": 1, "fsdp": 4, "tensor": 4})
    # 36 layers x rank 32 x (in + out of q, k, v, o, gate, up, down: 8192 + 2 x 5120 + 8192 + 3 x 16384)
    assert E.lora_param_count(m, lora.lora) == count == 36 * 32 * 75_776 == 87_293_952
    assert adapted.base == dense.base and adapted.adapters == per_device * 4 == pytest.approx(count * 4 / 4)
    assert adapted.weights == adapted.base + adapted.adapters
    assert adapted.optimizer == pytest.approx(2 * 4 * per_device, abs=64)  # + optax's step counts: a few bytes
    assert adapted.gradients == adapted.accumulator == per_device * 4
    assert adapted.reference == 0  # with lora the reference policy is the base inside the params
    # What the estimate shows: ~3.8 GiB of Adam state per chip become ~0.16 GiB.
    assert dense.optimizer / GiB == pytest.approx(3.81, abs=0.01)
    assert adapted.optimizer / GiB == pytest.approx(0.163, abs=0.001)
    # The update's estimated memory: state and temporaries both shrink by exactly those differences.
    full_mem, lora_mem = E.memory(full, "update"), E.memory(lora, "update")
    assert full_mem.state - lora_mem.state == pytest.approx(
        (dense.optimizer - adapted.optimizer) - adapted.adapters, rel=1e-9)
    assert lora_mem.temp < full_mem.temp


def test_lora_estimate_counts_every_slot_and_the_compute_dtype_state() -> None:
    cfg = _qwen3_8b({"rank": 16, "alpha": 16, "slots": 4, "targets": ALL})
    count, per_device = _adapters(cfg.model_cfg, cfg.lora, {"slices": 1, "fsdp": 4, "tensor": 4})
    st = E.state(cfg)
    assert st.adapters == per_device * 4 and st.optimizer == pytest.approx(8 * per_device, abs=64)
    bf16 = resolve_mesh(with_settings(cfg, ["compute.param_dtype=bfloat16"]), 16, exact=True)
    st16 = E.state(bf16)
    assert st16.adapters == per_device * 2 and st16.optimizer == pytest.approx(4 * per_device, abs=64)  # bf16 moments


def test_lora_flops_add_the_adapters_and_drop_the_frozen_weights_gradient() -> None:
    full, lora = _qwen3_8b(), _qwen3_8b({"rank": 32, "alpha": 32})
    dense, adapted = F.step_flops(full), F.step_flops(lora)
    # The backward pass computes the activations' gradient through the frozen weights, not theirs: about a third of
    # the update's matmul FLOPs go, the adapters' (rank 32, one slot) add ~1%.
    assert 0.6 < adapted.executed["update"] / dense.executed["update"] < 0.8
    assert 0.6 < adapted.model["update"] / dense.model["update"] < 0.75
    assert dense.executed["sample"] < adapted.executed["sample"] < 1.02 * dense.executed["sample"]
    assert adapted.executed["ref_logprobs"] == dense.executed["ref_logprobs"]  # the reference is the base alone
    # Every slot of the stack is computed (masked per row): 16 slots cost 16 x the adapters' FLOPs.
    many = _qwen3_8b({"rank": 32, "alpha": 32, "slots": 16})
    extra_one = F.step_flops(lora).executed["sample"] - dense.executed["sample"]
    extra_16 = F.step_flops(many).executed["sample"] - dense.executed["sample"]
    assert extra_16 == pytest.approx(16 * extra_one)


def _small(lora: dict[str, Any] | None, **sections: Any) -> Any:
    d: dict[str, Any] = {"model": SMALL, "mesh": {"slices": 1, "fsdp": -1, "tensor": 1},
                         "rl": {"group_size": 4, "prompts_per_step": 4, "mu_iterations": 1, "kl_beta": 0.05},
                         "sampling": {"max_new_tokens": 8, "max_prompt_len": 24}, **sections}
    if lora is not None:
        d["lora"] = lora
    return config_from_dict(d)


@pytest.fixture(scope="module")
def compiled() -> tuple[F.FitReport, F.FitReport]:
    """The same small config fully trained and with lora (every target, 2 slots), every loop once but decoding.
    Memory and FLOPs only: the programs' timing compiles (phases) are left out."""
    return (F.fit(_small(None), V6E_2X2, title="full", phases=False),
            F.fit(_small(LORA), V6E_2X2, title="lora", phases=False))


def test_compiled_lora_programs_hold_base_plus_adapters_and_adapter_state(
        compiled: tuple[F.FitReport, F.FitReport]) -> None:
    full, lora = (dict((p.name, p) for p in r.programs) for r in compiled)
    cfg = resolve_mesh(_small(LORA), 4, exact=True)
    st = E.state(cfg)
    _, per_device = _adapters(cfg.model_cfg, cfg.lora, {"slices": 1, "fsdp": 4, "tensor": 1})
    assert st.adapters == per_device * 4
    # The update takes (and donates) base + adapters + the adapters' Adam state, and a batch of a few KiB.
    held = st.weights + st.optimizer
    assert held <= lora["update"].argument <= held + 64 * 1024
    assert held <= lora["update"].alias + 64 * 1024
    dense = E.state(resolve_mesh(_small(None), 4, exact=True))
    assert dense.weights + dense.optimizer <= full["update"].argument <= dense.weights + dense.optimizer + 64 * 1024
    # Resident: the adapters' optimizer state while sampling and computing reference log-probs; the reference policy
    # is the base inside the params, so no copy of the weights anywhere (rl.kl_beta > 0 here).
    assert lora["sample"].resident == lora["ref_logprobs"].resident == pytest.approx(st.optimizer, abs=64)
    assert lora["update"].resident == 0
    assert full["update"].resident == pytest.approx(dense.base, rel=0.05)  # the full run keeps a reference copy
    assert compiled[1].fits and compiled[1].state is not None and compiled[1].state.lora is not None
    line = compiled[1].headline()[-1]
    assert line.startswith("training state per chip (estimated): base weights ") and "(frozen) + lora adapters" in line
    assert line.endswith(": of the adapters alone")
    assert compiled[0].headline()[-1].startswith("training state per chip (estimated): weights ")


def test_compiled_lora_flops_match_the_analytic_count(compiled: tuple[F.FitReport, F.FitReport]) -> None:
    """Where loops run once (1 layer, mu 1, one minibatch, one log-prob chunk) the compiler counts what the program
    executes: the adapters for every slot, no gradient of the frozen weights."""
    full, lora = (dict((p.name, p) for p in r.programs) for r in compiled)
    for p in (full["update"], lora["update"], lora["ref_logprobs"]):
        assert p.compiler_flops == pytest.approx(p.flops, rel=0.08), p.name
    cfg = resolve_mesh(_small(LORA), 4, exact=True)
    flops = F.step_flops(cfg)
    assert lora["sample"].compiler_flops == pytest.approx(cfg.batch_size * (flops.prefill_row + flops.decode_row),
                                                          rel=0.08)
