"""One side of `bench.tunix_side_by_side`, in its own process: build the GRPO update step, compile it, time it.

    python -m bench.tunix_worker --side ours|tunix --mesh 1|2x2 [--cases kl,nokl] [--steps 5]   # one shot
    python -m bench.tunix_worker --side ours|tunix --mesh 1|2x2 --serve                          # driven

`--side ours` runs in our venv and times `trainer.rl.step.build_programs(...).update`, the program `trainer.rl.train`
runs. `--side tunix` runs in the venv holding google-tunix 0.1.7 and times the jitted train step of the actor trainer of
a Tunix `RLCluster` with the loss its `GRPOLearner` installs (`algo_core.grpo_loss_fn`): the function
`PeftTrainer.train` gets from `jit_train_and_eval_step(skip_jit=False, cache_nnx_graph=True)` and calls once per
micro-batch, on the example after `sharding_utils.shard_input`. Only the standard library, jax, numpy and optax are
imported at the top, so one file serves both venvs; each side imports its own library.

Both sides load the same weights (`shared_weights`, numpy, our layout; Tunix's Qwen3 initialises its MLP to zeros,
which would make its MLP gradients 0) and the same batch, so the first step's gradient norms must agree: the
side-by-side prints them as a check that the two compute the same model and loss.

Every step is timed as wall seconds of the call, blocked until its outputs (an updated weight included) are ready,
and as CPU seconds of the process (all its threads) over the same span.
With --serve, the worker builds and compiles every case, prints one line `@@ {json}` (compile seconds, first step's
loss and gradient norm per case), then answers each stdin line `run CASE N` with `@@ {json}` holding N step times
(wall and CPU); `quit` ends it. The side-by-side drives two such workers alternately.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The workload, identical on both sides. A tiny Qwen3: GQA, QK-norm, tied embeddings, fp32 weights, RoPE base 1e6
# (Tunix's Qwen3 attention always uses 1e6, whatever its config says).
MODEL: dict[str, Any] = {"vocab_size": 128, "d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
                         "head_dim": 32, "d_ff": 768, "rope_theta": 1_000_000, "norm_eps": 1e-6}
ROWS, PROMPT_LEN, NEW_TOKENS, GROUP = 16, 32, 96, 8
LR, CLIP_NORM, B1, B2 = 1e-6, 1.0, 0.9, 0.999
STEPS_PLANNED = 1000  # the cosine schedule's length
CLIP_EPS = 0.2  # both clip bounds (Tunix's GRPOConfig has one epsilon)
KL_BETA = 0.04  # Tunix's GRPOConfig default; the k3 estimator ("low_var_kl") on both sides
PAD_ID, EOS_ID, FIRST_TOKEN = 0, 2, 4
CASES = {"kl": KL_BETA, "nokl": 0.0}
PROTOCOL = "@@ "

# One update; returns {"loss", "grad_norm", "weight"}: arrays the step's program outputs (weight: the updated embedding,
# one of its outputs, so waiting on it waits for the new weights; taking the whole state tree would add ~25 ms of
# Python per call on Tunix's side, nnx.state walking the module graph, that its train loop does not spend).
Step = Callable[[], dict[str, Any]]


def workload_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The same random batch for both sides: every token real (no padding); one reward per row."""
    rng = np.random.default_rng(seed)
    V = MODEL["vocab_size"]
    return {
        "prompt": rng.integers(FIRST_TOKEN, V, (ROWS, PROMPT_LEN), dtype=np.int32),
        "completion": rng.integers(FIRST_TOKEN, V, (ROWS, NEW_TOKENS), dtype=np.int32),
        "rewards": rng.uniform(size=(ROWS,)).astype(np.float32),
    }


def shared_weights(seed: int = 1) -> dict[str, Any]:
    """The weights both sides start from, in our layout (trainer/model/decoder.py param_shapes): matrices ~ N(0,
    1/fan_in), norm scales 1."""
    rng = np.random.default_rng(seed)
    L, D, H, K, E, F, V = (MODEL[k] for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                                               "vocab_size"))

    def normal(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    layers = {
        "attn_norm": np.ones((L, D), np.float32), "wq": normal((L, D, H, E), D), "wk": normal((L, D, K, E), D),
        "wv": normal((L, D, K, E), D), "wo": normal((L, H, E, D), H * E), "mlp_norm": np.ones((L, D), np.float32),
        "w_gate": normal((L, D, F), D), "w_up": normal((L, D, F), D), "w_down": normal((L, F, D), F),
        "q_norm": np.ones((L, E), np.float32), "k_norm": np.ones((L, E), np.float32),
    }
    return {"embed": normal((V, D), D), "layers": layers, "final_norm": np.ones((D,), np.float32)}


def _ready(out: Any) -> Any:
    return jax.block_until_ready(out)


# ---- ours ----------------------------------------------------------------------------------------------------------

def ours_axes(mesh: str) -> dict[str, int]:
    """1 device, or fsdp 2 x tensor 2: like Tunix's ('fsdp', 'tp') = (2, 2), weights split over fsdp and over heads /
    d_ff / vocab on tensor, the batch split over fsdp."""
    return {"slices": 1, "fsdp": 1, "tensor": 1} if mesh == "1" else {"slices": 1, "fsdp": 2, "tensor": 2}


def ours_config(mesh: str, beta: float, overrides: list[str]) -> Any:
    from trainer.base.config import apply_overrides, config_from_dict, resolve_mesh

    raw = {
        "model": {"vocab_size": MODEL["vocab_size"], "d_model": MODEL["d_model"], "n_layers": MODEL["n_layers"],
                  "n_heads": MODEL["n_heads"], "n_kv_heads": MODEL["n_kv_heads"], "head_dim": MODEL["head_dim"],
                  "d_ff": MODEL["d_ff"], "rope_theta": float(MODEL["rope_theta"]), "norm_eps": MODEL["norm_eps"],
                  "qk_norm": True, "tie_embeddings": True, "param_dtype": "float32", "max_seq_len": 512},
        "mesh": ours_axes(mesh),
        "rl": {"algo": "grpo", "group_size": GROUP, "prompts_per_step": ROWS // GROUP, "mu_iterations": 1,
               "clip_eps": CLIP_EPS, "clip_eps_high": CLIP_EPS, "kl_beta": beta, "kl_estimator": "k3",
               "loss_agg": "token_mean"},
        "sampling": {"max_new_tokens": NEW_TOKENS, "max_prompt_len": PROMPT_LEN, "temperature": 1.0},
        "optim": {"name": "adamw", "lr": LR, "b1": B1, "b2": B2, "clip_norm": CLIP_NORM, "weight_decay": 0.0},
        "steps": STEPS_PLANNED,
        "progress": False,
    }
    return resolve_mesh(config_from_dict(apply_overrides(raw, overrides)), jax.device_count())


def build_ours(mesh_name: str, case: str, overrides: list[str], stack: contextlib.ExitStack) -> tuple[Step, dict]:
    from trainer.model.sharding import batch_sharding, make_mesh
    from trainer.rl.step import build_programs

    beta = CASES[case]
    cfg = ours_config(mesh_name, beta, overrides)
    m = cfg.mesh
    mesh = make_mesh(m.slices, m.fsdp, m.tensor, jax.devices()[: m.slices * m.fsdp * m.tensor])
    programs = build_programs(cfg, mesh, PAD_ID, EOS_ID)
    stack.enter_context(jax.set_mesh(mesh))
    params = jax.device_put(jax.tree.map(jnp.asarray, shared_weights()), programs.param_sh)
    opt_state = programs.init_opt(params)
    data = workload_arrays()
    host = {
        "prompt": data["prompt"],
        "prompt_valid": np.ones((ROWS, PROMPT_LEN), np.int32),
        "completion": data["completion"],
        "mask": np.ones((ROWS, NEW_TOKENS), np.int32),
        "rewards": data["rewards"][:, None],
        "old_logp": np.zeros((ROWS, NEW_TOKENS), np.float32),
    }
    # Rows split over the data axes, as the trainer's batches are (trainer/rl/batch.py from_rows).
    batch = {k: jax.device_put(v, batch_sharding(mesh, v.ndim)) for k, v in host.items()}
    # On-policy, as in a real step: the old log-probs come from the policy itself, the reference is the initial policy.
    batch["old_logp"] = programs.ref_logprobs(params, batch)
    ref = programs.ref_logprobs(params, batch) if beta > 0 else None
    _ready((batch, ref))
    state = {"params": params, "opt": opt_state}

    def step() -> dict[str, Any]:
        state["params"], state["opt"], metrics = programs.update(state["params"], state["opt"], batch, ref)
        return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "weight": state["params"]["embed"]}

    info = {"layout": f"slices {m.slices} x fsdp {m.fsdp} x tensor {m.tensor}", "kl_beta": beta,
            "compute": cfg.compute.model_dump()}
    return step, info


# ---- Tunix ---------------------------------------------------------------------------------------------------------

class _Tokenizer:
    """The methods Tunix's TokenizerAdapter asks for; the update step never tokenizes."""

    def encode(self, text: str, **_: Any) -> list[int]:
        return [FIRST_TOKEN + ord(c) % (MODEL["vocab_size"] - FIRST_TOKEN) for c in text]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(65 + int(i) % 26) for i in ids)

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return EOS_ID

    def pad_id(self) -> int:
        return PAD_ID


def tunix_mesh_shape(mesh: str) -> tuple[int, int]:
    return (1, 1) if mesh == "1" else (2, 2)


def load_into_tunix(model: Any, w: dict[str, Any]) -> None:
    """`shared_weights` into a tunix Qwen3 (same orientation: [D, heads, head_dim], [heads, head_dim, D], [D, F])."""
    p = w["layers"]
    model.embedder.input_embedding.value = jnp.asarray(w["embed"])
    model.final_norm.w.value = jnp.asarray(w["final_norm"])
    for i, layer in enumerate(model.layers):
        layer.input_layernorm.w.value = jnp.asarray(p["attn_norm"][i])
        layer.post_attention_layernorm.w.value = jnp.asarray(p["mlp_norm"][i])
        layer.attn.q_proj.w.value = jnp.asarray(p["wq"][i])
        layer.attn.k_proj.w.value = jnp.asarray(p["wk"][i])
        layer.attn.v_proj.w.value = jnp.asarray(p["wv"][i])
        layer.attn.o_proj.w.value = jnp.asarray(p["wo"][i])
        layer.attn.q_norm.w.value = jnp.asarray(p["q_norm"][i])
        layer.attn.k_norm.w.value = jnp.asarray(p["k_norm"][i])
        layer.mlp.gate_proj.kernel.value = jnp.asarray(p["w_gate"][i])
        layer.mlp.up_proj.kernel.value = jnp.asarray(p["w_up"][i])
        layer.mlp.down_proj.kernel.value = jnp.asarray(p["w_down"][i])


def build_tunix(mesh_name: str, case: str, remat: str, stack: contextlib.ExitStack) -> tuple[Step, dict]:
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import function_registry
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import sharding_utils
    from tunix.utils import mesh as mesh_lib

    beta = CASES[case]
    shape = tunix_mesh_shape(mesh_name)
    mesh = mesh_lib.create_mesh(shape, ("fsdp", "tp"), devices=jax.devices()[: shape[0] * shape[1]])
    config = qwen3.ModelConfig(
        num_layers=MODEL["n_layers"], vocab_size=MODEL["vocab_size"], embed_dim=MODEL["d_model"],
        hidden_dim=MODEL["d_ff"], num_heads=MODEL["n_heads"], head_dim=MODEL["head_dim"],
        num_kv_heads=MODEL["n_kv_heads"], rope_theta=MODEL["rope_theta"], norm_eps=MODEL["norm_eps"],
        use_tied_embedding=True, dtype=jnp.float32, param_dtype=jnp.float32,
        remat_config=qwen3.RematConfig[remat.upper()],
    )
    weights = shared_weights()
    actor = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
    load_into_tunix(actor, weights)
    reference = None
    if beta > 0:
        reference = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
        load_into_tunix(reference, weights)
    # What ours builds (trainer/rl/optim.py): a global-norm clip, then AdamW on a cosine schedule without warmup.
    schedule = optax.warmup_cosine_decay_schedule(LR, LR, 0, STEPS_PLANNED, LR * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adamw(schedule, b1=B1, b2=B2, weight_decay=0.0))
    rollout = base_rollout.RolloutConfig(max_tokens_to_generate=NEW_TOKENS, max_prompt_length=PROMPT_LEN,
                                         kv_cache_size=PROMPT_LEN + NEW_TOKENS + 32, temperature=1.0)
    roles = {rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh, rl_cluster_lib.Role.ROLLOUT: mesh}
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=_Tokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh=roles, rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optimizer, eval_every_n_steps=STEPS_PLANNED, max_steps=STEPS_PLANNED),
            rollout_config=rollout))
    algo = grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=1, beta=beta, epsilon=CLIP_EPS,
                                   loss_agg_mode="token-mean", kl_loss_mode="low_var_kl")
    # The learner installs its GRPO loss into the cluster's actor trainer (with_loss_fn, with_gen_model_input_fn).
    grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=lambda **_: [0.0] * ROWS)
    trainer = cluster.actor_trainer
    data = workload_arrays()
    prompt_ids, completion_ids = jnp.asarray(data["prompt"]), jnp.asarray(data["completion"])
    ref = None
    if beta > 0:  # the learner's own reference pass (GRPOLearner._generate_and_compute_advantage)
        ref = cluster.get_ref_per_token_logps(prompt_tokens=prompt_ids, completion_tokens=completion_ids,
                                              pad_id=PAD_ID, eos_id=EOS_ID, micro_batch_size=ROWS)
    advantages = function_registry.get_advantage_estimator("grpo")(rewards=data["rewards"], num_generations=GROUP)
    # As the learner builds it; old_per_token_logps None = on-policy (num_iterations 1): the loss uses
    # stop_gradient(per_token_logps).
    example = grpo_learner.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != PAD_ID, completion_ids=completion_ids,
        completion_mask=jnp.asarray(data["completion"] != PAD_ID), ref_per_token_logps=ref,
        advantages=jax.device_put(advantages), old_per_token_logps=None)
    # RLCluster.update_actor runs the trainer inside the actor's mesh (and logical-axis rules) context.
    stack.enter_context(cluster._get_mesh_and_logical_axis_rules_cm(rl_cluster_lib.Role.ACTOR))
    train_step, _ = trainer.jit_train_and_eval_step(False, True)
    example = sharding_utils.shard_input(example, trainer.config.data_sharding_axis)

    embedding = trainer.model.embedder.input_embedding

    def step() -> dict[str, Any]:
        loss, _, grad_norm = train_step(example)
        return {"loss": loss, "grad_norm": grad_norm, "weight": embedding.value}

    info = {"layout": f"('fsdp', 'tp') = {shape}, batch over fsdp (TrainingConfig.data_sharding_axis default)",
            "kl_beta": beta, "remat": remat}
    return step, info


# ---- driver --------------------------------------------------------------------------------------------------------

def build_all(args: argparse.Namespace, stack: contextlib.ExitStack) -> tuple[dict[str, Step], dict[str, Any]]:
    steps: dict[str, Step] = {}
    ready: dict[str, Any] = {}
    for case in [c for c in args.cases.split(",") if c]:
        if args.side == "ours":
            step, info = build_ours(args.mesh, case, args.set, stack)
        else:
            step, info = build_tunix(args.mesh, case, args.tunix_remat, stack)
        t0 = time.perf_counter()
        out = _ready(step())  # compiles
        info.update({"compile_s": time.perf_counter() - t0, "first_loss": float(out["loss"]),
                     "first_grad_norm": float(out["grad_norm"])})
        steps[case], ready[case] = step, info
    return steps, ready


def time_steps(step: Step, n: int) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (this process, all threads) of each of n steps."""
    wall, cpu = [], []
    for _ in range(n):
        c0, t0 = time.process_time(), time.perf_counter()
        _ready(step())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(PROTOCOL + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("ours", "tunix"), required=True)
    ap.add_argument("--mesh", choices=("1", "2x2"), required=True)
    ap.add_argument("--cases", default="kl,nokl", help="comma-separated: kl (beta 0.04), nokl (beta 0)")
    ap.add_argument("--steps", type=int, default=5, help="one-shot mode: timed steps per case after the compiling one")
    ap.add_argument("--serve", action="store_true", help="answer `run CASE N` lines on stdin (see the docstring)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="ours: a config override (e.g. compute.scan_layers=false)")
    ap.add_argument("--tunix-remat", default="none", choices=("none", "block", "decoder"),
                    help="tunix: the Qwen3 ModelConfig.remat_config (its default: none)")
    args = ap.parse_args(argv)
    need = 1 if args.mesh == "1" else 4
    if jax.device_count() < need:
        sys.exit(f"--mesh {args.mesh} needs {need} devices, jax sees {jax.device_count()} "
                 "(XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    header = {"side": args.side, "mesh": args.mesh, "devices": jax.device_count(), "jax": jax.__version__,
              "pid": os.getpid()}
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        steps, ready = build_all(args, stack)
        header.update({"cases": ready, "setup_s": time.perf_counter() - t0})
        if not args.serve:
            for case, step in steps.items():
                ready[case]["step_s"], ready[case]["cpu_s"] = time_steps(step, args.steps)
            emit(header)
            return
        emit(header)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            if words[0] != "run" or len(words) != 3 or words[1] not in steps:
                emit({"error": f"bad command {line.strip()!r}"})
                continue
            wall, cpu = time_steps(steps[words[1]], int(words[2]))
            emit({"case": words[1], "step_s": wall, "cpu_s": cpu})


if __name__ == "__main__":
    main()
