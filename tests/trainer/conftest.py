"""Trainer tests run on 8 virtual CPU devices; this must happen before anything touches a JAX backend."""

import jax
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: multi-process / end-to-end trainer runs (still run by default)")


TINY_MODEL = {
    "vocab_size": 100,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 8,
    "d_ff": 64,
    "rope_theta": 10000.0,
    "norm_eps": 1e-6,
    "qk_norm": True,
    "tie_embeddings": False,
    "param_dtype": "float32",
    "max_seq_len": 16,
}


def tiny_train_config(run_dir: object, **top: object) -> dict:
    """A small but complete train config (digits task, 2x2x2 mesh, 2 steps) as a plain dict; `top` overrides
    top-level keys."""
    return {
        "model": dict(TINY_MODEL),
        "mesh": {"slices": 2, "fsdp": 2, "tensor": 2},
        "task": {"name": "digits"},
        "rl": {"group_size": 4, "prompts_per_step": 2, "mu_iterations": 2, "kl_beta": 0.0},
        "sampling": {"max_new_tokens": 6, "max_prompt_len": 8, "temperature": 1.0},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "steps": 2,
        "seed": 0,
        "run_dir": str(run_dir),
        "checkpoint": {"every": 0, "keep": 2},
        "progress": False,
        **top,
    }


@pytest.fixture
def tiny_train_dict(tmp_path: object) -> dict:
    return tiny_train_config(tmp_path)
