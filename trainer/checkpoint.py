"""Orbax checkpoints of the train state (params, optimizer state) plus step, data position and RNG key.

Restores take a target tree of `jax.ShapeDtypeStruct(..., sharding=...)`, so a run saved on one mesh resumes
on another. Saves are async: the step loop continues while the previous save is written.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


@dataclass(frozen=True)
class Meta:
    step: int  # completed steps; a resumed run starts at this step
    data_position: int  # index of the next example
    rng: list[int]  # raw key data of the base RNG key

    def key(self) -> jax.Array:
        return jax.numpy.asarray(np.asarray(self.rng, np.uint32))


class Checkpointer:
    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True) -> None:
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=1,  # the step loop decides when to save
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, state: Any, meta: Meta) -> bool:
        if meta.step in self._mngr.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave({"step": meta.step, "data_position": meta.data_position, "rng": meta.rng}),
        )
        return self._mngr.save(meta.step, args=args, force=True)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, Meta]:
        """`target`: tree of ShapeDtypeStruct carrying the shardings to restore onto."""
        step = self._mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError("no checkpoint to restore")
        out = self._mngr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        )
        m = out["meta"]
        return out["state"], Meta(int(m["step"]), int(m["data_position"]), [int(x) for x in m["rng"]])

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with target shardings: the restore target for a (possibly different) mesh."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps, saves and exits cleanly.

    Idempotent: a terminal's Ctrl-C reaches every process of the group and the launcher forwards a SIGTERM too, so
    repeated signals must not interrupt the save or the run summary. SIGKILL is the way to stop at once.
    """

    def __init__(self) -> None:
        self._set = False
        self._previous: dict[int, Any] = {}

    def install(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._set = True

    def request(self) -> None:
        self._set = True

    @property
    def is_set(self) -> bool:
        """This process was signalled (no collective; `agreed` is the all-process answer)."""
        return self._set

    def agreed(self) -> bool:
        """True on every process once any process was signalled (all must save the same step together)."""
        if jax.process_count() == 1:
            return self._set
        flags = multihost_utils.process_allgather(np.asarray(self._set, np.int32))
        return bool(np.any(flags))
