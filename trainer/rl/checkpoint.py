"""Orbax checkpoints of the train state (params, optimizer state) plus step, data position and RNG key.

Restores take a target tree of `jax.ShapeDtypeStruct(..., sharding=...)`, so a run saved on one mesh resumes
on another. Saves are async: the step loop continues while the previous save is written.

A save renames no directory: orbax writes `<step>` in place and publishes it by writing its commit marker last
(CommitFileTemporaryPath, orbax's own mode for gs:// paths). The checkpoint folder may be a Cloud Storage FUSE
mount of a flat bucket, where gcsfuse renames a directory only below `rename-dir-limit`, and never atomically.

A step is used only if it is intact: orbax finished it (its commit marker is there), its meta is well formed and
names that step, every array reads back, and the arrays' checksums (saved in the meta) match; without the
checksums a flipped bit in an array file reads back silently. `resume` takes the newest intact step and moves
damaged newer ones aside as `<step>.damaged` (never deletes them), an interrupted save (no marker) included; all
processes take the same decision.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.base.config import ConfigError
from trainer.rl import agree
from trainer.rl.batch import host_values

# orbax (0.12) writes this into a step directory last: it publishes the step (CommitFileTemporaryPath.finalize).
COMMIT_MARKER = "commit_success.txt"
_UNFINISHED = f"no {COMMIT_MARKER}: the save did not finish"
_STEP_NAME = re.compile(r"0|[1-9]\d*")  # orbax's step folder names (path/step.py, _StandardNameFormat)
DAMAGED_SUFFIX = ".damaged"
# checkpoint.resume_step: the steps after it are moved aside under this suffix, and a record of the roll-back is
# left beside them, so a restart of the same job (a preemption) resumes from its own newer saves instead of rolling
# back again.
ROLLED_BACK_SUFFIX = ".rolled-back"


def rollback_record(step: int) -> str:
    return f"rolled-back-to-{step}.json"


@dataclass(frozen=True)
class Meta:
    step: int  # completed steps; a resumed run starts at this step
    data_position: int  # index of the next example
    rng: list[int]  # raw key data of the base RNG key
    lag: int = 0  # rl.lag of the run that saved it
    # [step, policy version] of each rollout sampled ahead and saved with the state (its "rollouts" item), in order
    queued: list[list[int]] = field(default_factory=list)

    def key(self) -> jax.Array:
        return jax.numpy.asarray(np.asarray(self.rng, np.uint32))


class CheckpointDamaged(Exception):
    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"checkpoint step {step} is damaged: {reason}")
        self.step, self.reason = step, reason


class _Damage(ValueError):
    """A check of ours failed (the message says which); other errors are reported with their type."""


class LagMismatch(ConfigError):
    """The checkpoint was saved with another rl.lag: its queued rollouts belong to that lag, so going on with another
    could not continue the run exactly."""


class NoUsableCheckpoint(ConfigError):
    """Every checkpoint is damaged: starting from scratch would silently throw the run away."""


@dataclass(frozen=True)
class SetAside:
    """A damaged step that `resume` skipped, or a step after checkpoint.resume_step (rolled_back)."""

    step: int
    reason: str
    path: Path | None  # where it was moved; None if it could not be moved and stays in place
    move_error: str | None = None  # why not (known on process 0, which does the renames)
    rolled_back: bool = False


class Checkpointer:
    """`holders`: the processes holding the state's arrays, where not all do (placement split by slice or host: the
    sampler's processes hold none of the trainer's). Only they run orbax (its `active_processes`): orbax 0.12.8's
    save fails on a process holding no shard of an array (serialization/replica_slices.py, get_replica_slices:
    `arr.addressable_shards[0]`). The others still take part in every decision (which step, its checksums), read
    the meta, and restore placeholders: arrays of the target's shape with no shard of their own."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True,
                 lag: int | None = None, holders: set[int] | None = None) -> None:
        self.every = every
        self.holds = holders is None or jax.process_index() in holders
        self.lag = lag  # set: a step saved with another rl.lag is refused (LagMismatch), never set aside as damaged
        self.directory = Path(directory).absolute()
        # Several processes: orbax's barriers through the coordination service (its barrier for `active_processes`),
        # not its default jax.experimental.multihost_utils.sync_global_devices, a device program that can interleave
        # with the trainer's own on CPU (trainer/rl/agree.py says how).
        active = holders if holders is not None or jax.process_count() == 1 else set(range(jax.process_count()))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=1,  # the step loop decides when to save
            enable_async_checkpointing=async_save,
            create=active is None,  # orbax creates it only without active_processes; else it is made below
            # Written in place, marker last: no directory rename (the default, AtomicRenameTemporaryPath, renames
            # `<step>.orbax-checkpoint-tmp` and each item folder). orbax then lists only steps with the marker
            # (path/step.py, is_path_finalized). cleanup_tmp_directories stays off: in this mode it would delete
            # every folder without a marker (temporary_paths.cleanup_temporary_paths), set-aside steps included.
            temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=min(active), active_processes=set(active)) if active is not None else
            ocp.options.MultiprocessingOptions(),
        )
        if active is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._mngr = (ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
                      if self.holds else None)
        self._in_place: set[int] = set()  # damaged steps that could not be moved aside

    def latest_step(self) -> int | None:
        return self._mngr.latest_step() if self._mngr is not None else max(self.steps(), default=None)

    def steps(self) -> list[int]:
        """The finished steps, oldest first."""
        if self._mngr is None:  # what orbax lists: the step folders with a commit marker
            return sorted(s for s in _step_folders(self.directory)
                          if (self.directory / str(s) / COMMIT_MARKER).is_file())
        return sorted(self._mngr.all_steps())

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, state: Any, meta: Meta) -> bool:
        # A damaged step left in place is no orbax step: orbax would delete it to save there (force=True in
        # CheckpointManager.save, AsyncCheckpointer._prepare_destination_async). Process 0's answer for all: the
        # others read the folder where it asks orbax (holders), and a process that went on alone would wait in
        # checksums' collective for the rest.
        if _process0(meta.step in self.steps() or meta.step in self._in_place):
            return False
        # checksums before save returns: the next step donates these buffers
        record = {"step": meta.step, "data_position": meta.data_position, "rng": meta.rng, "lag": meta.lag,
                  "queued": meta.queued, "checksums": checksums(state)}
        if self._mngr is None:
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record))
        return self._mngr.save(meta.step, args=args, force=True)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, Meta]:
        """`target`: tree of ShapeDtypeStruct carrying the shardings to restore onto, or a function of the step's Meta
        giving one. Raises CheckpointDamaged."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError("no checkpoint to restore")
        state, meta, reason = self._attempt(target, step)
        if reason is not None:
            raise CheckpointDamaged(step, reason)
        return state, meta  # type: ignore[return-value]  # meta is set when reason is None

    def resume(self, target: Any, rollback_to: int | None = None) -> tuple[Any, Meta, list[SetAside]] | None:
        """The newest intact step (None if there is no step at all), and the damaged newer ones, now moved aside.

        Raises NoUsableCheckpoint, and moves nothing, when every step is damaged, unless the only step is an
        unfinished save: then the run's first save was cut off, and it starts from scratch.

        `rollback_to` (checkpoint.resume_step): that step instead, once: the steps after it are moved aside (never
        deleted) and the roll-back recorded; when the record is there already, the newest intact step as above.
        """
        if rollback_to is not None:
            if not self._rolled_back(rollback_to):
                return self._roll_back(target, rollback_to)
            if jax.process_index() == 0:  # said once, so a second roll-back asked of the same job is not a mystery
                print(f"checkpoint.resume_step={rollback_to}: already rolled back to it "
                      f"({self.directory / rollback_record(rollback_to)}); resuming from the newest step since. To "
                      "roll back to it again, move that record away", file=sys.stderr, flush=True)
        damaged: list[tuple[int, str]] = []
        for step in sorted(_step_folders(self.directory), reverse=True):  # not all_steps(): it skips unfinished saves
            state, meta, reason = self._attempt(target, step)
            if reason is None:
                return state, meta, self._set_aside(damaged)  # type: ignore[return-value]  # meta is set here
            damaged.append((step, reason))
        if len(damaged) == 1 and damaged[0][1] == _UNFINISHED:
            # One save runs at a time and each resume moves an unfinished one aside: no save ever finished here.
            for d in self._set_aside(damaged):
                if jax.process_index() == 0:
                    where = f"moved to {d.path}" if d.path else f"could not be moved aside ({d.move_error})"
                    print(f"warning: checkpoint step {d.step} in {self.directory} is damaged ({d.reason}); {where}; "
                          "no save finished before it: starting from scratch", file=sys.stderr)
            return None
        if damaged:
            _AbandonedReads.settle()  # the run ends here: let the failed reads finish while they are still quiet
            listing = "; ".join(f"step {s}: {r}" for s, r in damaged)
            raise NoUsableCheckpoint(
                f"no usable checkpoint in {self.directory} ({listing}). Nothing was moved or deleted: move these "
                "steps away to start from scratch, or point checkpoint.dir at another folder")
        return None

    def _rolled_back(self, step: int) -> bool:
        """Process 0's view of the record, so that every process decides alike."""
        return _process0((self.directory / rollback_record(step)).is_file())

    def _roll_back(self, target: Any, step: int) -> tuple[Any, Meta, list[SetAside]]:
        steps = sorted(_step_folders(self.directory))
        if step not in steps:
            raise ConfigError(f"checkpoint.resume_step={step}: no step {step} in {self.directory}; it holds "
                              f"{', '.join(map(str, steps)) or 'none'}")
        state, meta, reason = self._attempt(target, step)
        if reason is not None:
            _AbandonedReads.settle()
            raise NoUsableCheckpoint(f"checkpoint.resume_step={step}: step {step} in {self.directory} is damaged "
                                     f"({reason}); nothing was moved: pick another step")
        aside = self._set_aside([(s, f"after checkpoint.resume_step={step}") for s in steps if s > step],
                                ROLLED_BACK_SUFFIX)
        if stuck := [a for a in aside if a.path is None]:
            # Left in place, a newer step would be the newest again at the next restart: no record, no run.
            raise ConfigError(f"checkpoint.resume_step={step}: could not move step(s) "
                              f"{', '.join(str(a.step) for a in stuck)} in {self.directory} aside "
                              f"({stuck[0].move_error}); move them out of that folder, then start again")
        if jax.process_index() == 0:
            record = {"step": step, "set_aside": [{"step": a.step, "path": str(a.path) if a.path else None,
                                                   "error": a.move_error} for a in aside]}
            (self.directory / rollback_record(step)).write_text(json.dumps(record, indent=1) + "\n")
        _barrier("checkpoint-rolled-back")
        return state, meta, aside  # type: ignore[return-value]  # meta is set when reason is None

    def _attempt(self, target: Any, step: int) -> tuple[Any, Meta | None, str | None]:
        """(state, meta, None) if `step` is intact on every process, else (None, None, why). `target` may be a
        function of the step's Meta (the queued rollouts it lists are part of the state)."""
        path = self.directory / str(step)
        state, meta, sums, reason = None, None, None, None
        try:
            if not (path / COMMIT_MARKER).is_file():
                raise _Damage(_UNFINISHED)
            meta, sums = _parse_meta(ocp.JsonCheckpointHandler().restore(path / "meta"), step)
            if self.lag is not None and meta.lag != self.lag:
                raise LagMismatch(
                    f"checkpoint step {step} in {self.directory} was saved with rl.lag={meta.lag}, this run has "
                    f"rl.lag={self.lag}: its rollouts sampled ahead belong to that lag. Resume with rl.lag={meta.lag}, "
                    "or start a new run (another checkpoint.dir / run_dir)")
            want = target(meta) if callable(target) else target
            state = _read_state(path / "state", want) if self.holds else jax.tree.map(_placeholder, want)
        except (jax.errors.JaxRuntimeError, MemoryError, LagMismatch):
            raise  # the device or host failed, not the files, or the config: no reason to set this step aside
        except Exception as err:  # noqa: BLE001 (orbax re-raises tensorstore read errors as a bare Exception)
            first = str(err).splitlines()[0][:300] if str(err) else ""
            reason = first if isinstance(err, _Damage) else f"{type(err).__name__}: {first}"
        reason = self._agree(step, reason)
        if reason is None and sums is not None:
            reason = _compare_checksums(state, sums)
        return (None, None, reason) if reason is not None else (state, meta, None)

    def _agree(self, step: int, reason: str | None) -> str | None:
        """A step read fine on this process may have failed on another (each reads only its own shards)."""
        if jax.process_count() == 1:
            return reason
        votes = agree.allgather(np.asarray([step, reason is None], np.int32))
        if len(set(votes[:, 0].tolist())) > 1:
            raise RuntimeError(f"processes see different checkpoint steps in {self.directory}: {votes[:, 0]}")
        failed = [i for i, ok in enumerate(votes[:, 1].tolist()) if not ok]
        return reason if reason is not None or not failed else f"unreadable on process(es) {failed}"

    def _set_aside(self, damaged: list[tuple[int, str]], suffix: str = DAMAGED_SUFFIX) -> list[SetAside]:
        if not damaged:
            return []
        # Names are picked before any rename, by every process alike; process 0 renames (the folder is shared).
        names = {s: _free_name(self.directory, s, suffix) for s, _ in damaged}
        _barrier("checkpoint-set-aside-names")
        errors: dict[int, str] = {}
        if jax.process_index() == 0:
            for s, _ in damaged:
                # gcsfuse (flat bucket) moves the objects one by one: cut off midway, part stays under `<step>`. That
                # part is still damaged (the marker or files are missing), so the next resume moves it to a free name.
                try:
                    (self.directory / str(s)).rename(names[s])
                except OSError as err:  # e.g. gcsfuse refuses directory renames without rename-dir-limit
                    errors[s] = str(err)
        # Process 0's outcome, so every process skips the same saves (and waits here until its renames are done).
        moved = np.asarray(agree.broadcast([s not in errors for s, _ in damaged], source=0), np.int32)
        aside = [SetAside(s, r, names[s] if ok else None, errors.get(s), suffix == ROLLED_BACK_SUFFIX)
                 for (s, r), ok in zip(damaged, moved.tolist(), strict=True)]
        self._in_place.update(a.step for a in aside if a.path is None)
        if self._mngr is not None:
            self._mngr.reload()  # forget the moved steps, so a new save of that step is not skipped as existing
        return aside

    def wait(self) -> None:
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.wait_until_finished()
            self._mngr.close()


def _placeholder(x: jax.ShapeDtypeStruct) -> jax.Array:
    """An array of `x`'s shape and sharding with no shard on this process (which holds none of its devices)."""
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, [], dtype=x.dtype)


# ---------------------------------------------------------------------------------------------- reading a step

# For tools that read a finished run (export): a local folder or a gs:// one, through etils' epath and orbax's
# tensorstore, as orbax itself reads gs:// checkpoints. The Checkpointer above is the run's own; it is never pointed
# at gs:// (a pod reaches the bucket through its GCS FUSE mount).


def finished_steps(directory: str | os.PathLike[str]) -> tuple[list[int], list[int]]:
    """(steps whose save finished, step folders without the commit marker), each ascending."""
    root = epath.Path(directory)
    if not root.is_dir():
        return [], []
    done: list[int] = []
    unfinished: list[int] = []
    for p in root.iterdir():
        if _STEP_NAME.fullmatch(p.name) and p.is_dir():
            (done if (p / COMMIT_MARKER).exists() else unfinished).append(int(p.name))
    return sorted(done), sorted(unfinished)


def read_saved(directory: str | os.PathLike[str], step: int, keys: set[str]) -> tuple[dict[str, Any], Meta]:
    """The top-level items `keys` of a saved train state (e.g. {"params"}, not the optimizer state) as arrays on the
    first local device, checked as `resume` checks a step: the commit marker, the meta, and the checksums of what was
    read. Raises CheckpointDamaged."""
    path = epath.Path(directory) / str(step)
    try:
        if not (path / COMMIT_MARKER).exists():
            raise _Damage(_UNFINISHED)
        meta, sums = _parse_meta(ocp.JsonCheckpointHandler().restore(path / "meta"), step)
        saved = ocp.StandardCheckpointHandler().metadata(path / "state")
        saved = {k: saved[k] for k in saved}  # orbax's metadata tree as a plain dict of its top-level items
        missing = sorted(keys - saved.keys())
        if missing:
            raise _Damage(f"the saved state has no {missing} (it holds {sorted(saved)})")
        device = jax.local_devices()[0]
        spot = jax.sharding.SingleDeviceSharding(device)
        is_leaf = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731 (orbax's array metadata)
        target = {k: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=spot), saved[k],
                                  is_leaf=is_leaf) for k in keys}
        handler = ocp.PyTreeCheckpointHandler()  # the format StandardCheckpointHandler writes, read in part
        try:
            state = handler.restore(path / "state", args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
        finally:
            handler.close()
    except (jax.errors.JaxRuntimeError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 (orbax re-raises tensorstore read errors as a bare Exception)
        first = str(err).splitlines()[0][:300] if str(err) else ""
        raise CheckpointDamaged(step, first if isinstance(err, _Damage) else f"{type(err).__name__}: {first}") from err
    state = {k: state[k] for k in sorted(keys)}
    if sums is not None:
        # The meta's checksums follow the whole state's leaves: the top-level items in key order, each item's leaves
        # in a row. Only the items read are compared.
        counts = {k: len(jax.tree.leaves(v, is_leaf=is_leaf)) for k, v in saved.items()}
        if len(sums) != sum(counts.values()):
            raise CheckpointDamaged(step, f"meta has {len(sums)} checksums for {sum(counts.values())} arrays")
        start = 0
        for k in sorted(saved):
            if k in keys:
                reason = _compare_checksums(state[k], sums[start:start + counts[k]])
                if reason is not None:
                    raise CheckpointDamaged(step, f"{k}: {reason}")
            start += counts[k]
    return state, meta


def _read_state(path: Path, target: Any) -> Any:
    # Through the handler, not CheckpointManager.restore: that ends in a cross-process barrier which a process
    # whose read failed never reaches, so the others would hang instead of agreeing on the failure.
    handler = ocp.StandardCheckpointHandler()
    _AbandonedReads.quiet()
    ok = False
    try:
        state = handler.restore(path, args=ocp.args.StandardRestore(target))
        ok = True
        return state
    finally:
        handler.close()
        _AbandonedReads.done(ok)


class _AbandonedReads(logging.Filter):
    """A failed read leaves orbax's other reads of that step in flight. They end later, harmlessly, but each one
    prints a traceback: as it posts to orbax's event loop, closed by then (an unraisable RuntimeError), or as an
    exception nobody retrieved (the asyncio logger). While `quiet`, exactly those are dropped and everything else
    passes on; `settle` waits until they stop, so none is left to print at interpreter exit."""

    last = 0.0  # monotonic time of the last one dropped
    failed = False  # a read failed in this process: stay quiet for good
    _previous: Any = None

    @classmethod
    def quiet(cls) -> None:
        """Before a read: a failure's leftovers can print before its exception reaches the caller."""
        if getattr(sys.unraisablehook, "drops_abandoned_reads", False):
            return
        previous = cls._previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            exc = unraisable.exc_value
            if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
                cls.last = time.monotonic()
            else:
                previous(unraisable)

        hook.drops_abandoned_reads = True  # type: ignore[attr-defined]  # a marker on the function, read by getattr
        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_ABANDONED_READS)

    @classmethod
    def done(cls, ok: bool) -> None:
        """After a read: if none ever failed, nothing is in flight, so put the hooks back."""
        cls.failed = cls.failed or not ok
        if cls.failed:
            cls.last = time.monotonic()
        elif getattr(sys.unraisablehook, "drops_abandoned_reads", False):
            sys.unraisablehook = cls._previous
            logging.getLogger("asyncio").removeFilter(_ABANDONED_READS)

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" in record.getMessage():
            type(self).last = time.monotonic()
            return False
        return True

    @classmethod
    def settle(cls, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
        deadline = time.monotonic() + limit_s
        while cls.failed and time.monotonic() < min(deadline, cls.last + quiet_s):
            with warnings.catch_warnings():  # the abandoned reads' coroutines, collected unawaited
                warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
                gc.collect()  # an unretrieved task reports when it is collected
            time.sleep(0.1)


_ABANDONED_READS = _AbandonedReads()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_meta(record: Any, step: int) -> tuple[Meta, list[int] | None]:
    if not isinstance(record, dict):
        raise _Damage("meta is not a JSON object")
    missing = sorted({"step", "data_position", "rng"} - record.keys())
    if missing:
        raise _Damage(f"meta lacks {missing}")
    if record["step"] != step or not _is_int(record["step"]):
        raise _Damage(f"meta names step {record['step']!r}")
    if not _is_int(record["data_position"]) or record["data_position"] < 0:
        raise _Damage(f"meta has data_position {record['data_position']!r}")
    rng = record["rng"]
    if not isinstance(rng, list) or not rng or not all(_is_int(x) and 0 <= x < 2**32 for x in rng):
        raise _Damage(f"meta has rng {rng!r}")
    sums = record.get("checksums")  # absent in checkpoints written before checksums existed
    if sums is not None and (not isinstance(sums, list) or not all(_is_int(x) for x in sums)):
        raise _Damage("meta checksums are not a list of integers")
    lag, queued = record.get("lag", 0), record.get("queued", [])  # absent before rl.lag existed: 0, none
    if not _is_int(lag) or lag < 0:
        raise _Damage(f"meta has lag {lag!r}")
    if not isinstance(queued, list) or not all(isinstance(q, list) and len(q) == 2 and all(map(_is_int, q))
                                               for q in queued):
        raise _Damage(f"meta has queued {queued!r}")
    return Meta(step, record["data_position"], list(rng), lag, queued), sums


def _compare_checksums(state: Any, sums: list[int]) -> str | None:
    named = jax.tree_util.tree_leaves_with_path(state)
    if len(sums) != len(named):
        return f"meta has {len(sums)} checksums for {len(named)} arrays"
    got = checksums(state)
    bad = [jax.tree_util.keystr(p) for (p, _), a, b in zip(named, got, sums, strict=True) if a != b]
    return f"checksum mismatch in {len(bad)} array(s): {', '.join(bad[:3])}" if bad else None


def _step_folders(directory: Path) -> list[int]:
    """Every step folder, finished or not (orbax lists only those with a commit marker)."""
    if not directory.is_dir():
        return []
    return [int(p.name) for p in directory.iterdir() if _STEP_NAME.fullmatch(p.name) and p.is_dir()]


def _free_name(directory: Path, step: int, suffix: str = DAMAGED_SUFFIX) -> Path:
    path, n = directory / f"{step}{suffix}", 1
    while path.exists():
        path, n = directory / f"{step}{suffix}.{n}", n + 1
    return path


def _process0(flag: bool) -> bool:
    """Process 0's `flag` on every process (every process calls it, as a collective), so that all decide alike."""
    return bool(agree.broadcast(flag, source=0))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        agree.barrier(name)


def _words(x: jax.Array) -> jax.Array:
    """The raw bits as uint32 (so -0.0 vs 0.0 and NaN payloads count, and the sum is exact in any order)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)  # 8 bytes: two uint32 words
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _sums(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.sum(_words(x), dtype=jnp.uint32) for x in leaves])


@functools.cache
def _sums_fn(out: NamedSharding | None) -> Any:
    return jax.jit(_sums) if out is None else jax.jit(_sums, out_shardings=out)


def checksums(tree: Any) -> list[int]:
    """Per array, the wrapping uint32 sum of its bits: independent of the mesh, so it checks a restore anywhere."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return []
    sharding = getattr(leaves[0], "sharding", None)
    # Replicated, so every process can read the result of a multi-process computation.
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return [int(x) for x in np.asarray(_sums_fn(None)(leaves))]
    # On every process, also those holding none of the mesh's devices (placement split by slice or host).
    sums = host_values(_sums_fn(NamedSharding(sharding.mesh, PartitionSpec()))(leaves), sharding.mesh)
    return [int(x) for x in np.asarray(sums)]


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
        return bool(np.any(agree.allgather(np.asarray(self._set, np.int32))))
