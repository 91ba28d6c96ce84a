"""Typed training config: YAML file + `--set a.b=value` overrides, validated by pydantic.

Every section forbids unknown keys so a typo fails loudly with the full dotted key instead of being ignored.
Checks that need the device count (mesh shape, batch vs data axes) live in `resolve_mesh`, called once JAX
is initialised.

Over 600 lines as one module on purpose: it is the one schema of the trainer config (every section, its validators and
the values derived from them), which the reference docs are generated from by walking it; the loading functions at the
end are short and read every section.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, ValidationError, model_validator

from trainer.base import yamlfile
from trainer.base.eval_config import EVAL_INDEX_OFFSET, EvalConfig

if TYPE_CHECKING:
    from envspec.sections.fields import BundledConfigs


class ConfigError(ValueError):
    """A user-facing config problem; the CLI prints the message without a traceback (exit 2)."""


class _Strict(BaseModel):
    # Frozen: sections are hashable, so jitted code can close over them safely.
    # NaN and infinity are never a valid setting (YAML's .nan/.inf would otherwise pass a range check).
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False)


class ModelConfig(_Strict):
    """Decoder shape and variant (the fields after max_seq_len default to a plain Llama/Qwen3 decoder).

    family: the Hugging Face model_type (llama, mistral, qwen2, qwen3) the model came from and exports as;
    None = inferred: qwen3 with qk_norm, qwen2 with qkv_bias, else llama.
    qkv_bias: the q/k/v projections add a bias (Qwen2); o_proj never has one.
    rope_type: RoPE frequency scaling as in transformers: default (none), linear (every inverse frequency
    divided by rope_factor) or llama3 (Llama 3.1/3.2: wavelengths above rope_original_max_len /
    rope_low_freq_factor divided by rope_factor, below rope_original_max_len / rope_high_freq_factor kept,
    blended in between).
    """

    vocab_size: int = Field(gt=0, description="embedding rows; at least the tokenizer's vocabulary")
    d_model: int = Field(gt=0, description="hidden size")
    n_layers: int = Field(gt=0, description="decoder layers")
    n_heads: int = Field(gt=0, description="query heads; a multiple of n_kv_heads")
    n_kv_heads: int = Field(gt=0, description="key/value heads (grouped-query attention)")
    head_dim: int = Field(gt=0, description="size of each attention head; even (RoPE rotates half of it)")
    d_ff: int = Field(gt=0, description="MLP intermediate size")
    # Both must be positive: a negative RoPE base or RMSNorm epsilon gives NaN activations, and training goes on NaN.
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")
    qk_norm: bool = Field(False, description="RMSNorm on each head's queries and keys (Qwen3)")
    tie_embeddings: bool = Field(True, description="the output projection reuses the token embedding")
    param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the weights; "
                                                         "compute.param_dtype overrides it")
    max_seq_len: int = Field(gt=0, description="longest sequence, prompt plus completion")
    family: Literal["llama", "mistral", "qwen2", "qwen3"] | None = Field(
        None, description="the Hugging Face model_type the model came from and exports as; unset: inferred (qwen3 "
        "with qk_norm, qwen2 with qkv_bias, else llama)")
    qkv_bias: bool = Field(False, description="the q/k/v projections add a bias (Qwen2); o_proj never has one")
    rope_type: Literal["default", "linear", "llama3"] = Field(
        "default", description="RoPE frequency scaling as in transformers: default (none), linear (every inverse "
        "frequency divided by rope_factor) or llama3 (Llama 3.1/3.2)")
    rope_factor: float = Field(1.0, gt=0, description="RoPE scaling factor (linear, llama3)")
    rope_low_freq_factor: float = Field(1.0, gt=0, description="llama3 scaling: wavelengths above "
                                        "rope_original_max_len / this are divided by rope_factor")
    rope_high_freq_factor: float = Field(4.0, gt=0, description="llama3 scaling: wavelengths below "
                                         "rope_original_max_len / this are kept; above rope_low_freq_factor")
    rope_original_max_len: int | None = Field(None, gt=0, description="llama3 scaling (required there): the "
                                              "pre-training context length")

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates half of it)")
        if self.family is not None:
            want = {"qwen3": (True, False), "qwen2": (False, True)}.get(self.family, (False, False))
            if (self.qk_norm, self.qkv_bias) != want:
                raise ValueError(f"family={self.family} needs qk_norm={want[0]} and qkv_bias={want[1]}")
        if self.rope_type == "llama3":
            if self.rope_original_max_len is None:
                raise ValueError("rope_type=llama3 needs rope_original_max_len")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise ValueError("rope_type=llama3 needs rope_high_freq_factor > rope_low_freq_factor")
        return self


DType = Literal["float32", "bfloat16"]
# compute.scan_layers unset: unrolled up to this depth. Unrolled was faster at 4, 8 and 16 layers on the CPU while
# its first call grew from 6-10 s to 6-17 s (bench/README.md "Against Tunix"); deep models keep flat compile times.
UNROLL_MAX_LAYERS = 16
# What compute's `auto` kernel choices resolve to per platform (ComputeConfig.on_platform); others get "xla". The
# Pallas kernels are TPU kernels, cuDNN's a GPU's; dense_grad: YNNPACK takes canonical matmuls only.
AUTO_KERNELS = {"attention": {"tpu": "flash", "gpu": "cudnn"},
                "decode_attention": {"tpu": "pallas", "gpu": "unrolled"},
                "dense_grad": {"cpu": "transposed"}}
# compute.train_micro_batch_size unset on a CPU mesh: tokens per data shard per micro-batch. A measurement on a
# 2 MiB-L2 CPU (bench/README.md "Against Tunix"), where the update's transposes and matmuls then fit the caches
# (256 before the MLP's weight gradients became canonical matmuls, compute.dense_grad; 512 since: 4-5 % faster on one
# device, 2 % on 2 x 2); TPUs and GPUs keep the whole minibatch (large matmuls; FSDP re-gathers the weights for
# every micro-batch).
CPU_MICRO_BATCH_TOKENS = 512


class ComputeConfig(_Strict):
    """How the step spends memory and FLOPs; none of it changes the maths beyond float rounding.

    param_dtype: master weights and optimizer state (None = model.param_dtype, or the checkpoint's dtype).
    dtype: matmul inputs, activations and the KV cache (None = the param dtype); norms, softmax, logits and
    losses stay fp32 either way.
    remat: recompute each decoder layer in the backward pass: none (keep every activation), full (keep only
    the layer inputs), dots (keep matmul outputs without a batch dim, recompute the rest).
    train_micro_batch_size: global sequences per gradient-accumulation micro-batch (None = the whole
    minibatch in one pass; on a CPU mesh, see `TrainConfig.micro_batch_rows_on`).
    logprob_chunk: completion tokens whose [B, chunk, V] fp32 logits exist at once (recomputed in the backward).
    """

    param_dtype: DType | None = Field(None, description="master weights and optimizer state; unset: "
                                      "model.param_dtype, or the checkpoint's dtype")
    dtype: DType | None = Field(None, description="matmul inputs, activations and the KV cache; unset: the param "
                                "dtype (norms, softmax, logits and losses stay float32 either way)")
    remat: Literal["none", "full", "dots"] = Field(
        "none", description="recompute each decoder layer in the backward pass: none (keep every activation), full "
        "(keep only the layer inputs), dots (keep matmul outputs without a batch dim, recompute the rest)")
    train_micro_batch_size: int | None = Field(None, gt=0, description="global sequences per gradient-accumulation "
                                               "micro-batch; unset: the whole minibatch in one pass (on a CPU "
                                               "mesh: micro-batches of at most 512 tokens per data shard)")
    logprob_chunk: int = Field(512, gt=0, description="completion tokens whose float32 logits exist at once "
                               "(recomputed in the backward pass)")
    # The gradient-accumulation buffer (with train_micro_batch_size). float32 adds a params x 4 bytes buffer; bfloat16
    # halves it and rounds each micro-batch's sum to 8 mantissa bits: for bf16 training state that does not fit.
    grad_accum_dtype: DType = Field("float32", description="the gradient-accumulation buffer (with "
                                    "train_micro_batch_size); bfloat16 halves it and rounds each micro-batch's sum")
    # Run the decoder layers as one lax.scan (compile time flat in depth) or unrolled (XLA sees every layer, and
    # the backward keeps no stacked residual buffers: faster at every depth measured, bench/README.md "Against
    # Tunix"). Unset: unrolled up to UNROLL_MAX_LAYERS, scanned above, where compile time would grow with depth.
    scan_layers: bool | None = Field(None, description="run the decoder layers as one lax.scan (compile time flat "
                                     "in depth); false: unrolled; unset: unrolled up to 16 layers, scanned above")
    # Attention of the passes without a KV cache (the update, reference log-probs): auto = Pallas' splash (flash)
    # attention kernel, grouped KV heads read in place, where the mesh is on TPU and the sequence a multiple of its
    # 128-token blocks, else XLA's einsum + softmax (which writes the [T, T] scores to HBM). flash forces the kernel
    # (off TPU it runs only in Pallas' interpret mode, as the tests do); xla forces the einsum. On GPU, auto = cudnn:
    # jax.nn.dot_product_attention's cuDNN flash attention on rows packed valid-tokens-first (attention.packed_order);
    # off GPU cudnn makes the same call through XLA.
    attention: Literal["auto", "xla", "flash", "cudnn"] = Field(
        "auto", description="attention of the passes without a KV cache: auto = Pallas flash attention on TPU, cuDNN "
        "flash attention on GPU, else XLA")
    # A decode step's attention reads the KV cache block by block, only up to the block holding the furthest live
    # row's newest token (online softmax, static shapes; a loop whose trip count grows with the step). One einsum
    # over the whole P + N-slot cache reads every slot at every step, and made libtpu copy each layer's slice of the
    # stacked cache before reading it. 0 (or a cache no longer than a block): that einsum, the reference.
    # Unset on a GPU: 0. There the whole-cache einsum beat the blocks (1B model, 64 rows, 768 slots, H100: 1.85 s
    # against 2.27 s unrolled and 2.45 s in a loop; bench/README.md "The trainer on a GPU"): fewer, larger kernels.
    decode_block: int = Field(256, ge=0, description="KV-cache slots a decode step's attention reads per block, "
                              "up to the furthest live token only; 0: the whole cache in one einsum (the reference; "
                              "the default on GPU)")
    # How those blocks are read: auto = the Pallas TPU kernel of trainer/model/decode_kernel.py (each block DMA'd from
    # the stacked cache, no copy) where the mesh is on TPU and the cache and head size fit its tiles, else XLA's loop of
    # dynamic slices (which libtpu copies block by block). pallas off TPU runs in Pallas' interpret mode only.
    # unrolled: XLA's blocks, but no loop inside the step: the step is compiled once per count of live blocks and
    # lax.switch runs the one each step needs. On a GPU, XLA runs a loop whose trip count it cannot see by copying
    # its predicate to the host at every iteration (once per block and layer), so the GPU waits on the host.
    decode_attention: Literal["auto", "xla", "pallas", "unrolled"] = Field(
        "auto", description="a decode step's block-wise attention: auto = the Pallas TPU kernel on TPU, unrolled "
        "on GPU (one compiled step per live-block count, picked per step), else XLA's block loop")

    # The MLP's weight gradients contract over the tokens. transposed: the activations' transpose is written out
    # first (model.token_dense), so the matmul is canonical: XLA's CPU runs only those in YNNPACK, and wrote a larger
    # transpose otherwise (the Tunix bench's CPU step 0.390 -> 0.357 s). Elsewhere XLA lays dots out itself.
    dense_grad: Literal["auto", "xla", "transposed"] = Field(
        "auto", description="the MLP weight gradients' layout: transposed = the activations' transpose written out "
        "first (canonical matmuls); auto = transposed on CPU, else XLA's")

    def on_platform(self, platform: str) -> ComputeConfig:
        """The `auto` kernel choices resolved for a mesh of `platform` (the Pallas kernels are TPU kernels)."""
        update: dict[str, Any] = {k: by.get(platform, "xla") for k, by in AUTO_KERNELS.items()
                                  if getattr(self, k) == "auto"}
        if platform == "gpu" and "decode_block" not in self.model_fields_set:
            update["decode_block"] = 0
        return self.model_copy(update=update) if update else self

    def scans(self, n_layers: int) -> bool:
        """Whether the decoder layers run as one lax.scan."""
        return self.scan_layers if self.scan_layers is not None else n_layers > UNROLL_MAX_LAYERS


class MeshConfig(_Strict):
    """Device mesh (slices, fsdp, tensor); at most one axis may be -1 (inferred from the device count)."""

    slices: int = Field(1, description="data-parallel axis across TPU slices (over DCN); -1: inferred")
    fsdp: int = Field(-1, description="axis sharding the batch and the parameters (FSDP); -1: inferred")
    tensor: int = Field(1, description="tensor-parallel axis; -1: inferred")
    # Shard parameters and optimizer state over slices x fsdp instead of fsdp alone (ZeRO-3 across slices, over
    # DCN): for a model whose training state does not fit one slice.
    fsdp_across_slices: bool = Field(False, description="shard parameters and optimizer state over slices x fsdp "
                                     "instead of fsdp alone (ZeRO-3 across slices, over DCN)")

    def axes(self) -> dict[str, int]:
        return {"slices": self.slices, "fsdp": self.fsdp, "tensor": self.tensor}


class SamplerMeshConfig(_Strict):
    """The sampler group's mesh with placement.mode=split: (slices, fsdp, tensor) on devices of its own."""

    slices: int = Field(1, description="the sampler's data-parallel axis across slices; -1: inferred")
    fsdp: int = Field(-1, description="the sampler's data-parallel (and weight-sharding) axis; -1: inferred")
    tensor: int = Field(1, description="the sampler's tensor-parallel axis; -1: inferred")

    def axes(self) -> dict[str, int]:
        return {"slices": self.slices, "fsdp": self.fsdp, "tensor": self.tensor}


class PlacementConfig(_Strict):
    """Where sampling and the update run. colocated: both on `mesh`, one after the other (the default). split: the
    update on `mesh` and sampling on `placement.sampler`, on disjoint devices of the one job, the new weights pushed
    device to device after every update (trainer/rl/rollouts.py). Devices are split by slice where they carry a
    slice index (multislice: the first mesh.slices slices train, the next placement.sampler.slices sample), else within
    each process where both groups split evenly over the processes, else in device order (the trainer's first):
    trainer/base/placement.py. With rl.lag >= 1 the two groups run at once."""

    mode: Literal["colocated", "split"] = Field(
        "colocated", description="colocated: sampling and the update share `mesh`; split: the update on `mesh`, "
        "sampling on placement.sampler, on disjoint devices (needs mesh + sampler devices in all)")
    sampler: SamplerMeshConfig = Field(SamplerMeshConfig(), description="with mode split: the sampler group's mesh, "
                                       "slices x fsdp x tensor (its own tensor parallelism); a -1 axis takes "
                                       "the devices mesh leaves (half of them if mesh has a -1 too)")


class TaskConfig(BaseModel):
    # Extra keys are task kwargs (e.g. `path` for gsm8k), so this section alone allows them.
    model_config = ConfigDict(extra="allow")
    name: str = Field("digits", description="the task: its prompts, answers and default rewards; a built-in, or "
                      "your own as MODULE:FACTORY, called with this section's other keys (docs/own-tasks.md)")
    # The three keys below are the kit's, for any task: they never reach the task's factory.
    chat_template: bool = Field(False, description="wrap each prompt in the tokenizer's own chat template (its "
                                "tokenizer_config.json or chat_template.jinja) as one user turn with the generation "
                                "prompt, as transformers' apply_chat_template does; needs an instruct model's "
                                "tokenizer directory")
    system_prompt: str | None = Field(None, description="with chat_template: a system turn before the prompt")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="with chat_template: extra "
                                                 "variables the template reads, e.g. {enable_thinking: false} for "
                                                 "Qwen3")


class InitConfig(_Strict):
    from_: Literal["random", "hf"] = Field("random", alias="from", description="random (the model section's "
                                           "shape) or hf (a Hugging Face checkpoint in init.path)")
    path: str | None = Field(None, description="local Hugging Face checkpoint directory (config.json, "
                             "safetensors); required with init.from hf")


class RLConfig(_Strict):
    algo: Literal["grpo", "gspo", "dr_grpo"] = Field(
        "grpo", description="grpo: a clipped ratio per token; gspo: one per sequence; dr_grpo: per token, with "
        "no std division of the advantages and a constant (batch x max length) loss denominator")
    group_size: int = Field(8, ge=2, description="completions sampled per prompt; advantages are relative to the "
                            "group")
    prompts_per_step: int = Field(8, gt=0, description="prompts per step; a step trains on prompts_per_step x "
                                  "group_size sequences")
    mu_iterations: int = Field(1, gt=0, description="passes over each step's batch")
    clip_eps: float = Field(0.2, ge=0, description="the ratio's lower clip: 1 - clip_eps")
    clip_eps_high: float = Field(0.28, ge=0, description="the ratio's upper clip: 1 + clip_eps_high")
    kl_beta: float = Field(0.0, ge=0, description="weight of the KL penalty to the initial policy; 0: none (and no "
                           "reference copy of the weights)")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="per-token KL estimate: k1 = log(pi/ref), k3 = r - "
                                              "1 - log r with r = ref/pi")
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = Field(
        "token_mean", description="the mean of grpo's loss and of the KL term: over all tokens, or per sequence "
        "then over sequences (dr_grpo ignores it)")
    adv_eps: float = Field(1e-6, gt=0, description="added to the group's reward std before dividing by it")
    # PPO minibatches: each of the mu_iterations passes takes this many optimizer steps over disjoint parts of the
    # batch. 1 = one full-batch step per iteration.
    minibatches: int = Field(1, gt=0, description="optimizer steps per pass, each over a disjoint part of the "
                             "batch; divides it")
    # Asynchronous RL (docs/trainer-config.md "Asynchronous RL"): rollouts of step t come from the weights after update
    # max(0, t - lag), so sampling step t + lag overlaps updating step t; deterministic given the seed and lag.
    lag: int = Field(0, ge=0, description="rollouts for step t are sampled with the weights after update "
                     "max(0, t - lag); 0: the synchronous loop; >= 1: sampling overlaps the update (with placement "
                     "split, on other devices at once)")
    lag_correction: Literal["clip", "decoupled"] = Field(
        "clip", description="the off-policy correction: clip = PPO's clipped ratio against the sampler's "
        "log-probs; decoupled = AReaL's decoupled PPO objective (ratio clipped against the weights before this "
        "update, times the behaviour weight pi_prox / pi_sampler, truncated at behavior_weight_cap; one extra "
        "forward pass)")
    # Truncated (min(w, cap)) as in Yao et al.'s truncated importance sampling, where AReaL's code drops the tokens
    # with w > cap (docs/async-rl.md, "The off-policy correction").
    behavior_weight_cap: float | None = Field(2.0, gt=1, description="decoupled: the behaviour importance weight "
                                              "w is truncated to min(w, cap) (truncated importance sampling; AReaL "
                                              "instead drops the tokens with w > cap); must be > 1; unset: not "
                                              "truncated")


class SamplingConfig(_Strict):
    max_new_tokens: int = Field(16, gt=0, description="the most tokens generated per completion")
    # Prompts are left-padded/truncated to this many tokens; None = max_seq_len - max_new_tokens.
    max_prompt_len: int | None = Field(None, gt=0, description="prompts are left-padded or truncated to this many "
                                       "tokens; unset: model.max_seq_len - max_new_tokens")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0: greedy")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens; 0: off")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the likeliest tokens holding this much "
                         "probability; 1: off")
    # Global sequences generated at once (the rollout batch is sampled in chunks of this size, so the KV cache
    # does not grow with prompts x group size). None = the whole batch at once.
    max_num_sequences: int | None = Field(None, gt=0, description="global sequences generated at once (the "
                                          "rollout is sampled in chunks of this size); unset: the whole batch")
    # With max_num_sequences below the step's sequences: a slot whose sequence ended takes the next pending one (its
    # prompt prefilled into the slot), so slots do not idle until a chunk's longest completion ends. Same tokens.
    continuous_batching: bool = Field(True, description="when max_num_sequences is below the step's sequences, a "
                                      "slot whose sequence ended takes the next pending one; false: chunks that each "
                                      "decode until their longest sequence ends (the same tokens either way)")
    # All-gather the weights over mesh.fsdp once per step, in the compute dtype, for sampling: decoding then needs
    # no all-gather per generated token. Costs params x bytes / mesh.tensor of HBM per chip while sampling.
    gather_weights: bool = Field(False, description="all-gather the weights over mesh.fsdp once per step for "
                                 "sampling, so decoding needs no all-gather per token; costs HBM while sampling")
    # The sampler's own tensor-parallel degree: each slice's fsdp x tensor chips regrouped as (fsdp x tensor / this)
    # x this, so weights that do not fit a chip gathered at mesh.tensor still decode with no per-token all-gather
    # (70B on v6e: 35 GiB per chip at tensor 4, 17.5 at 8).
    tensor: int | None = Field(None, gt=0, description="the tensor-parallel degree the sampler runs at: each "
                               "slice's mesh.fsdp x mesh.tensor chips regrouped as (fsdp x tensor / this) x this; a "
                               "multiple of mesh.tensor dividing fsdp x tensor; needs gather_weights; unset: "
                               "mesh.tensor")


class OptimConfig(_Strict):
    # adamw: two param-sized moments. adafactor: factored second moments and no first moment (optax.adafactor,
    # lr as an absolute step: multiply_by_parameter_scale off), for models whose Adam state does not fit.
    name: Literal["adamw", "adafactor"] = Field(
        "adamw", description="adamw, or adafactor (factored second moments, no first moment) for a model whose Adam "
        "state does not fit")
    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    warmup_steps: int = Field(0, ge=0, description="training steps of linear warmup from 0")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine schedule decays to lr x min_lr_ratio")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    # Adam's decay rates lie in [0, 1): at 1 the bias correction divides by 1 - b**t = 0 (optax does not check;
    # torch.optim.Adam refuses betas outside [0, 1) for the same reason).
    b1: float = Field(0.9, ge=0, lt=1, description="Adam's first-moment decay rate")
    b2: float = Field(0.999, ge=0, lt=1, description="Adam's second-moment decay rate")
    clip_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")


# Hugging Face module names of the projections a LoRA adapter can target (PEFT's target_modules).
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LORA_LINEAR_TARGETS: tuple[LoraTarget, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj")


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scale of a LoRA update: alpha / rank, or alpha / sqrt(rank) with rslora (peft tuners/lora/layer.py
    update_layer). The one place the formula is written: the trainer's adapters and the service's slots read it."""
    return alpha / _rank_divisor(rank, rslora)


def lora_alpha(scale: float, rank: int, rslora: bool) -> float:
    """The alpha that gives `scale` at `rank`: lora_scale's inverse (a service slot keeps a scale, a config alpha)."""
    return scale * _rank_divisor(rank, rslora)


def _rank_divisor(rank: int, rslora: bool) -> float:
    # rank**0.5, not math.sqrt: the two differ in the last bit from rank 2921 on, and this is what configs always used.
    return rank**0.5 if rslora else rank


class LoraConfig(_Strict):
    """LoRA: the base weights stay frozen (no gradient, no optimizer state) and each target projection W gains
    scale x A B, with A [in, rank], B [rank, out] (B starts at zero) and scale alpha / rank (alpha / sqrt(rank) with
    rslora), as PEFT computes it. `slots` adapters are stacked on the one base model; each batch row picks its own."""

    rank: int = Field(8, gt=0, description="the adapters' rank r (PEFT's r)")
    alpha: float = Field(8.0, gt=0, description="the update is scaled by alpha / rank (PEFT's lora_alpha)")
    # Written as a list, kept as a tuple: the section stays hashable (jitted programs are cached on it).
    targets: Annotated[list[LoraTarget], AfterValidator(tuple), PlainSerializer(list)] = Field(
        default_factory=lambda: list(LORA_LINEAR_TARGETS), min_length=1, validate_default=True,
        description="projections that get an adapter, by their Hugging Face module name (PEFT's target_modules); "
        "lm_head is the unembedding")
    rslora: bool = Field(False, description="rank-stabilised LoRA: scale by alpha / sqrt(rank) (PEFT's use_rslora)")
    # Adapters stacked on the one base model: rows of a batch each pick a slot (a task example's `lora_slot` field,
    # else 0; -1 = the base model alone), so many users' rows share one forward and backward pass.
    slots: int = Field(1, gt=0, description="adapters stacked on the base model; each prompt trains the slot its "
                       "example's lora_slot field names (default 0; -1: none, the base model alone)")

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.rslora)

    @model_validator(mode="after")
    def _check_targets(self) -> LoraConfig:
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets: {list(self.targets)} names a module twice")
        return self


class ServiceConfig(_Strict):
    """The Tinker-compatible service's engine (trainer/service/engine/): one base model, `lora.slots` adapters of
    rank up to `lora.rank` on it (each client's model, and each sampler checkpoint in use, holds a slot), and how
    requests are batched. The rest of the config (model or init, mesh, compute) is the trainer's own."""

    base_model: str = Field(min_length=1, description="the name clients pass as base_model (e.g. Qwen/Qwen3-8B); "
                            "with init.from hf and no init.path the weights are read from the Hugging Face cache "
                            "under this name (offline)")
    max_batch_tokens: int = Field(8192, gt=0, description="tokens (rows x bucketed length) in one forward/backward "
                                  "pass; the requests claimed together beyond that run in further passes")
    min_bucket: int = Field(32, gt=0, description="shortest sequence bucket: lengths are padded up to this times a "
                            "power of two (one compiled program per bucket)")
    sample_max_sequences: int = Field(64, gt=0, description="sequences decoded at once; a request for more samples "
                                      "runs in chunks")
    max_request_tokens: int = Field(1 << 20, gt=0, description="the most tokens (all datums together) one forward "
                                    "or forward_backward request may carry (more is refused, naming this key): a "
                                    "request runs to its end once started, whoever waits")
    max_num_samples: int = Field(128, gt=0, description="the most samples one sample request may ask for (a larger "
                                 "num_samples is refused, naming this key): one request holds the engine while it "
                                 "decodes")
    idle_unload_s: float = Field(900.0, gt=0, description="a model whose session sent no heartbeat for this long "
                                 "gives its adapter slot back (its state is saved: it comes back on its next request)")
    storage_dir: str | None = Field(None, description="where checkpoints are written; unset: checkpoints/ beside "
                                    "the service database ($GKE_TPU_RL_SERVICE_HOME)")
    state_dir: str | None = Field(None, description="where each model's state snapshot (adapter, Adam moments, "
                                  "step: written at every optim_step, load and create) goes, the latest one per model "
                                  "kept; unset: state/ in storage_dir. The stack puts it on a bucket of its own, "
                                  "without object versioning or soft delete, which would keep every replaced one")
    compile_cache: bool = Field(True, description="keep every compiled program in _jax-compile-cache/ under "
                                "state_dir (the state bucket), so a restarted engine reads them back instead of "
                                "compiling (the `engine` and `serve --config` commands)")
    warmup: bool = Field(True, description="before taking requests, run the programs of the smallest shapes (a "
                         "one-sample sample, a forward and a forward_backward of one short datum, an optim_step), so "
                         "the first users do not wait for those compiles")
    db_retry_s: float = Field(300.0, ge=0, description="how long the engine's start-up retries the database while "
                              "it is unavailable (Cloud SQL's maintenance restart, IAM bindings still propagating on a "
                              "first deploy) before it exits 42 for its JobSet to restart it; 0: once")


class CheckpointConfig(_Strict):
    every: int = Field(0, ge=0, description="save every N steps; 0: only at the end and on SIGTERM")
    keep: int = Field(3, gt=0, description="checkpoints kept")
    dir: str | None = Field(None, description="checkpoint directory; unset: $CHECKPOINT_DIR, else "
                            "<run_dir>/checkpoints")
    async_save: bool = Field(True, description="write checkpoints in the background while training goes on")
    resume_step: int | None = Field(None, ge=0, description="resume from this saved step instead of the newest: the "
                                    "steps after it are moved aside as <step>.rolled-back (never deleted), once; a "
                                    "record (rolled-back-to-<step>.json) makes later restarts resume from the "
                                    "newest step again")
    compile_cache: bool = Field(True, description="keep the compiled programs in _jax-compile-cache/ beside the "
                                "checkpoints, so a restarted run (a preemption, a crash) reads them back instead of "
                                "compiling them again (`python -m trainer` without --ray; "
                                "$JAX_COMPILATION_CACHE_DIR wins if set)")


class TrainConfig(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)  # holds a list: not frozen

    model: ModelConfig | None = Field(None, description="the decoder's shape; required with init.from random, "
                                      "omitted with hf (read from the checkpoint's config.json)")
    mesh: MeshConfig = Field(MeshConfig(), description="the device mesh, slices x fsdp x tensor (with placement "
                             "split: the update's group); at most one axis may be -1, inferred from the device count")
    task: TaskConfig = Field(TaskConfig(), description="the prompt task; this section's other keys are the task's "
                             "options (e.g. path for gsm8k)")
    rewards: list[str] | None = Field(None, description="reward functions, built-in or your own as "
                                      "MODULE:FUNCTION; a completion's reward is their sum; unset: the task's own")
    tokenizer: str = Field("char", description="char (the built-in character tokenizer) or a local directory "
                           "holding tokenizer.json")
    init: InitConfig = Field(InitConfig(), description="where the initial weights come from")
    compute: ComputeConfig = Field(ComputeConfig(), description="how the step spends memory and FLOPs; none of it "
                                   "changes the maths beyond float rounding")
    rl: RLConfig = Field(RLConfig(), description="the policy-gradient algorithm and the batch of a step")
    sampling: SamplingConfig = Field(SamplingConfig(), description="generating the rollouts")
    optim: OptimConfig = Field(OptimConfig(), description="the optimizer and its warmup + cosine schedule")
    steps: int = Field(100, gt=0, description="training steps")
    # jax.random.PRNGKey takes an int64 seed
    seed: int = Field(0, ge=-(2**63), lt=2**63, description="the random seed (int64)")
    run_dir: str = Field("runs/default", min_length=1, description="where metrics.jsonl, config.yaml and (by "
                         "default) checkpoints go; the --run-dir flag overrides it")
    placement: PlacementConfig = Field(PlacementConfig(), description="where sampling and the update run: "
                                       "colocated on `mesh`, or split onto disjoint device groups")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="saving and resuming")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on frozen base weights (`lora: {}` for the "
                                    "defaults); unset: train every weight")
    service: ServiceConfig | None = Field(None, description="run as the Tinker-compatible service's engine "
                                          "(trainer/service); needs lora (the adapter slots)")
    eval: EvalConfig | None = Field(None, description="score a held-out split of the task during training (`eval: {}` "
                                    "for the defaults); unset: no eval")
    log_every: int = Field(1, gt=0, description="print a metrics line every N steps (when there is no progress "
                           "bar)")
    progress: bool = Field(True, description="a progress bar on process 0 when stdout is a terminal")

    @property
    def prompt_len(self) -> int:
        return self.sampling.max_prompt_len or (self.model_cfg.max_seq_len - self.sampling.max_new_tokens)

    @property
    def model_cfg(self) -> ModelConfig:
        """The model, with compute.param_dtype applied."""
        if self.model is None:
            raise ConfigError("model: not set (it is read from init.path for init.from=hf)")
        if self.compute.param_dtype and self.compute.param_dtype != self.model.param_dtype:
            return self.model.model_copy(update={"param_dtype": self.compute.param_dtype})
        return self.model

    @property
    def compute_dtype(self) -> str:
        return self.compute.dtype or self.model_cfg.param_dtype

    @property
    def batch_size(self) -> int:
        """Sequences per step: every prompt is sampled group_size times."""
        return self.rl.prompts_per_step * self.rl.group_size

    @property
    def minibatch_rows(self) -> int:
        return self.batch_size // self.rl.minibatches

    @property
    def micro_batch_rows(self) -> int:
        return self.compute.train_micro_batch_size or self.minibatch_rows

    def micro_batch_rows_on(self, platform: str, data: int) -> int:
        """Sequences per micro-batch on a mesh of `platform` with `data` data-parallel shards: the set value, or
        unset on a CPU mesh the largest even split of the minibatch of at most CPU_MICRO_BATCH_TOKENS (prompt +
        completion) per shard, at least one row each. The mesh's platform, not the host's: fit builds TPU
        programs on a CPU host."""
        if self.compute.train_micro_batch_size is not None or platform != "cpu" or self.minibatch_rows % data:
            return self.micro_batch_rows
        per_shard = self.minibatch_rows // data
        fit = max(1, CPU_MICRO_BATCH_TOKENS // (self.prompt_len + self.sampling.max_new_tokens))
        return data * max(d for d in range(1, min(fit, per_shard) + 1) if per_shard % d == 0)

    @property
    def sampler_mesh(self) -> dict[str, int]:
        """The (resolved) mesh axes the sampler runs on: placement.sampler when split, else the mesh, or each slice
        regrouped to sampling.tensor."""
        if self.placement.mode == "split":
            return self.placement.sampler.axes()
        t = self.sampling.tensor or self.mesh.tensor
        return {"slices": self.mesh.slices, "fsdp": self.mesh.fsdp * self.mesh.tensor // t, "tensor": t}

    @property
    def sample_chunk_rows(self) -> int:
        return min(self.sampling.max_num_sequences or self.batch_size, self.batch_size)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        B = self.batch_size
        if B % self.rl.minibatches:
            raise ValueError(f"rl.minibatches={self.rl.minibatches} must divide rl.prompts_per_step * "
                             f"rl.group_size = {B}")
        mb = self.compute.train_micro_batch_size
        if mb is not None and self.minibatch_rows % mb:
            raise ValueError(f"compute.train_micro_batch_size={mb} must divide the {self.minibatch_rows} sequences "
                             f"of a minibatch (rl.prompts_per_step * rl.group_size / rl.minibatches)")
        ns = self.sampling.max_num_sequences
        if ns is not None and ns < B and B % ns:
            raise ValueError(f"sampling.max_num_sequences={ns} must divide the {B} sequences of a step "
                             "(rl.prompts_per_step * rl.group_size)")
        if self.sampling.tensor is not None and not self.sampling.gather_weights:
            raise ValueError("sampling.tensor needs sampling.gather_weights: true (the sampler's gathered copy of the "
                             "weights is what takes its layout)")
        if self.sampling.tensor is not None and self.service is not None:
            raise ValueError("sampling.tensor: the service engine samples on the mesh as it is; unset it")
        if self.placement.mode == "split":
            if self.sampling.tensor is not None:
                raise ValueError("sampling.tensor: with placement.mode=split the sampler's tensor parallelism is "
                                 "placement.sampler.tensor; unset sampling.tensor")
            if self.lora is not None or self.service is not None:
                raise ValueError("placement.mode=split: not with lora or service (the adapters would be pushed "
                                 "with the frozen base every step); use placement.mode=colocated")
        saxes = self.placement.sampler.axes()
        if bad := [k for k, v in saxes.items() if v == 0 or v < -1]:
            raise ValueError(f"placement.sampler.{bad[0]}={saxes[bad[0]]}: axis sizes must be positive or -1 (infer)")
        if sum(v == -1 for v in saxes.values()) > 1:
            raise ValueError(f"placement.sampler: at most one axis may be -1, got {saxes}")
        if self.eval is not None and self.steps * self.rl.prompts_per_step >= EVAL_INDEX_OFFSET:
            raise ValueError(f"steps * rl.prompts_per_step must stay below {EVAL_INDEX_OFFSET}, where the eval's "
                             "held-out examples start")
        if self.init.from_ == "random" and self.model is None:
            raise ValueError("model: required when init.from is random")
        if self.service is not None and self.lora is None:
            raise ValueError("service: needs a lora section (lora.slots adapters of rank up to lora.rank)")
        if self.init.from_ == "hf":
            if not self.init.path and self.service is None:
                raise ValueError("init.path: required when init.from is hf (a local Hugging Face directory)")
            if self.model is not None:
                raise ValueError("model: must be omitted when init.from is hf (the checkpoint's config.json is used)")
        if self.model is not None:
            total = self.prompt_len + self.sampling.max_new_tokens
            if self.prompt_len <= 0 or total > self.model.max_seq_len:
                raise ValueError(
                    f"sampling.max_prompt_len ({self.prompt_len}) + sampling.max_new_tokens "
                    f"({self.sampling.max_new_tokens}) must be <= model.max_seq_len ({self.model.max_seq_len})"
                )
        axes = self.mesh.axes()
        bad = [k for k, v in axes.items() if v == 0 or v < -1]
        if bad:
            raise ValueError(f"mesh.{bad[0]}={axes[bad[0]]}: axis sizes must be positive or -1 (infer)")
        if sum(v == -1 for v in axes.values()) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got {axes}")
        return self


DEMO_CONFIG = "demo.yaml"


def default_config_path(name: str = DEMO_CONFIG) -> Path:
    """A bundled config (trainer/configs/NAME; the demo by default). In the trainer package (package data), so it
    works for regular and editable installs alike, e.g. in the trainer image."""
    return Path(__file__).resolve().parents[1] / "configs" / name


def _bundled_configs() -> dict[str, bool]:
    """Each bundled config (trainer/configs/) by file name: whether it has a service section."""
    out = {}
    for path in sorted(default_config_path().parent.glob("*.yaml")):
        data = yamlfile.load(path) or {}
        out[path.name] = isinstance(data, dict) and "service" in data
    return out


def bundled_configs() -> BundledConfigs:
    """The bundled configs (trainer/configs/) as the environment spec takes them: the RL training runs, and those
    with a service section, which configure the post-training service's engine instead (`python -m trainer`
    refuses them). envspec.config.parse_spec checks trainer.config and service.config against them: the spec sits
    below the trainer and cannot list trainer/configs/ itself."""
    # Here, not at the top: the trainer itself never parses an environment.
    from envspec.sections.fields import BundledConfigs

    kinds = _bundled_configs()
    return BundledConfigs(runs=tuple(n for n, service in kinds.items() if not service),
                          services=tuple(n for n, service in kinds.items() if service))


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value (e.g. rl.group_size=8)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: empty key segment")
    # YAML scalar parsing gives ints/floats/bools/null the same way as in the file.
    if not raw.strip():
        return parts, ""
    try:
        return parts, yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {item!r}: the value is not a YAML scalar, list or mapping ({err})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key: {key}")
        elif key:
            lines.append(f"{key}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(e["msg"].removeprefix("Value error, "))
    return "invalid config:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Load YAML (the embedded demo config when `path` is None) and apply `a.b=value` overrides.

    A bare file name that is not a file here names a bundled config (trainer/configs/), as the JobSet passes it
    (`--config qwen3-8b-grpo-v6e-4x4.yaml`: the image installs the package, not the repository).
    """
    file = Path(path) if path else default_config_path()
    if path and not file.exists() and file.name == path and default_config_path(path).is_file():
        file = default_config_path(path)
    if not file.is_file():
        bundled = sorted(p.name for p in default_config_path().parent.glob("*.yaml"))
        hint = f" (nor a bundled config: {', '.join(bundled)})" if path and file.name == path else ""
        raise ConfigError(f"cannot read config {file}: no such file{hint}")
    try:
        data = yamlfile.load(file) or {}
    except yamlfile.YamlFileError as err:
        raise ConfigError(f"config {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {file}: top level must be a mapping")
    return config_from_dict(apply_overrides(data, list(overrides or [])))


def with_model(cfg: TrainConfig, model: ModelConfig) -> TrainConfig:
    """Attach a model config read from a checkpoint, re-running the length checks."""
    data = cfg.model_dump(by_alias=True)
    data["model"] = model.model_dump()
    data["init"] = {"from": "random", "path": None}  # so validation accepts the explicit model
    checked = config_from_dict(data)
    return checked.model_copy(update={"init": cfg.init})


def _fill(axes: dict[str, int], n_devices: int, key: str) -> dict[str, int]:
    """`axes` with its -1 axis (if any) set so the mesh uses `n_devices`."""
    known = 1
    for v in axes.values():
        known *= v if v != -1 else 1
    out = dict(axes)
    for name, v in axes.items():
        if v == -1:
            if n_devices % known:
                raise ConfigError(
                    f"{key}.{name}=-1 cannot be inferred: {n_devices} devices are not divisible by the other "
                    f"axes' product {known} ({axes})"
                )
            out[name] = n_devices // known
    return out


def _size(axes: dict[str, int]) -> int:
    return axes["slices"] * axes["fsdp"] * axes["tensor"]


def _split_budgets(cfg: TrainConfig, n_devices: int) -> tuple[int, int]:
    """placement.mode=split: the devices each group's -1 axis is inferred from. A group without a -1 takes its own
    size; a group with one the rest; both with one: half each."""
    t, s = cfg.mesh.axes(), cfg.placement.sampler.axes()
    t_free, s_free = -1 in t.values(), -1 in s.values()
    if t_free and s_free:
        if n_devices % 2:
            raise ConfigError(f"placement.mode=split with a -1 axis in both mesh and placement.sampler splits the "
                              f"devices in half, but {n_devices} is odd: set one group's axes")
        return n_devices // 2, n_devices // 2
    fixed = 1
    for v in (s if t_free else t).values():
        fixed *= v
    if t_free:
        return n_devices - fixed, fixed
    if s_free:
        return fixed, n_devices - fixed
    return _size(t), _size(s)


def resolve_mesh(cfg: TrainConfig, n_devices: int, *, exact: bool = False) -> TrainConfig:
    """Fill a -1 mesh axis from the device count and check the mesh and batch fit; returns a new config.

    The mesh must divide the device count (a single process may use a subset); `exact` (multi-process)
    requires it to use every device, since each process must hold part of the mesh. With placement.mode=split,
    `mesh` and placement.sampler are two groups on disjoint devices: their sizes add up, and must fit in (`exact`:
    equal) the device count.
    """
    split = cfg.placement.mode == "split"
    t_budget, s_budget = _split_budgets(cfg, n_devices) if split else (n_devices, 0)
    if split and min(t_budget, s_budget) <= 0:
        raise ConfigError(f"placement.mode=split: mesh {cfg.mesh.axes()} and placement.sampler "
                          f"{cfg.placement.sampler.axes()} leave no devices for one group of the {n_devices}")
    axes = _fill(cfg.mesh.axes(), t_budget, "mesh")
    size = _size(axes)
    update: dict[str, Any] = {}
    if split:
        s_axes = _fill(cfg.placement.sampler.axes(), s_budget, "placement.sampler")
        total = size + _size(s_axes)
        if total > n_devices or (exact and total != n_devices):
            need = "equal" if exact else "fit in"
            raise ConfigError(
                f"placement.mode=split needs mesh ({axes['slices']} x {axes['fsdp']} x {axes['tensor']} = {size}) + "
                f"placement.sampler ({s_axes['slices']} x {s_axes['fsdp']} x {s_axes['tensor']} = {_size(s_axes)}) = "
                f"{total} devices, which must {need} the {n_devices} available devices"
            )
        s_data = s_axes["slices"] * s_axes["fsdp"]
        for key, n in (("rl.prompts_per_step * rl.group_size", cfg.batch_size),
                       ("sampling.max_num_sequences", cfg.sample_chunk_rows)):
            if n % s_data:
                raise ConfigError(f"{key} = {n} sequences must be divisible by the sampler's data axes "
                                  f"placement.sampler.slices * placement.sampler.fsdp = {s_data}")
        update["placement"] = cfg.placement.model_copy(
            update={"sampler": cfg.placement.sampler.model_copy(update=s_axes)})
    elif n_devices % size or (exact and size != n_devices):
        need = "equal" if exact else "divide"
        raise ConfigError(
            f"mesh slices={axes['slices']} x fsdp={axes['fsdp']} x tensor={axes['tensor']} = {size} devices "
            f"must {need} the {n_devices} available devices"
        )
    data = axes["slices"] * axes["fsdp"]
    if cfg.batch_size % data:
        raise ConfigError(
            f"rl.prompts_per_step * rl.group_size = {cfg.rl.prompts_per_step} * {cfg.rl.group_size} = "
            f"{cfg.batch_size} must be divisible by the data axes mesh.slices * mesh.fsdp = {data}"
        )
    for key, n, what in _batch_splits(cfg):
        if n % data:
            raise ConfigError(
                f"{key} = {n} {what} must be divisible by the data axes mesh.slices * mesh.fsdp = {data}, so every "
                "data-parallel device gets an equal share"
            )
    st = cfg.sampling.tensor
    within = axes["fsdp"] * axes["tensor"]
    if st is not None and (st % axes["tensor"] or within % st):
        allowed = [axes["tensor"] * k for k in range(1, axes["fsdp"] + 1) if axes["fsdp"] % k == 0]
        raise ConfigError(f"sampling.tensor={st} must be a multiple of mesh.tensor={axes['tensor']} dividing "
                          f"mesh.fsdp * mesh.tensor = {within}: one of {allowed}")
    return cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update=axes), **update})


def _batch_splits(cfg: TrainConfig) -> list[tuple[str, int, str]]:
    """(key, rows, description) of each piece the step cuts the batch into; each must split over the data axes.
    The whole batch is checked before these (resolve_mesh), so only the options that cut it appear."""
    out = []
    if cfg.rl.minibatches > 1:
        out.append(("rl.prompts_per_step * rl.group_size / rl.minibatches", cfg.minibatch_rows,
                    "sequences per minibatch"))
    if cfg.compute.train_micro_batch_size is not None:
        out.append(("compute.train_micro_batch_size", cfg.micro_batch_rows, "sequences per micro-batch"))
    if cfg.sampling.max_num_sequences is not None:
        out.append(("sampling.max_num_sequences", cfg.sample_chunk_rows, "sequences sampled at once"))
    return out
