"""Estimates behind `gke-tpu-rl fit`'s advice and `fit --search`: a program's HBM per device as a function of the
settings that trade memory for time, and a relative time model to order candidate settings by.

Memory: the tensors that scale with each setting, per device: the weights, optimizer state and reference copy
(state), and the largest live activations (temporaries): per decoder layer its fp32 attention scores (none where
Pallas' flash kernel runs: a pass without a KV cache on TPU, the sampler's prefill from slot 0) and its
[rows, tokens, width] intermediates, what remat keeps of them for the backward pass, the fp32 [rows, chunk, vocab]
logits of a log-prob chunk, the gradient (and accumulation) buffers, the sampler's KV cache. The update's
temporaries are the larger of two phases (the backward pass of one layer, and the log-prob head over every kept
layer), as XLA's buffer assignment reuses memory between them. XLA fuses and reuses more than this counts, so the
temporaries are scaled by a factor calibrated on a compiled program (`calibration`): a saving is
state difference + factor x temporaries difference. Checked against libtpu 0.0.42.1 compiles on v5e of programs
with hundreds of MiB of temporaries (the update under remat, micro-batches, log-prob chunks, dtypes: within 30%;
the sampler under sampling chunks, gather_weights, dtype: within 40%). Programs of a few MiB are not modelled:
libtpu keeps much of them out of HBM (a 256-token update of a tiny model needs 12 MiB, a 512-token one 256 MiB).
So an estimate orders and prunes candidates; only a compile says whether one fits.

Time (for ordering only): per micro-batch a roofline of the executed FLOPs (trainer/fit/flops.py, remat included)
against the weights every pass reads (FSDP gathers them per micro-batch), the head re-read per log-prob chunk;
sampling as the report estimates it (`sample_seconds`).

LoRA (a `lora:` section): the programs take {"base": frozen weights, "lora": the adapter stack}, so the state is the
base plus the adapters, and the optimizer state, the gradient and its accumulator cover the adapters alone (`state`);
the reference policy is the base inside the params (no copy). The adapters shard like the base weight they adapt
(trainer/model/sharding.py), their slot and rank dims replicated: `_sharded` counts what one device holds of each leaf.
FLOPs (`step_flops`): the adapters' two matmuls run for every slot of the stack (model.lora_delta), and the backward
pass computes no gradient of the frozen weights (only the activations' gradient through them).

The service (a `service:` section, trainer/service/programs.py): one base model, `lora.slots` adapters of rank
lora.rank on every target, float32, each held four times (weights, Adam m and v, the gradient accumulator). Its
forward_backward passes hold rows x bucketed length tokens; `service_passes` (trainer/service/passes.py, the engine's
own rule) picks the shapes the engine runs, `service_memory` and `service_flops` model them as the RL update is
modelled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from trainer.base.config import LoraConfig, ModelConfig, OptimConfig, TrainConfig
from trainer.fit.flops import StepFlops, _fwd_flops, param_count
from trainer.fit.flops import step_flops as _dense_step_flops
from trainer.service.passes import Pass
from trainer.service.passes import service_longest_datum as service_longest_datum
from trainer.service.passes import service_passes as service_passes  # re-exported: fit sizes the passes here
from trainer.service.shapes import stack_config

F32 = 4
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Calibration factors outside this range mean the model missed something; clamp rather than extrapolate wildly.
_K_RANGE = (0.1, 10.0)


@dataclass(frozen=True)
class Layout:
    """How a resolved mesh splits the work: rows over `data` devices, parameters over `shards`."""

    data: int  # batch shards: slices x fsdp
    shards: int  # parameter shards: fsdp (x slices with fsdp_across_slices) x tensor
    tensor: int
    devices: int

    @classmethod
    def of(cls, cfg: TrainConfig) -> Layout:
        m = cfg.mesh
        across = m.slices if m.fsdp_across_slices else 1
        return cls(m.slices * m.fsdp, m.fsdp * across * m.tensor, m.tensor, m.slices * m.fsdp * m.tensor)

    @classmethod
    def running(cls, cfg: TrainConfig, program: str) -> Layout:
        """The layout `program` runs on: with placement.mode=split, sampling runs on placement.sampler's devices."""
        if program != "sample" or cfg.placement.mode != "split":
            return cls.of(cfg)
        s = cfg.placement.sampler
        return cls(s.slices * s.fsdp, s.fsdp * s.tensor, s.tensor, s.slices * s.fsdp * s.tensor)

    @classmethod
    def job_devices(cls, cfg: TrainConfig) -> int:
        """Every device of the job: the update's mesh, and the sampler's when split."""
        return cls.of(cfg).devices + (cls.running(cfg, "sample").devices if cfg.placement.mode == "split" else 0)

    def regrouped(self, tensor: int | None) -> Layout:
        """The sampler's layout: each slice's devices regrouped to a tensor axis of `tensor` (sampling.tensor)."""
        if tensor is None or tensor == self.tensor:
            return self
        return Layout(self.devices // tensor, self.shards, tensor, self.devices)

    def doubled(self) -> Layout:
        """Twice the chips, as a larger topology: fsdp (data and parameter shards) doubles."""
        return Layout(2 * self.data, 2 * self.shards, self.tensor, 2 * self.devices)


@dataclass(frozen=True)
class Memory:
    """One program's bytes per device: state (arguments and resident) and analytic temporaries."""

    state: float
    temp: float


def _b(dtype: str) -> int:
    return _BYTES.get(dtype, 4)


def _split(n: int, t: int) -> float:
    # An axis tensor does not divide stays whole on every device (the rules leave it unsharded).
    return n / t if n % t == 0 else float(n)


@functools.lru_cache(maxsize=64)
def _params(m: ModelConfig) -> int:
    return param_count(m)


@functools.lru_cache(maxsize=64)
def _opt_bytes(m: ModelConfig, optim: OptimConfig) -> int:
    """Optimizer state bytes (whole model): optax's own state shapes for these parameters."""
    import jax

    from trainer.model.decoder import abstract_params
    from trainer.rl.optim import make_optimizer

    shapes = jax.eval_shape(make_optimizer(optim, 1).init, abstract_params(m))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


# Logical axis -> the mesh axis trainer/model/sharding.py's RULES put it on ("fsdp": fsdp, or slices x fsdp with
# fsdp_across_slices); every other name is replicated.
_AXIS = {"vocab": "tensor", "q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "embed": "fsdp"}


def _sharded(shape: tuple[int, ...], axes: tuple[str | None, ...], lay: Layout) -> float:
    """Elements of one leaf one device holds, as sharding.logical_to_spec splits it: a dim its mesh axes do not divide,
    or whose mesh axis an earlier dim took, stays whole."""
    sizes = {"tensor": lay.tensor, "fsdp": lay.shards // lay.tensor}
    n, used = 1.0, set()
    for d, name in zip(shape, axes, strict=True):
        ax = _AXIS.get(name or "")
        if ax is not None and ax not in used and d % sizes[ax] == 0:
            used.add(ax)
            n *= d / sizes[ax]
        else:
            n *= d
    return n


def _is_shape(x: object) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


@functools.lru_cache(maxsize=64)
def lora_param_count(m: ModelConfig, lcfg: LoraConfig) -> int:
    """Parameters of the whole adapter stack (every slot, every target), from trainer/model/lora.py's `lora_shapes`."""
    import jax

    from trainer.model.lora import lora_shapes

    return sum(math.prod(s) for s in jax.tree.leaves(lora_shapes(m, lcfg), is_leaf=_is_shape))


def lora_per_device(m: ModelConfig, lcfg: LoraConfig, lay: Layout) -> float:
    """Adapter parameters one device holds (they shard like the base weight they adapt; slots and rank replicated)."""
    return _lora_per_device(m, lcfg, lay.tensor, lay.shards)


@functools.lru_cache(maxsize=64)
def _lora_per_device(m: ModelConfig, lcfg: LoraConfig, tensor: int, shards: int) -> float:
    import jax

    from trainer.model.lora import lora_axes, lora_shapes

    lay = Layout(1, shards, tensor, shards)
    shapes = jax.tree.leaves(lora_shapes(m, lcfg), is_leaf=_is_shape)
    axes = jax.tree.leaves(lora_axes(m, lcfg), is_leaf=lambda x: isinstance(x, tuple))
    return sum(_sharded(s, a, lay) for s, a in zip(shapes, axes, strict=True))


@functools.lru_cache(maxsize=64)
def _lora_opt_bytes(m: ModelConfig, lcfg: LoraConfig, optim: OptimConfig) -> tuple[int, int]:
    """(bytes of the optimizer state's adapter-shaped leaves, bytes of the rest: step counts) for the adapters, with
    the per-slot clip the trainer uses (trainer/rl/step.py)."""
    import jax

    from trainer.model.lora import abstract_lora, clip_by_slot_norm
    from trainer.rl.optim import make_optimizer

    train = abstract_lora(m, lcfg)
    shapes = jax.eval_shape(make_optimizer(optim, 1, clip=clip_by_slot_norm(optim.clip_norm)).init, train)
    big = {x.shape for x in jax.tree.leaves(train)}
    leaves = jax.tree.leaves(shapes)
    moments = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves if x.shape in big)
    return moments, sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves if x.shape not in big)


@dataclass(frozen=True)
class State:
    """The RL trainer's state per device (bytes), by kind. Without lora every weight is trained; with lora `base` is
    the frozen base and optimizer, gradients and accumulator cover the adapters alone."""

    base: float  # the weights (with lora: the frozen base)
    adapters: float  # the lora adapter stack (0 without lora)
    optimizer: float  # optax's state for what is trained
    gradients: float  # one gradient of what is trained (a temporary of the update)
    accumulator: float  # the gradient-accumulation buffer (train_micro_batch_size < the minibatch), else 0
    reference: float  # the reference copy of the weights (rl.kl_beta > 0 without lora; with lora the base is it)

    @property
    def weights(self) -> float:
        return self.base + self.adapters


def state(cfg: TrainConfig, lay: Layout | None = None) -> State:
    """The training state of a resolved config, per device (see `State`)."""
    lay = lay or Layout.of(cfg)
    m, c = cfg.model_cfg, cfg.compute
    pb = _b(m.param_dtype)
    base = _params(m) * pb / lay.shards
    accumulate = cfg.micro_batch_rows < cfg.minibatch_rows
    if cfg.lora is None:
        return State(base, 0.0, _opt_bytes(m, cfg.optim) / lay.shards, base,
                     _params(m) * _b(c.grad_accum_dtype) / lay.shards if accumulate else 0.0,
                     base if cfg.rl.kl_beta > 0 else 0.0)
    n_dev = lora_per_device(m, cfg.lora, lay)
    moments, scalars = _lora_opt_bytes(m, cfg.lora, cfg.optim)
    # The moments shard as the adapters do; the step counts are replicated.
    opt = moments * n_dev / lora_param_count(m, cfg.lora) + scalars
    return State(base, n_dev * pb, opt, n_dev * pb, n_dev * _b(c.grad_accum_dtype) if accumulate else 0.0, 0.0)


def _layer(m: ModelConfig, lay: Layout, rows: float, T: int, S: int, cb: int, low_rank: int = 0,
           flash: bool = False) -> float:
    """One decoder layer's forward intermediates for `rows` rows of T queries over S keys, on one device;
    `low_rank`: the lora slots x rank x layer targets of the adapters' [rows, T, slots, rank] activations (each and its
    gated copy); `flash`: the attention runs in the flash kernel, which keeps no [T, S] scores, only each query's
    log-sum-exp for the backward pass."""
    H, K, F = _split(m.n_heads, lay.tensor), _split(m.n_kv_heads, lay.tensor), _split(m.d_ff, lay.tensor)
    acts = rows * T * cb * (4 * m.d_model + 3 * H * m.head_dim + 4 * K * m.head_dim + 4 * F + 2 * low_rank)
    # Else fp32 scores, their masked copy and the probabilities in the compute dtype: an upper bound (libtpu fuses
    # them; a v6e update of 1024-token rows holds a quarter of it, tests/trainer/test_fit.py), kept as the search's
    # scenarios were tuned on it.
    scores = rows * H * T * (F32 if flash else S * (2 * F32 + cb))
    return acts + scores


def _flash(cfg: TrainConfig, T: int) -> bool:
    """Whether a pass of T tokens without a KV cache (or a prefill from slot 0) runs the flash kernel on the TPU that
    fit compiles for: `attention.no_cache_attention` decides, as `decoder.forward` does."""
    from trainer.model.attention import no_cache_attention

    return no_cache_attention(cfg.compute.on_platform("tpu"), T) == "flash"


def _low_rank(lcfg: LoraConfig | None) -> int:
    return 0 if lcfg is None else lcfg.slots * lcfg.rank * sum(t != "lm_head" for t in lcfg.targets)


def _kept(m: ModelConfig, lay: Layout, rows: float, T: int, cb: int, remat: str, ws: float) -> float:
    """What one layer keeps for the backward pass besides its input (compute.remat)."""
    if remat == "full":
        return 0.0
    if remat == "dots":  # outputs of the weight matmuls: q, k, v, o, gate, up, down
        H, K, F = _split(m.n_heads, lay.tensor), _split(m.n_kv_heads, lay.tensor), _split(m.d_ff, lay.tensor)
        return rows * T * cb * (H * m.head_dim + 2 * K * m.head_dim + 2 * m.d_model + 2 * F)
    return ws


def memory(cfg: TrainConfig, program: str, lay: Layout | None = None) -> Memory:
    """Estimated bytes per device of `program` for a resolved config (model attached, mesh axes known)."""
    lay = lay or Layout.of(cfg)
    m, c = cfg.model_cfg, cfg.compute
    cb = _b(cfg.compute_dtype)
    n = _params(m)
    st = state(cfg, lay)
    params, opt, ref = st.weights, st.optimizer, st.reference
    lr = _low_rank(cfg.lora)
    P, N = cfg.prompt_len, cfg.sampling.max_new_tokens
    T, D, L = P + N, m.d_model, m.n_layers
    V = _split(m.vocab_size, lay.tensor)
    C = min(c.logprob_chunk, N)
    if program == "sample":
        sl = lay.regrouped(cfg.sampling.tensor)
        r, V = cfg.sample_chunk_rows / sl.data, _split(m.vocab_size, sl.tensor)
        kv = L * r * T * 2 * _split(m.n_kv_heads, sl.tensor) * m.head_dim * cb
        # gather_weights keeps a whole compute-dtype copy; without it, the sampler's compute-dtype copy stays
        # sharded as trained (made once before the loop) and FSDP gathers one layer of it at a time.
        if cfg.sampling.gather_weights:
            gathered = n * cb / sl.tensor
        else:
            gathered = n * cb / sl.tensor / L + (n * cb / lay.shards if cb < _b(m.param_dtype) else 0.0)
        # A prefill from slot 0 attends its own P tokens (the flash kernel where P fills its blocks); a continuous
        # batching refill, one row per data-parallel group, attends the cache's T slots.
        prefill = _layer(m, sl, r, P, P, cb, lr, _flash(cfg, P))
        continuous = cfg.sampling.continuous_batching and cfg.sample_chunk_rows < cfg.batch_size
        refill = _layer(m, sl, 1, P, T, cb, lr) if continuous else 0.0
        temp = kv + gathered + max(prefill, refill, 3 * r * V * F32)
        return Memory(params + opt + ref, temp)
    if program == "ref_logprobs":
        r = cfg.batch_size / lay.data
        head = 2 * r * C * V * F32 + r * N * D * cb
        temp = r * T * D * cb + max(_layer(m, lay, r, T, T, cb, flash=_flash(cfg, T)), head)
        # Without lora the reference copy is the argument and the policy is resident; with lora both are the params.
        return Memory((params if cfg.lora is not None else 2 * params) + opt, temp)
    r = cfg.micro_batch_rows / lay.data
    ws = _layer(m, lay, r, T, T, cb, lr, _flash(cfg, T))
    keep = _kept(m, lay, r, T, cb, c.remat, ws)
    inputs = r * T * D * cb  # scan keeps every layer's input whatever remat does
    head = 4 * r * C * V * F32 + r * N * D * (cb + F32)
    phase = max(L * inputs + (L - 1) * keep + ws, L * (inputs + keep) + head)
    return Memory(params + opt + ref, phase + st.gradients + st.accumulator)


# ---------------------------------------------------------------------------------------------- FLOPs with lora


def _adapter_fwd(m: ModelConfig, lcfg: LoraConfig, slots: int, tokens: float, logit_rows: float) -> float:
    """FLOPs of the adapters' forward matmuls for one row: `tokens` through every layer's targets, `logit_rows`
    positions through an lm_head adapter; (x A) and (h B) for `slots` slots at once (model.lora_delta)."""
    D, H, K, E, F = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    dims = {"q_proj": D + H * E, "k_proj": D + K * E, "v_proj": D + K * E, "o_proj": H * E + D,
            "gate_proj": D + F, "up_proj": D + F, "down_proj": F + D}
    per_token = sum(dims[t] for t in lcfg.targets if t != "lm_head")
    head = D + m.vocab_size if "lm_head" in lcfg.targets else 0
    return 2 * slots * lcfg.rank * (m.n_layers * per_token * tokens + head * logit_rows)


def step_flops(cfg: TrainConfig) -> StepFlops:
    """trainer/fit/flops.py's FLOPs of one RL step, with lora's: the adapters' matmuls (for every slot of the stack, as
    executed; for the row's own slot, as model FLOPs), and no gradient of the frozen weights in the backward pass."""
    dense = _dense_step_flops(cfg)
    lcfg = cfg.lora
    if lcfg is None:
        return dense
    m, B, P, N = cfg.model_cfg, cfg.batch_size, cfg.prompt_len, cfg.sampling.max_new_tokens
    T, S, mu = P + N, lcfg.slots, cfg.rl.mu_iterations
    chunk = min(cfg.compute.logprob_chunk, N)
    n_head = -(-N // chunk) * chunk
    prefill = dense.prefill_row + _adapter_fwd(m, lcfg, S, P, 1)
    decode = dense.decode_row + _adapter_fwd(m, lcfg, S, 1, 1)
    # The weights' gradient is the matmul FLOPs of a forward pass (the head's over its padded chunks).
    wgrad, wgrad_model = _fwd_flops(m, T, 0, n_head), _fwd_flops(m, T, 0, N)
    a_fwd, a_head = _adapter_fwd(m, lcfg, S, T, n_head), _adapter_fwd(m, lcfg, S, 0, n_head)
    a_remat = {"none": 0.0, "full": a_fwd - a_head, "dots": 0.0}[cfg.compute.remat]
    one = _adapter_fwd(m, lcfg, 1, T, N)  # the row's own slot
    executed = dict(dense.executed)
    model = dict(dense.model)
    executed["sample"] = B * (prefill + N * decode)
    executed["update"] = dense.executed["update"] + B * mu * (3 * a_fwd + a_head + a_remat - wgrad)
    model["sample"] = dense.model["sample"] + B * _adapter_fwd(m, lcfg, 1, T, 1)
    model["update"] = dense.model["update"] + B * mu * (3 * one - wgrad_model)
    return StepFlops(executed, model, prefill, decode)


# ---------------------------------------------------------------------------------------------- the service


@dataclass(frozen=True)
class ServiceState:
    """The engine's state per device (bytes): the frozen base and four float32 adapter stacks."""

    base: float
    stack: float  # one adapter stack (every slot, every target), float32
    stack_params: int  # parameters of one stack (every slot)

    @property
    def adapters(self) -> float:
        return 4 * self.stack  # weights, Adam m, Adam v, the gradient accumulator

    @property
    def total(self) -> float:
        return self.base + self.adapters


def service_state(cfg: TrainConfig, lay: Layout | None = None) -> ServiceState:
    lay = lay or Layout.of(cfg)
    m, stack = cfg.model_cfg, stack_config(cfg)
    return ServiceState(_params(m) * _b(m.param_dtype) / lay.shards, lora_per_device(m, stack, lay) * F32,
                        lora_param_count(m, stack))


def service_memory(cfg: TrainConfig, program: str, p: Pass | None = None, lay: Layout | None = None) -> Memory:
    """Estimated bytes per device of a service program: `forward_backward` at pass `p`, or `optim_step`. The state is
    the same for both (base + 4 stacks: the arguments and what stays resident beside them)."""
    lay = lay or Layout.of(cfg)
    st = service_state(cfg, lay)
    if program == "optim_step" or p is None:  # elementwise over the stacks, every one donated: updated in place
        return Memory(st.total, 0.0)
    m, c = cfg.model_cfg, cfg.compute
    cb = _b(cfg.compute_dtype)
    r, T, D, L = p.rows / lay.data, p.length, m.d_model, m.n_layers
    V = _split(m.vocab_size, lay.tensor)
    C = min(c.logprob_chunk, T)
    stack = stack_config(cfg)
    ws = _layer(m, lay, r, T, T, cb, _low_rank(stack), _flash(cfg, T))
    keep = _kept(m, lay, r, T, cb, c.remat, ws)
    inputs = r * T * D * cb
    head = 4 * r * C * V * F32 + r * T * D * (cb + F32) + 2 * r * T * stack.slots * stack.rank * cb
    phase = max(L * inputs + (L - 1) * keep + ws, L * (inputs + keep) + head)
    # The pass's float32 gradient of the stack (added into the accumulator) and the adapters in the compute dtype.
    return Memory(st.total, phase + st.stack + st.stack * cb / F32)


def service_flops(cfg: TrainConfig, p: Pass) -> tuple[float, float]:
    """(executed, model) FLOPs of one forward_backward pass (all devices): the whole [T, T] attention, the log-prob
    head over padded chunks (recomputed in the backward), remat, the adapters for every slot; no gradient of the
    frozen base. Model FLOPs: causal attention, no remat, the row's own slot."""
    m, c = cfg.model_cfg, cfg.compute
    stack = stack_config(cfg)
    T = p.length
    chunk = min(c.logprob_chunk, T)
    n_head = -(-T // chunk) * chunk
    fwd = _fwd_flops(m, T, T * T, n_head)
    head = 2 * m.d_model * m.vocab_size * n_head
    attn = 4 * m.n_heads * m.head_dim * m.n_layers * T * T
    a_fwd, a_head = _adapter_fwd(m, stack, stack.slots, T, n_head), _adapter_fwd(m, stack, stack.slots, 0, n_head)
    remat = {"none": 0.0, "full": fwd - head + a_fwd - a_head, "dots": attn}[c.remat]
    executed = 3 * fwd + head - _fwd_flops(m, T, 0, n_head) + 3 * a_fwd + a_head + remat
    model = 3 * _fwd_flops(m, T, T * (T + 1) / 2, T) - _fwd_flops(m, T, 0, T) + 3 * _adapter_fwd(m, stack, 1, T, T)
    return p.rows * executed, p.rows * model


def measured_temp(p: object) -> float:
    """A compiled program's temporaries; for one the compiler refused, the figure its message gave."""
    if getattr(p, "oom_message", None) is not None:
        return float(getattr(p, "oom_required", None) or 0)
    return float(getattr(p, "temp", 0))


def calibration(analytic: Memory, measured: float) -> float:
    """The factor that maps the analytic temporaries onto what the compiler measured."""
    if analytic.temp <= 0 or measured <= 0:
        return 1.0
    return min(max(measured / analytic.temp, _K_RANGE[0]), _K_RANGE[1])


def saving(base: Memory, other: Memory, k: float) -> float:
    """Estimated bytes per device `other` saves against `base` (negative: it costs)."""
    return (base.state - other.state) + k * (base.temp - other.temp)


# ---------------------------------------------------------------------------------------------- time


def sample_seconds(cfg: TrainConfig, n_devices: int, flops: StepFlops, peak: float, bw: float) -> float:
    """Sampling time: per chunk of sampling.max_num_sequences, prefill + max_new_tokens decode steps, each a
    roofline of its FLOPs against the HBM it reads (the weights and the KV cache); peak and bw per device."""
    import jax.numpy as jnp

    m, sm = cfg.model_cfg, cfg.sampler_mesh
    rows = cfg.sample_chunk_rows
    chunks = cfg.batch_size // rows
    S = cfg.prompt_len + cfg.sampling.max_new_tokens
    data = sm["slices"] * sm["fsdp"]
    # Each device reads the weights of its tensor shard once per forward pass and its rows' KV cache (sharded over
    # kv heads when the sampler's tensor axis divides them). Without sampling.gather_weights FSDP gathers every
    # layer at every step: priced as reading the weights in their stored dtype (a proxy for that traffic).
    gathered = getattr(cfg.sampling, "gather_weights", False)
    weights = param_count(m) * jnp.dtype(cfg.compute_dtype if gathered else m.param_dtype).itemsize / sm["tensor"]
    kv_shards = sm["tensor"] if m.n_kv_heads % sm["tensor"] == 0 else 1
    kv = rows / data * S * m.n_layers * 2 * m.n_kv_heads * m.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    kv /= kv_shards
    hbm_s = (weights + kv) / bw
    prefill = max(rows * flops.prefill_row / (n_devices * peak), hbm_s)
    decode = max(rows * flops.decode_row / (n_devices * peak), hbm_s)
    return chunks * (prefill + cfg.sampling.max_new_tokens * decode)


def seconds(cfg: TrainConfig, program: str, peak: float, bw: float) -> float:
    """A relative time of `program` (peak FLOP/s and HBM bytes/s per device) to order candidate settings by."""
    lay = Layout.of(cfg)
    flops = step_flops(cfg)  # with lora's adapters
    if program == "sample":
        return sample_seconds(cfg, lay.devices, flops, peak, bw)
    m, N = cfg.model_cfg, cfg.sampling.max_new_tokens
    cb = _b(cfg.compute_dtype)
    weights = _params(m) * cb / lay.tensor  # what FSDP gathers into each device per pass
    head = m.vocab_size * m.d_model * cb / lay.tensor
    chunks = -(-N // min(cfg.compute.logprob_chunk, N))
    if program == "ref_logprobs":
        return max(flops.executed[program] / lay.devices / peak, (weights + chunks * head) / bw)
    steps = cfg.rl.mu_iterations * cfg.rl.minibatches * (cfg.minibatch_rows // cfg.micro_batch_rows)
    passes = 3 if cfg.compute.remat != "none" else 2  # forward, backward (and the recomputed forward)
    per_step = max(flops.executed[program] / steps / lay.devices / peak,
                   (passes * weights + 3 * chunks * head) / bw)
    return steps * per_step
