"""Estimates behind `gke-tpu-rl fit`'s advice and `fit --search`: a program's HBM per device as a function of the
settings that trade memory for time, and a relative time model to order candidate settings by.

Memory: the tensors that scale with each setting, per device: the weights, optimizer state and reference copy
(state), and the largest live activations (temporaries): per decoder layer its fp32 attention scores and its
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

Time (for ordering only): per micro-batch a roofline of the executed FLOPs (trainer/flops.py, remat included)
against the weights every pass reads (FSDP gathers them per micro-batch), the head re-read per log-prob chunk;
sampling as the report estimates it (`sample_seconds`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from trainer.config import ModelConfig, OptimConfig, TrainConfig
from trainer.flops import StepFlops, param_count, step_flops

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

    from trainer.model import abstract_params
    from trainer.optim import make_optimizer

    shapes = jax.eval_shape(make_optimizer(optim, 1).init, abstract_params(m))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def _layer(m: ModelConfig, lay: Layout, rows: float, T: int, S: int, cb: int) -> float:
    """One decoder layer's forward intermediates for `rows` rows of T queries over S keys, on one device."""
    H, K, F = _split(m.n_heads, lay.tensor), _split(m.n_kv_heads, lay.tensor), _split(m.d_ff, lay.tensor)
    acts = rows * T * cb * (4 * m.d_model + 3 * H * m.head_dim + 4 * K * m.head_dim + 4 * F)
    scores = rows * H * T * S * (2 * F32 + cb)  # fp32 scores and their masked copy, probs in the compute dtype
    return acts + scores


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
    pb, cb = _b(m.param_dtype), _b(cfg.compute_dtype)
    n = _params(m)
    params = n * pb / lay.shards
    opt = _opt_bytes(m, cfg.optim) / lay.shards
    ref = params if cfg.rl.kl_beta > 0 else 0.0
    P, N = cfg.prompt_len, cfg.sampling.max_new_tokens
    T, D, L = P + N, m.d_model, m.n_layers
    V = _split(m.vocab_size, lay.tensor)
    C = min(c.logprob_chunk, N)
    if program == "sample":
        r = cfg.sample_chunk_rows / lay.data
        kv = L * r * T * 2 * _split(m.n_kv_heads, lay.tensor) * m.head_dim * cb
        # FSDP gathers one layer's weights at a time; gather_weights keeps a whole compute-dtype copy.
        gathered = n * cb / lay.tensor / (1 if cfg.sampling.gather_weights else L)
        temp = kv + gathered + max(_layer(m, lay, r, P, T, cb), 3 * r * V * F32)
        return Memory(params + opt + ref, temp)
    if program == "ref_logprobs":
        r = cfg.batch_size / lay.data
        head = 2 * r * C * V * F32 + r * N * D * cb
        temp = r * T * D * cb + max(_layer(m, lay, r, T, T, cb), head)
        return Memory(2 * params + opt, temp)
    r = cfg.micro_batch_rows / lay.data
    ws = _layer(m, lay, r, T, T, cb)
    keep = _kept(m, lay, r, T, cb, c.remat, ws)
    inputs = r * T * D * cb  # scan keeps every layer's input whatever remat does
    head = 4 * r * C * V * F32 + r * N * D * (cb + F32)
    phase = max(L * inputs + (L - 1) * keep + ws, L * (inputs + keep) + head)
    grads = n * pb / lay.shards
    accum = n * _b(c.grad_accum_dtype) / lay.shards if cfg.micro_batch_rows < cfg.minibatch_rows else 0.0
    return Memory(params + opt + ref, phase + grads + accum)


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

    m, mesh = cfg.model_cfg, cfg.mesh
    rows = cfg.sample_chunk_rows
    chunks = cfg.batch_size // rows
    S = cfg.prompt_len + cfg.sampling.max_new_tokens
    data = mesh.slices * mesh.fsdp
    # Each device reads the weights of its tensor shard once per forward pass (FSDP gathers the rest; with
    # sampling.gather_weights a compute-dtype copy gathered once per step) and its rows' KV cache (sharded over kv
    # heads when mesh.tensor divides them).
    gathered = getattr(cfg.sampling, "gather_weights", False)
    weights = param_count(m) * jnp.dtype(cfg.compute_dtype if gathered else m.param_dtype).itemsize / mesh.tensor
    kv_shards = mesh.tensor if m.n_kv_heads % mesh.tensor == 0 else 1
    kv = rows / data * S * m.n_layers * 2 * m.n_kv_heads * m.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    kv /= kv_shards
    hbm_s = (weights + kv) / bw
    prefill = max(rows * flops.prefill_row / (n_devices * peak), hbm_s)
    decode = max(rows * flops.decode_row / (n_devices * peak), hbm_s)
    return chunks * (prefill + cfg.sampling.max_new_tokens * decode)


def seconds(cfg: TrainConfig, program: str, peak: float, bw: float) -> float:
    """A relative time of `program` (peak FLOP/s and HBM bytes/s per device) to order candidate settings by."""
    lay = Layout.of(cfg)
    flops = step_flops(cfg)
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
