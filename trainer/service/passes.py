"""The engine's pass rule as plain Python (no JAX): which forward_backward passes it runs. The engine (engine/)
runs its passes by it and `fit` sizes them by it (trainer/fit/estimate.py), so the two cannot drift.

A datum of n tokens is padded to its length bucket (shapes.bucket: service.min_bucket x 2^k, capped at
model.max_seq_len). The datums of one bucket b run in passes of max_batch_tokens // b datums (at least one), each
pass's rows rounded up to their row bucket (shapes.rows: a power of two, a multiple of the data-parallel size).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.base.config import ConfigError, ServiceConfig, TrainConfig
from trainer.service.shapes import bucket
from trainer.service.shapes import rows as shape_rows


@dataclass(frozen=True)
class Pass:
    """One forward_backward shape the service engine runs: `rows` sequences of `length` (bucketed) tokens."""

    kind: str  # "longest": the longest datum a pass holds; "most rows": the shortest bucket, as many rows as fit
    rows: int
    length: int

    @property
    def tokens(self) -> int:
        return self.rows * self.length

    @property
    def name(self) -> str:
        return f"forward_backward {self.rows}x{self.length}"


def datum_length(svc: ServiceConfig, max_seq_len: int, tokens: int) -> int:
    """The bucketed length a datum of `tokens` tokens is padded to (one compiled program per bucket)."""
    return bucket(max(tokens, 1), svc.min_bucket, max_seq_len)


def datums_per_pass(svc: ServiceConfig, length: int) -> int:
    """How many datums of bucketed length `length` one pass takes: max_batch_tokens // length, at least one."""
    return max(1, svc.max_batch_tokens // length)


def service_buckets(cfg: TrainConfig) -> list[int]:
    """Every length a datum is padded to, shortest first: service.min_bucket x 2^k, the last capped at
    model.max_seq_len."""
    assert cfg.service is not None
    top, out = cfg.model_cfg.max_seq_len, [datum_length(cfg.service, cfg.model_cfg.max_seq_len, 1)]
    while out[-1] < top:
        out.append(datum_length(cfg.service, top, out[-1] + 1))
    return out


def service_pass(cfg: TrainConfig, length: int, data_parallel: int) -> Pass:
    """The largest pass the engine runs at one bucketed length: its datums per pass, rounded up to their row
    bucket."""
    assert cfg.service is not None
    return Pass("", shape_rows(datums_per_pass(cfg.service, length), data_parallel), length)


def service_passes(cfg: TrainConfig, data_parallel: int) -> list[Pass]:
    """The largest forward_backward pass the engine runs at each bucketed length, shortest first, up to the longest
    datum `fit` sizes for a service config.

    ServiceConfig's contract: a pass holds rows x bucketed length <= service.max_batch_tokens tokens, padding rows
    included; rows are a multiple of the data-parallel size (mesh.slices x mesh.fsdp: each device takes whole rows), so
    one datum fills `data_parallel` rows. The longest datum is then the longest bucket b with data_parallel x b <=
    max_batch_tokens (capped at model.max_seq_len); at each bucket the engine packs max_batch_tokens // b datums (at
    least one) into a power-of-two row bucket (when max_batch_tokens is no power-of-two multiple of the bucket that
    rounding can exceed max_batch_tokens, and the pass is sized as the engine runs it). Kinds: "longest" (the last:
    attention's [rows, heads, T, T] scores peak there), "most rows" (the first, service.min_bucket: the
    [rows, chunk, vocab] log-prob logits peak there). Raises ConfigError when max_batch_tokens holds no datum at all.
    """
    assert cfg.service is not None
    M = cfg.service.max_batch_tokens
    one = shape_rows(1, data_parallel)
    held = [b for b in service_buckets(cfg) if one * b <= M]
    if not held:
        raise ConfigError(
            f"service.max_batch_tokens = {M} holds no forward_backward pass: the shortest is {one} rows (the "
            f"data-parallel devices, mesh.slices x mesh.fsdp) x {cfg.service.min_bucket} tokens (service.min_bucket) "
            f"= {one * cfg.service.min_bucket}; raise service.max_batch_tokens or lower service.min_bucket")
    out = [service_pass(cfg, b, data_parallel) for b in held]
    kinds = ["most rows" if i == 0 else "" for i in range(len(out))]
    kinds[-1] = "longest" if len(out) > 1 else "longest, most rows"
    return [Pass(k, p.rows, p.length) for k, p in zip(kinds, out, strict=True)]


def service_longest_datum(cfg: TrainConfig, data_parallel: int) -> int:
    """The longest datum (tokens) a forward_backward pass of service.max_batch_tokens holds (see service_passes)."""
    return service_passes(cfg, data_parallel)[-1].length
