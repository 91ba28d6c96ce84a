"""The engine's device state and the ops that touch it, run in lock step on every process of the engine.

`DeviceState` holds what lives on the accelerators: the base weights, the adapter stack, its AdamW moments, the
per-slot gradient accumulator and the slots' scales. Its ops take and return host (NumPy) values only, so process 0
(the engine, which talks to the database) can send each op to the other processes, which run the same op on the same
values: every jitted program then runs on every process at once, as jax's multi-controller model requires (the
trainer's multi-host contract, trainer/run/distributed.py).

The ops are DeviceState's methods marked `_op`: the engine calls them as methods (typed, like any other), and on
process 0 of several each first sends itself (its name and arguments) to the followers through `Leader`; a follower
runs the same op from `OPS` by that name. No caller names an op by a string.

The op stream goes through the jax.distributed coordination service's key-value store (the same service
`jax.distributed.initialize` starts on process 0), not through device collectives: a follower may wait idle for hours
between requests, which a blocked collective would not survive. Op n is the key `<prefix>/<n>`; process 0 deletes op
n-2 when it sends op n (every op runs a program over all processes, so everyone has read op n-1 by then).
"""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import jax
import numpy as np
from numpy.typing import ArrayLike

from trainer.base.config import LoraConfig, TrainConfig
from trainer.model import decoder as M
from trainer.rl.sampler import RowSettings
from trainer.service import losses
from trainer.service import programs as P

log = logging.getLogger(__name__)
PREFIX: Final = "gke-tpu-rl/service/engine/op"
STOP: Final = "stop"
# Why process 0 stops its followers (the STOP op's argument), so each exits as process 0 does: asked to (a SIGTERM,
# exit 143) or after an error (exit 42); never 0, which would complete the engine's JobSet.
STOPPED: Final = "stopped"
FAILED: Final = "failed"
BUG: Final = "bug"  # process 0's start-up failed on a configuration error or a bug: the followers exit 2 too
STOP_TIMEOUT_MS: Final = 60_000

R = TypeVar("R")
Args = ParamSpec("Args")
# The ops by name, as a follower looks them up (the functions themselves, not their sending wrappers).
OPS: Final[dict[str, Callable[..., Any]]] = {}


def _op(fn: Callable[Concatenate[DeviceState, Args], R]) -> Callable[Concatenate[DeviceState, Args], R]:
    """Mark a DeviceState method as an op: on a state with a leader (process 0 of several) a call is first sent to
    the followers, which run the same op on the same values; then it runs here."""
    OPS[fn.__name__] = fn

    @functools.wraps(fn)
    def run(self: DeviceState, *args: Args.args, **kwargs: Args.kwargs) -> R:
        if self.leader is not None:
            self.leader.send(fn.__name__, args, kwargs)
        return fn(self, *args, **kwargs)

    return run


class DeviceState:
    """What lives on the accelerators, and the ops on it (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, progs: P.EnginePrograms, params_host: Any | None) -> None:
        # Set on process 0 by the engine (`Leader`): every op is then sent to the followers before it runs.
        self.leader: Leader | None = None
        self.progs = progs
        self.mcfg = progs.mcfg
        self.stack = progs.stack
        if params_host is None:
            init = jax.jit(lambda k: M.init_params(self.mcfg, k), out_shardings=progs.param_sh)
            self.params = init(jax.random.PRNGKey(cfg.seed))
        else:
            self.params = jax.tree.map(
                lambda x, sh: jax.make_array_from_callback(np.shape(x), sh, lambda idx: np.asarray(x)[idx]),
                params_host, progs.param_sh)
        self.lora = progs.zeros_like_stack()
        self.m = progs.zeros_like_stack()
        self.v = progs.zeros_like_stack()
        self.grads = progs.zeros_like_stack()
        self.scale_S = np.zeros(self.stack.slots, np.float32)

    # Every op: host values in, host values out; the same call on every process.

    @_op
    def write_slot(self, index: int, scale: float, single: Any, single_cfg: LoraConfig,
                   moments: tuple[Any, Any] | None = None) -> None:
        """Slot `index` := `single` (a one-slot adapter of its own rank and targets; {} = zeros), with the given AdamW
        moments or zeros; its gradient accumulator zeroed."""
        put_slot = self.progs.put_slot
        slot = self.progs.put(np.int32(index))  # traced: one program serves every slot
        # A released slot (scale 0) is written as zeros at any scale: the config only folds scale ratios into B.
        self.lora = put_slot(self.lora, P.slot_config(self.stack, scale or single_cfg.scale), slot, single,
                             single_cfg)
        unit = P.slot_config(self.stack, single_cfg.scale)  # moments are stored unscaled: copied as they are
        m, v = moments if moments is not None else ({}, {})
        self.m = put_slot(self.m, unit, slot, m, single_cfg)
        self.v = put_slot(self.v, unit, slot, v, single_cfg)
        self.grads = put_slot(self.grads, unit, slot, {}, single_cfg)
        self.scale_S[index] = scale

    @_op
    def read_slot(self, index: int, rank: int, targets: tuple[str, ...]) -> tuple[Any, Any, Any]:
        """Slot `index`'s adapter and moments as one-slot adapters of its rank and targets (NumPy, on every process)."""
        idx = self.progs.put(np.int32(index))
        out = [P.single_adapter(jax.device_get(self.progs.take_slot(t, idx)), rank, targets)
               for t in (self.lora, self.m, self.v)]
        return out[0], out[1], out[2]

    @_op
    def optim(self, index: int, step: int, hyper: np.ndarray) -> float:
        put = self.progs.put
        self.lora, self.m, self.v, self.grads, norm = self.progs.optim_step(
            self.lora, self.m, self.v, self.grads, put(np.int32(index)), put(np.int32(step)), put(hyper))
        return float(norm)

    @_op
    def run_pass(self, tokens: np.ndarray, slot_B: np.ndarray, packed: losses.Packed, backward: bool
                 ) -> tuple[np.ndarray, np.ndarray]:
        """One bucketed pass: target log-probs [B, T] and row losses [B]; with backward, gradients accumulate."""
        put = self.progs.put
        inputs = losses.LossInputs(*(put(np.asarray(x), batch=True) for x in packed.inputs))
        args = (put(self.scale_S), put(tokens, batch=True), put(slot_B, batch=True), put(packed.targets, batch=True),
                inputs)
        if backward:
            self.grads, lp, row_loss = self.progs.forward_backward(self.params, self.lora, self.grads, *args)
        else:
            lp, row_loss = self.progs.logprobs_and_loss(self.params, self.lora, *args)
        return np.asarray(lp), np.asarray(row_loss)

    @_op
    def sample(self, prompt_BP: np.ndarray, valid_BP: np.ndarray, slot_B: np.ndarray, key_data: np.ndarray,
               per_row: tuple[ArrayLike, ...], static: tuple[Any, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """per_row: a RowSettings of NumPy arrays (each row's temperature, top-k, top-p, stop ids, token limit);
        static: (the token bucket, the pad id, the chunk), the only values that pick a program."""
        put = self.progs.put
        settings = RowSettings(*(put(np.asarray(x), batch=True) for x in per_row))
        out = self.progs.sample(self.params, self.lora, put(self.scale_S), put(prompt_BP, batch=True),
                                put(valid_BP, batch=True), put(slot_B, batch=True), put(key_data), settings, *static)
        tokens, logprobs, mask = (np.asarray(x) for x in out[:3])
        return tokens, logprobs, mask

    @_op
    def prompt_topk(self, tokens: np.ndarray, slot_B: np.ndarray, valid: np.ndarray, k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        put = self.progs.put
        ids, logprobs = self.progs.prompt_topk(self.params, self.lora, put(self.scale_S), put(tokens, batch=True),
                                               put(slot_B, batch=True), put(valid, batch=True), k)
        return np.asarray(ids), np.asarray(logprobs)


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class Leader:
    """Process 0's side of the op stream: the ops send themselves through `send` (see `_op`); `stop` ends the
    followers. With one process there is no one to send to."""

    def __init__(self) -> None:
        self.n = 0
        self.multi = jax.process_count() > 1

    def send(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.multi:
            return
        client = _client()
        client.key_value_set_bytes(f"{PREFIX}/{self.n}", pickle.dumps((op, args, kwargs), protocol=5))
        if self.n >= 2:
            client.key_value_delete(f"{PREFIX}/{self.n - 2}")
        self.n += 1

    def stop(self, reason: str = STOPPED) -> None:
        """Tell the followers to stop (why: STOPPED or FAILED) and wait until they have (so none sees the
        coordinator vanish mid-call)."""
        if self.multi:
            log.info("engine: stopping the followers (%s)", reason)
            self.send(STOP, (reason,), {})
            _client().wait_at_barrier(f"{PREFIX}/stopped", STOP_TIMEOUT_MS)
            # Every process leaves the coordination service together (its shutdown is a barrier too); a process
            # that outlived the service (on process 0) would abort polling it.
            log.info("engine: followers stopped")
            jax.distributed.shutdown()


def _ops(poll_ms: int = 60_000) -> Iterator[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    client = _client()
    n = 0
    while True:
        try:
            raw = client.blocking_key_value_get_bytes(f"{PREFIX}/{n}", poll_ms)
        except Exception as e:  # noqa: BLE001 - a timeout (DEADLINE_EXCEEDED) just means the engine is idle
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                continue
            raise
        n += 1
        yield pickle.loads(raw)  # noqa: S301 - written by process 0 of this same job (the coordination service)


def follow(state: DeviceState) -> str:
    """A follower process: run process 0's ops until it says stop; returns why it stopped (STOPPED, FAILED or
    BUG)."""
    for op, args, kwargs in _ops():
        if op == STOP:
            reason = str(args[0]) if args else FAILED
            log.info("engine follower: stop (%s)", reason)
            _client().wait_at_barrier(f"{PREFIX}/stopped", STOP_TIMEOUT_MS)
            jax.distributed.shutdown()
            return reason
        OPS[op](state, *args, **kwargs)  # the op itself: a follower sends nothing on
    raise AssertionError("unreachable: _ops never ends")
