"""A sample request's settings: checked where they arrive (the API answers 400 naming the field, the engine fails the
request the same way) and turned into the per-row arrays that one compiled sampler serves whatever their values
(`trainer.rl.sampler.RowSettings`), so one user's temperature never compiles a program another user waits behind.

What still picks a program is a shape: the token bucket (max_tokens rounded up to service.min_bucket x a power of
two), the prompt bucket and the row bucket (num_samples rounded up to a power of two)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import numpy as np
from tinker import types

from trainer.rl.sampler import RowSettings

# Stop token ids a request may have (the model's EOS ids included): the width of the program's stop table.
MAX_STOP_IDS: Final = 16


def problems(sp: types.SamplingParams, num_samples: int, max_num_samples: int | None) -> list[str]:
    """What is wrong with these settings, each naming its field and what is allowed (empty: fine). Only what needs
    no model: the engine checks the vocabulary, the context and (the API has no engine config) the sample limit."""
    out: list[str] = []
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        out.append(f"sampling_params.temperature must be a finite number >= 0 (0: greedy), not {sp.temperature}")
    if not (math.isfinite(sp.top_p) and np.float32(sp.top_p) > 0 and sp.top_p <= 1):  # the program's float32
        out.append(f"sampling_params.top_p must be in (0, 1] (1: off), not {sp.top_p}")
    if sp.top_k < -1:
        out.append(f"sampling_params.top_k must be -1 or 0 (off) or a count >= 1, not {sp.top_k}")
    if sp.max_tokens is None or sp.max_tokens < 1:
        out.append(f"sampling_params.max_tokens must be set (>= 1), not {sp.max_tokens}")
    if num_samples < 1 or (max_num_samples is not None and num_samples > max_num_samples):
        out.append(f"num_samples must be in [1, {max_num_samples or 'service.max_num_samples'}] (this server's "
                   f"service.max_num_samples), not {num_samples}")
    if isinstance(sp.stop, Sequence) and not isinstance(sp.stop, str) and len(sp.stop) > MAX_STOP_IDS \
            and all(isinstance(s, int) for s in sp.stop):
        out.append(f"sampling_params.stop holds {len(sp.stop)} token ids; at most {MAX_STOP_IDS}")
    return out


def row_settings(sp: types.SamplingParams, rows: int, stop_ids: Sequence[int], vocab_size: int) -> RowSettings:
    """The same settings for each of `rows` rows, as NumPy arrays (top_k at or above the vocabulary is no limit)."""
    if len(stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"{len(stop_ids)} stop ids; at most {MAX_STOP_IDS}")
    assert sp.max_tokens is not None
    stop_BS = np.full((rows, MAX_STOP_IDS), -1, np.int32)
    stop_BS[:, :len(stop_ids)] = np.asarray(stop_ids, np.int32)
    top_k = sp.top_k if 0 < sp.top_k < vocab_size else 0
    # NumPy arrays in RowSettings' fields, which are typed as the jax arrays they become (DeviceState.sample).
    return RowSettings(np.full(rows, sp.temperature, np.float32), np.full(rows, top_k, np.int32),  # type: ignore[arg-type]
                       np.full(rows, sp.top_p, np.float32), stop_BS, np.full(rows, sp.max_tokens, np.int32))  # type: ignore[arg-type]
