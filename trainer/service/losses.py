"""Tinker's built-in loss functions as pure JAX over a padded, mixed batch.

One jitted program serves a batch whose rows come from many requests: every row (one Datum) carries its own loss
id and config scalars, all six losses are computed elementwise and each row keeps its own (`jnp.select`), so a
batch mixing cross_entropy, ppo and gspo rows from different users is one call. Arrays are [B, T]: B rows (datums,
plus padding rows), T positions (each datum's N = model_input.length positions, then padding); position i
predicts token i+1. `mask` is 1 on a datum's own N positions and 0 on padding.

Semantics are Tinker's documented ones (per token, then a plain SUM over tokens; sources cite each formula):
  cross_entropy        loss = -sum_t logp_t * w_t
  importance_sampling  loss = -sum_t r_t * A_t                                 r_t = exp(logp_t - q_t)
  ppo                  loss = -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)       lo/hi default 0.8/1.2
  cispo                loss = -sum_t sg(clip(r_t, lo, hi)) * logp_t * A_t      lo/hi default 0.0/4.0
  dro                  loss = -sum_t (logp_t A_t - beta/2 (logp_t - q_t)^2)    beta required
  gspo (GSPO-token)    s = exp(sg(mean_{t in M}(logp_t - q_t))), s_t = s * exp(logp_t - sg(logp_t));
                       loss = -sum_t min(s_t A_t, clip(s_t, lo, hi) A_t)        M = sequence_ratio_mask != 0
  stable_reinforce     loss = -sum_{t in S} sg(min(r_t, C)) * exp(logp_t - sg(logp_t)) * A_t    C default 2.0
                       (truncated importance-sampling REINFORCE; S = the sampled positions, q the sampler's
                       log-probs as the service recorded them: see below)
logp is the current model's log-prob of target_tokens, q the sampler's `logprobs`, A `advantages`, w `weights`,
sg stop-gradient. `weights` is read by cross_entropy only: Tinker's RL losses take no weights (prompt positions
come with A = 0 and contribute nothing); the `mask` here only removes padding.

Gradient scaling (the thing that differs most from other RL trainers): nothing is divided by a token count, a
sequence count or a batch size. `LossOutput.total` = sum over rows of each row's token SUM, and d total/d theta
is what the engine must add into the model's gradient; a request's `loss:sum` metric is the sum of its own rows'
sums. Because the SDK splits one forward_backward into chunks sent in parallel and reduces "loss:sum" by summing
them, only summing gradients across chunks (and across forward_backward calls until optim_step) gives the same
update as the unsplit call: the optimizer must see the plain sum, never a mean. A user who wants a mean scales
their advantages/weights (Tinker docs: "include that in the advantage tensor computation").

Clip ties follow the torch code in the docs: torch.clamp passes the gradient at a bound and torch.min splits a tie
evenly, so at r == hi (A > 0) or r == lo (A < 0) the token keeps its full gradient; plain jnp.clip/jnp.minimum
would give 3/4 of it there. ppo and gspo use the RL trainer's own surrogate (trainer/rl/losses.py
`clipped_surrogate`, checked against torch), so the two cannot drift apart.

stable_reinforce: Tinker's docs define its inputs (a sampler made with record_stability_info=True, provenance spans
on every datum naming the sampled sequences) but not its objective. This service's is token-level truncated
importance sampling: each sampled token's REINFORCE gradient -A_t grad logp_t is weighted by the ratio of the
current policy to the sampler, truncated at C (`truncation_threshold`, default 2.0), and the weight carries no
gradient. That is V-trace's truncated importance weight (Espeholt et al. 2018, IMPALA, rho-bar) as used for the
rollout/trainer mismatch of LLM RL (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training": TIS, C = 2). Unlike ppo's clip, a truncated token keeps a gradient (C times its own), so stale or
low-precision samples never stop learning, and a token the current policy likes far more than the sampler did
cannot dominate a step. The value is -sum min(r, C) A, i.e. importance_sampling's loss wherever r <= C. q is what
the sampler recorded, not the datum's `logprobs` (what a client sends there is not checked, so it is not used),
and only the sampled positions (S: the loss_fn_input_spans' SampledProvenanceSpans) train: a datum with a nonzero
advantage anywhere else is refused. The engine resolves the spans (trainer/service/provenance.py) and passes q and
S in as `Row.provenance`.

Not supported (refused with `UnsupportedLoss`): custom (server-side custom losses); multi-target (N, K) inputs.
Client-side `forward_backward_custom` needs nothing here: the SDK runs forward() and then
cross_entropy with weights = -dLoss/dlogp.

Sources: Tinker docs "Loss functions" (tinker-cookbook docs/losses.mdx at b8701586, the last commit before the
docs moved to tinker-docs.thinkingmachines.ai/tinker/losses/{ppo,cispo,gspo}); CISPO's default clip from
tinker-cookbook tutorials/202_loss_functions.py (commit eb2dc4ee, 2026-06-05); tinker 0.38.0 SDK
types/loss_fn_type.py, types/datum.py, lib/chunked_fwdbwd_helpers.py. skyrl 0.4.0 (skyrl/tinker/loss_fns.py,
skyrl/backends/jax.py) differs: its per-token losses are multiplied by `weights` for every loss (loss_fns.py
L20-22 safe_loss_mask; api.py L677-680 defaults weights to ones), each row's loss is divided by its weight sum and
optim_step divides the summed gradient by the number of rows (jax.py L406-408 loss_for_lora, L176-186 get_mean),
i.e. a mean of per-token means where Tinker sums; it uses 0.8/1.2 for cispo too (jax.py L63-64, L297-313); its JAX
backend has no dro or gspo; it clips with jnp.clip/jnp.minimum (loss_fns.py L59-62: 3/4 gradient at an exact tie).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from trainer.rl.losses import clipped_surrogate

# Row loss ids; the order is this module's own (skyrl's LOSS_TYPES numbers only the first four the same way).
LOSS_IDS: Final[dict[str, int]] = {
    "cross_entropy": 0,
    "importance_sampling": 1,
    "ppo": 2,
    "cispo": 3,
    "dro": 4,
    "gspo": 5,
    "stable_reinforce": 6,
}
SUPPORTED_LOSSES: Final[tuple[str, ...]] = tuple(LOSS_IDS)

# The rest of tinker 0.38's LossFnType (tinker/types/loss_fn_type.py) and why each is refused.
_REFUSED: Final[dict[str, str]] = {
    "custom": "server-side custom losses (create_custom_loss) are not supported; client-side "
    "forward_backward_custom works, it runs forward() and then cross_entropy",
}

# loss_fn_inputs each loss reads (Tinker docs, "Input tensors" of each loss; gspo adds sequence_ratio_mask).
REQUIRED_INPUTS: Final[dict[str, tuple[str, ...]]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
    # q comes from the sampler's record (Row.provenance); a `logprobs` the datum carries is accepted and unused.
    "stable_reinforce": ("target_tokens", "advantages"),
}
# Per-token clip thresholds may also come as loss_fn_inputs: the 0.38 SDK types them (types/datum.py _KEY_TO_TYPE);
# the docs do not describe them, so they are read only by the clipped losses and override loss_fn_config.
_PER_TOKEN_CLIP: Final[tuple[str, str]] = ("clip_low_threshold", "clip_high_threshold")
KNOWN_INPUTS: Final[frozenset[str]] = frozenset(
    {k for keys in REQUIRED_INPUTS.values() for k in keys} | set(_PER_TOKEN_CLIP)
)

# loss_fn_config keys each loss accepts, and defaults. ppo: docs "currently fixed to 0.2" i.e. 0.8/1.2 (also the
# tutorial); cispo: one-sided 0.0/4.0 (tutorials/202 since eb2dc4ee); gspo: the docs name eps_low/eps_high like
# ppo's but the page we could read states no default, so ppo's is used; dro: the docs show beta=0.05 only as an
# example, no default, so beta is required.
CONFIG_KEYS: Final[dict[str, frozenset[str]]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": frozenset(_PER_TOKEN_CLIP),
    "cispo": frozenset(_PER_TOKEN_CLIP),
    "gspo": frozenset(_PER_TOKEN_CLIP),
    "dro": frozenset({"beta"}),
    "stable_reinforce": frozenset({"truncation_threshold"}),
}
DEFAULT_CLIP: Final[dict[str, tuple[float, float]]] = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (0.8, 1.2)}
DEFAULT_TRUNCATION: Final = 2.0  # stable_reinforce's C (Yao et al. 2025's TIS cap)
NEEDS_PROVENANCE: Final = (
    "stable_reinforce needs provenance on every datum: sample with a sampling client made with "
    "record_stability_info=True and attach the sequences' ids with Datum.with_provenance(...)")

# The SDK reduces chunked metrics by the text after the one ":" (tinker/lib/chunked_fwdbwd_helpers.py
# L97 _metrics_reduction: `name, reduction = key.split(":")`, so a key with no ":" or two raises).
METRIC_REDUCTIONS: Final[tuple[str, ...]] = ("sum", "mean", "min", "max")


class UnsupportedLoss(ValueError):
    """A loss_fn this service does not run; the message names the supported ones."""


class BadLossInput(ValueError):
    """A request's loss_fn_inputs or loss_fn_config do not fit its loss_fn (a user error)."""


def loss_id(loss_fn: str) -> int:
    """The row id of a loss name; refuses the unsupported ones with a message naming the supported ones."""
    if loss_fn in LOSS_IDS:
        return LOSS_IDS[loss_fn]
    supported = ", ".join(SUPPORTED_LOSSES)
    if loss_fn in _REFUSED:
        raise UnsupportedLoss(f"loss_fn {loss_fn!r} is not supported: {_REFUSED[loss_fn]}; supported: {supported}")
    raise UnsupportedLoss(f"unknown loss_fn {loss_fn!r}; supported: {supported}")


@dataclass(frozen=True)
class RowConfig:
    """A row's config scalars; the ones its loss does not read are ignored (but finite, for jnp.select).
    stable_reinforce's truncation threshold C travels as clip_high (it reads no clip)."""

    clip_low: float = 0.0
    clip_high: float = 0.0
    beta: float = 0.0


def resolve_config(loss_fn: str, loss_fn_config: Mapping[str, float | str] | None) -> RowConfig:
    """Validate a request's loss_fn_config against its loss and fill in the defaults."""
    loss_id(loss_fn)
    config = dict(loss_fn_config or {})
    allowed = CONFIG_KEYS[loss_fn]
    unknown = sorted(set(config) - allowed)
    if unknown:
        # Rejected rather than ignored: a typo would otherwise silently train with the defaults.
        raise BadLossInput(f"loss_fn_config keys {unknown} are not used by {loss_fn!r}; it accepts {sorted(allowed)}")
    values: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadLossInput(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        values[key] = float(value)
    if loss_fn in DEFAULT_CLIP:
        low, high = DEFAULT_CLIP[loss_fn]
        low = values.get("clip_low_threshold", low)
        high = values.get("clip_high_threshold", high)
        if not 0.0 <= low <= high:
            raise BadLossInput(f"{loss_fn}: need 0 <= clip_low_threshold <= clip_high_threshold, got {low}, {high}")
        return RowConfig(clip_low=low, clip_high=high)
    if loss_fn == "stable_reinforce":
        cap = values.get("truncation_threshold", DEFAULT_TRUNCATION)
        if cap <= 0:
            raise BadLossInput(f"stable_reinforce: truncation_threshold must be > 0, got {cap}")
        return RowConfig(clip_high=cap)
    if loss_fn == "dro":
        if "beta" not in values:
            raise BadLossInput("loss_fn 'dro' needs loss_fn_config={'beta': ...} (Tinker documents no default)")
        return RowConfig(beta=values["beta"])
    return RowConfig()


class LossInputs(NamedTuple):
    """One batch's loss inputs, [B] or [B, T]. A pytree, so it passes through jax.jit as is.

    loss_id: [B] int (LOSS_IDS). mask: [B, T], nonzero on a datum's own positions. weights: [B, T]
    (cross_entropy). sampling_logprobs: [B, T], the datum's `logprobs` (q; stable_reinforce: the recorded ones).
    advantages: [B, T]. ratio_mask: [B, T], gspo's sequence_ratio_mask, stable_reinforce's sampled positions.
    clip_low, clip_high: [B] or [B, T] (ppo, cispo, gspo; stable_reinforce's C in clip_high). beta: [B] (dro).
    Inputs a row's loss does not read may hold anything finite (zeros).
    """

    loss_id: jax.Array
    mask: jax.Array
    weights: jax.Array
    sampling_logprobs: jax.Array
    advantages: jax.Array
    ratio_mask: jax.Array
    clip_low: jax.Array
    clip_high: jax.Array
    beta: jax.Array


class LossOutput(NamedTuple):
    """total: scalar to differentiate (sum of row_loss). row_loss: [B] each row's loss sum, 0 for padding rows.
    logprobs: [B, T] float32 target-token log-probs, 0 off the mask; row b's loss_fn_outputs["logprobs"] is
    logprobs[b, :N_b]."""

    total: jax.Array
    row_loss: jax.Array
    logprobs: jax.Array


def target_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """log softmax(logits)[target] in float32, [B, T]."""
    logits = logits_BTV.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def _per_token(x: jax.Array) -> jax.Array:
    """[B] row scalars -> [B, 1] so they broadcast over T; [B, T] stays."""
    return x[:, None] if x.ndim == 1 else x


# Per-token losses (sign included: minimise). Each is the docs' torch snippet; elementwise, [B, T] or broadcastable.


def cross_entropy_loss(logp: jax.Array, weights: jax.Array) -> jax.Array:
    # docs/losses.mdx L58: elementwise_loss = -target_logprobs * weights
    return -logp * weights


def importance_sampling_loss(logp: jax.Array, q: jax.Array, adv: jax.Array) -> jax.Array:
    # docs/losses.mdx L133-135: prob_ratio = exp(target_logprobs - sampling_logprobs); -(prob_ratio * advantages)
    return -jnp.exp(logp - q) * adv


def ppo_loss(logp: jax.Array, q: jax.Array, adv: jax.Array, low: jax.Array, high: jax.Array) -> jax.Array:
    # docs/losses.mdx L212-221: clamp(prob_ratio, clip_low_threshold, clip_high_threshold); -min(unclipped, clipped)
    return -clipped_surrogate(jnp.exp(logp - q), adv, low, high)[0]


def cispo_loss(logp: jax.Array, q: jax.Array, adv: jax.Array, low: jax.Array, high: jax.Array) -> jax.Array:
    # docs/losses.mdx L252-258: -(clipped_ratio.detach() * target_logprobs * advantages)
    clipped = jax.lax.stop_gradient(jnp.clip(jnp.exp(logp - q), low, high))
    return -clipped * logp * adv


def dro_loss(logp: jax.Array, q: jax.Array, adv: jax.Array, beta: jax.Array) -> jax.Array:
    # docs/losses.mdx L286-290: -(target_logprobs * advantages - 0.5 * beta * (target_logprobs - sampling_logprobs)**2)
    return -(logp * adv - 0.5 * beta * (logp - q) ** 2)


def gspo_loss(
    logp: jax.Array, q: jax.Array, adv: jax.Array, ratio_mask: jax.Array, low: jax.Array, high: jax.Array
) -> jax.Array:
    """GSPO-token over [B, T] rows (tinker-docs.thinkingmachines.ai/tinker/losses/gspo):
    log_ratio = (target_logprobs.detach() - ref_logprobs)[sequence_ratio_mask != 0].mean();
    ratio = exp(log_ratio + target_logprobs - target_logprobs.detach()); then ppo's clipped min, summed.
    A row with an empty sequence_ratio_mask gets s = 1 (torch's mean of nothing would be NaN)."""
    in_ratio = ratio_mask != 0
    count = jnp.sum(in_ratio, axis=-1, keepdims=True)
    log_ratio = jnp.sum(jnp.where(in_ratio, jax.lax.stop_gradient(logp) - q, 0.0), axis=-1, keepdims=True)
    log_s = log_ratio / jnp.maximum(count, 1)
    ratio = jnp.exp(log_s + logp - jax.lax.stop_gradient(logp))
    return -clipped_surrogate(ratio, adv, low, high)[0]


def stable_reinforce_loss(logp: jax.Array, q: jax.Array, adv: jax.Array, sampled: jax.Array,
                          cap: jax.Array) -> jax.Array:
    """-sg(min(r, C)) * A per sampled token, with the gradient of -min(r, C) * A * logp (see the module docstring).
    r is formed as exp(min(logp - q, log C)), so a huge ratio never overflows into the product."""
    weight = jnp.exp(jnp.minimum(jax.lax.stop_gradient(logp) - q, jnp.log(cap)))
    return jnp.where(sampled, -weight * jnp.exp(logp - jax.lax.stop_gradient(logp)) * adv, 0.0)


def tinker_losses(logprobs_BT: jax.Array, inputs: LossInputs) -> LossOutput:
    """Every row's Tinker loss from the current model's target log-probs; see the module docstring.

    Jit-safe; gradients flow only into `logprobs_BT` at masked positions. Off the mask (padding) and in the
    inputs a row's loss does not read, values are replaced before any exp, so a padded or mixed batch has no
    inf/NaN in an unselected branch (jnp.where would otherwise turn 0 * inf into a NaN gradient).
    """
    logp_raw = logprobs_BT.astype(jnp.float32)
    valid = inputs.mask != 0
    lid = inputs.loss_id.astype(jnp.int32)[:, None]
    logp = jnp.where(valid, logp_raw, 0.0)
    recorded = lid == LOSS_IDS["stable_reinforce"]  # its q is the sampler's record, read by its own branch only
    reads_q = (lid != LOSS_IDS["cross_entropy"]) & ~recorded & valid
    # Rows without a q get q = sg(logp): ratio 1 and a zero DRO penalty in the branches they do not select.
    q = jnp.where(reads_q, inputs.sampling_logprobs.astype(jnp.float32), jax.lax.stop_gradient(logp))
    q_recorded = jnp.where(recorded & valid, inputs.sampling_logprobs.astype(jnp.float32), jax.lax.stop_gradient(logp))
    adv = jnp.where(valid, inputs.advantages.astype(jnp.float32), 0.0)
    weights = jnp.where(valid, inputs.weights.astype(jnp.float32), 0.0)
    ratio_mask = valid & (inputs.ratio_mask != 0)
    low = _per_token(inputs.clip_low.astype(jnp.float32))
    high = _per_token(inputs.clip_high.astype(jnp.float32))
    beta = _per_token(inputs.beta.astype(jnp.float32))

    per_loss = {
        "cross_entropy": cross_entropy_loss(logp, weights),
        "importance_sampling": importance_sampling_loss(logp, q, adv),
        "ppo": ppo_loss(logp, q, adv, low, high),
        "cispo": cispo_loss(logp, q, adv, low, high),
        "dro": dro_loss(logp, q, adv, beta),
        "gspo": gspo_loss(logp, q, adv, ratio_mask, low, high),
        "stable_reinforce": stable_reinforce_loss(logp, q_recorded, adv, ratio_mask, jnp.maximum(high, 1e-30)),
    }
    token_loss = jnp.select([lid == LOSS_IDS[name] for name in per_loss], list(per_loss.values()), 0.0)
    token_loss = jnp.where(valid, token_loss, 0.0)
    row_loss = jnp.sum(token_loss, axis=-1)
    return LossOutput(total=jnp.sum(row_loss), row_loss=row_loss, logprobs=jax.lax.stop_gradient(logp))


def losses_from_logits(logits_BTV: jax.Array, targets_BT: jax.Array, inputs: LossInputs) -> LossOutput:
    """`tinker_losses` on log-probs computed from full logits (small models and tests; an engine with a large vocab
    may compute the target log-probs its own way and call `tinker_losses`)."""
    return tinker_losses(target_logprobs(logits_BTV, targets_BT), inputs)


class Provenance(NamedTuple):
    """What the sampler recorded for one datum's loss positions (trainer/service/provenance.py): `logprobs` [N]
    float32, the sampler's log-prob at each sampled position (0 elsewhere); `sampled` [N] bool."""

    logprobs: np.ndarray
    sampled: np.ndarray


class Row(NamedTuple):
    """One datum as a request sends it: its request's loss_fn and loss_fn_config, its own loss_fn_inputs; for
    stable_reinforce, the engine adds what its provenance resolved to."""

    loss_fn: str
    inputs: Mapping[str, ArrayLike]
    config: Mapping[str, float | str] | None = None
    provenance: Provenance | None = None


class Packed(NamedTuple):
    """Host-side numpy batch: `inputs` for tinker_losses, `targets` [B, T] int32 (0 on padding), `lengths` [B]."""

    inputs: LossInputs
    targets: np.ndarray
    lengths: np.ndarray


def _row_arrays(index: int, row: Row, vocab_size: int | None) -> tuple[int, dict[str, np.ndarray], RowConfig]:
    """Validate one datum; returns its length N, its inputs as 1-D numpy arrays and its config."""
    config = resolve_config(row.loss_fn, row.config)
    where = f"datum {index} ({row.loss_fn})"
    unknown = sorted(set(row.inputs) - KNOWN_INPUTS)
    if unknown:
        raise BadLossInput(f"{where}: unknown loss_fn_inputs {unknown}; known: {sorted(KNOWN_INPUTS)}")
    missing = [k for k in REQUIRED_INPUTS[row.loss_fn] if k not in row.inputs]
    if missing:
        raise BadLossInput(
            f"{where}: missing loss_fn_inputs {missing}; {row.loss_fn} needs {list(REQUIRED_INPUTS[row.loss_fn])}"
        )
    arrays = {key: np.asarray(value) for key, value in row.inputs.items()}
    for key, arr in arrays.items():
        if arr.dtype.kind not in "biuf":
            raise BadLossInput(f"{where}: {key} must be numeric, got dtype {arr.dtype}")
    n = arrays["target_tokens"].shape[0] if arrays["target_tokens"].ndim else -1
    for key, arr in arrays.items():
        if arr.ndim != 1:
            raise BadLossInput(
                f"{where}: {key} must have shape (N,), got {arr.shape} (multi-target (N, K) inputs are not supported)"
            )
        if arr.shape[0] != n:
            raise BadLossInput(f"{where}: {key} has length {arr.shape[0]}, target_tokens has {n}")
        if not np.all(np.isfinite(arr.astype(np.float64))):
            # One row's NaN would otherwise poison the whole shared batch's gradient.
            raise BadLossInput(f"{where}: {key} holds a non-finite value")
    targets = arrays["target_tokens"]
    if targets.size and (
        not np.all(targets == np.round(targets))
        or targets.min() < 0
        or (vocab_size is not None and targets.max() >= vocab_size)
    ):
        raise BadLossInput(f"{where}: target_tokens must be integers in [0, {vocab_size or 'vocab'})")
    if row.loss_fn == "stable_reinforce":
        _check_provenance(where, n, arrays["advantages"], row.provenance)
    return n, arrays, config


def _check_provenance(where: str, n: int, advantages: np.ndarray, provenance: Provenance | None) -> None:
    if provenance is None:
        raise BadLossInput(f"{where}: {NEEDS_PROVENANCE}")
    if provenance.logprobs.shape != (n,) or provenance.sampled.shape != (n,):
        raise BadLossInput(f"{where}: provenance covers {provenance.sampled.shape} positions, the datum has {n}")
    off = np.flatnonzero((advantages != 0) & ~provenance.sampled)
    if off.size:
        raise BadLossInput(
            f"{where}: advantages must be 0 where no sampled sequence produced the token (stable_reinforce trains "
            f"on sampled tokens only); position {int(off[0])} has {float(advantages[off[0]])}")


def pack_rows(
    rows: Sequence[Row], *, length: int | None = None, num_rows: int | None = None, vocab_size: int | None = None
) -> Packed:
    """Validate and pad datums into one batch: T = `length` (default: the longest N), B = `num_rows` (default:
    len(rows)); padding rows and columns have mask 0. Raises UnsupportedLoss / BadLossInput (user errors)."""
    checked = [_row_arrays(i, row, vocab_size) for i, row in enumerate(rows)]
    lengths = np.array([n for n, _, _ in checked], dtype=np.int32)
    t = int(length if length is not None else (lengths.max() if len(lengths) else 0))
    b = num_rows if num_rows is not None else len(rows)
    if len(rows) > b or (len(lengths) and lengths.max() > t):
        raise BadLossInput(
            f"{len(rows)} datums up to {lengths.max() if len(lengths) else 0} long do not fit [{b}, {t}]"
        )
    f32 = np.float32
    out = {
        k: np.zeros((b, t), f32)
        for k in ("mask", "weights", "sampling_logprobs", "advantages", "ratio_mask", "clip_low", "clip_high")
    }
    targets = np.zeros((b, t), np.int32)
    ids = np.zeros((b,), np.int32)
    beta = np.zeros((b,), f32)
    names = {
        "weights": "weights",
        "logprobs": "sampling_logprobs",
        "advantages": "advantages",
        "sequence_ratio_mask": "ratio_mask",
    }
    for i, (row, (n, arrays, config)) in enumerate(zip(rows, checked, strict=True)):
        ids[i] = LOSS_IDS[row.loss_fn]
        beta[i] = config.beta
        out["mask"][i, :n] = 1.0
        targets[i, :n] = arrays["target_tokens"].astype(np.int32)
        for key, dest in names.items():
            if key in arrays:
                out[dest][i, :n] = arrays[key]
        out["clip_low"][i, :n] = arrays.get("clip_low_threshold", config.clip_low)
        out["clip_high"][i, :n] = arrays.get("clip_high_threshold", config.clip_high)
        if row.loss_fn == "stable_reinforce" and row.provenance is not None:
            out["sampling_logprobs"][i, :n] = row.provenance.logprobs
            out["ratio_mask"][i, :n] = row.provenance.sampled
            out["clip_high"][i, :n] = config.clip_high  # C, whatever per-token clips the datum carries
    # numpy arrays; jax.jit takes them as they are (the fields are typed as the jax arrays they become).
    inputs = LossInputs(loss_id=ids, beta=beta, **out)  # type: ignore[arg-type]
    return Packed(inputs=inputs, targets=targets, lengths=lengths)


def request_metrics(row_loss: ArrayLike, rows: slice | Sequence[int]) -> dict[str, float]:
    """One request's metrics from the batch's per-row losses: Tinker documents "loss:sum" (sum over its datums)."""
    losses = np.asarray(row_loss, dtype=np.float64)[rows]
    metrics = {"loss:sum": float(np.sum(losses))}
    check_metric_keys(metrics)
    return metrics


def check_metric_keys(metrics: Mapping[str, float]) -> None:
    """Raise unless every key is "name:<reduction>" with one ":" and a reduction the SDK knows."""
    for key in metrics:
        parts = key.split(":")
        if len(parts) != 2 or not parts[0] or parts[1] not in METRIC_REDUCTIONS:
            raise ValueError(f"metric key {key!r} must be 'name:<{'|'.join(METRIC_REDUCTIONS)}>'")
