"""The engine: claims requests from the store and runs them on one base model with a stack of LoRA slots.

It is the trainer's model, sharding and sampler (service/programs.py) behind the request contract in protocol.py.
What it adds:
* Batching. A forward/forward_backward claim is topped up with every other runnable forward/forward_backward of any
  model and user; their datums are validated per request (one request's bad input fails that request alone), packed
  into rows whose length is bucketed and run in passes of at most service.max_batch_tokens (the rule: passes.py),
  each row on its model's slot. Gradients add up per slot until that model's optim_step (Tinker's sums).
* Slots (service/slots.py). Each client model holds a slot from create_model (or create-via-load) until its session
  ends or goes quiet for service.idle_unload_s; sampler checkpoints in use are loaded into free slots and evicted
  first when a model needs one. A request that finds no slot, a rank above lora.rank or a sequence above the context
  fails as a user error naming the limit; the rest of the batch runs.
* Storage. save_weights writes a PEFT adapter (adapter_config.json + adapter_model.safetensors, lora.export_peft),
  the AdamW moments (optimizer.safetensors, same tensor names under exp_avg./exp_avg_sq.) and state.json (step, rank,
  targets); sampler and external saves are the PEFT adapter alone. Every save goes to a fresh directory, renamed into
  place when complete, so a crash never leaves a half-written checkpoint behind a row.

* Hosts. On a multi-host slice every process builds the same programs and state (`prepare`, the trainer's
  jax.distributed contract); process 0 runs the Engine (database, storage, decisions) and sends each device op to the
  others, which run it in lock step (`run_follower`, service/device.py). When it stops it tells them why (asked to,
  or after an error), so every process exits as process 0 does (143 or 42, trainer/service/cli.py).
* Failures. The loop retries what fails (a step, restoring the live models, the database unreachable) and ends only
  when asked to; at start-up `recover` and the worker registration retry while the database is unavailable
  (`db_retry_s`, store.retry_database).

* Durability. A model's training state lives in device memory and is persisted as it changes: every request that
  changes it other than forward_backward (create_model, load_weights, optim_step) writes a snapshot (PEFT adapter,
  Adam moments, step) under <service.state_dir>/<owner>/<model>/ and moves the model's `ModelState` to it in the
  transaction that completes the request. A model not in a slot (an engine restart after a preemption or SIGKILL, an
  idle unload, an eviction for another model) is rebuilt on its next request from that snapshot, and the
  forward_backward requests completed since are run again to rebuild the accumulated gradient (their results were
  delivered; only their gradients are wanted). Requests that were running when the engine died are re-queued
  (`Store.recover` with every kind re-runnable), so each request takes effect exactly once. At start the engine
  restores the models of open sessions before it claims anything.

The engine's parts (issue 41, item 3) are objects composed here, each owning its own state and taking what it reads
in its constructor: the slot table with the rank and scale policy (service/slots.py `SlotTable`), the snapshot
writer (engine/snapshots.py `SnapshotWriter`: the writer thread, failed writes), the passes (engine/batches.py
`Passes`: forward/forward_backward), the models (engine/models.py `Models`: slots found or rebuilt, create, load,
optim_step), the checkpoints (engine/checkpoints.py `Checkpoints`) and sampling (engine/sampler.py `Sampler`: the
tokenizer). Every part reaches the accelerators through the typed device door (service/device.py `DeviceState`).
This module is the loop: claiming, the fair share, dispatching to the parts' handlers, housekeeping, the warm-up.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from trainer.base.config import (
    ConfigError,
    TrainConfig,
)
from trainer.run import compile_cache
from trainer.service import device, losses, protocol
from trainer.service import programs as P
from trainer.service.engine.batches import Passes
from trainer.service.engine.checkpoints import Checkpoints
from trainer.service.engine.common import (
    FWD_KINDS,
    MAX_FAIR_OWNERS,
    Outcome,
    UserError,
    fail,
    log,
    prepare,
    state_root,
)
from trainer.service.engine.models import Models
from trainer.service.engine.sampler import Sampler, load_tokenizer
from trainer.service.engine.snapshots import SnapshotWriter
from trainer.service.passes import datums_per_pass, service_longest_datum
from trainer.service.slots import SlotTable
from trainer.service.store import (
    ENGINE_HEARTBEAT_S,
    NotFound,
    Request,
    Store,
    default_data_dir,
    retry_database,
)


class Engine:
    """The engine on process 0 (see the module docstring): `run(stop)` claims and runs requests until `stop` is set;
    with several processes every device op is also sent to the followers (service/device.py)."""

    def __init__(self, store: Store, cfg: TrainConfig, *, worker_name: str | None = None,
                 storage_dir: str | Path | None = None, db_retry_s: float = 0.0) -> None:
        """db_retry_s: how long registering with the database is retried while it is unavailable
        (store.retry_database; 0: once)."""
        if jax.process_index() != 0:
            raise ConfigError("the engine runs on process 0; the other processes run run_follower")
        self.store = store
        self.cfg, self.state, tok_dir = prepare(cfg)
        self.leader = device.Leader()
        self.state.leader = self.leader  # every device op is sent to the followers first
        service = self.cfg.service
        assert service is not None
        self.service = service
        self.mcfg = self.state.mcfg
        tokenizer, eos_ids = load_tokenizer(tok_dir)
        # The longest datum one pass holds (what `fit` sizes): data-parallel rows x its bucket <= max_batch_tokens.
        max_datum = service_longest_datum(self.cfg, self.state.progs.data_parallel)
        self.slots = SlotTable(self.state, self.state.stack)
        storage = Path(storage_dir or self.service.storage_dir or default_data_dir() / "checkpoints")
        storage.mkdir(parents=True, exist_ok=True)
        snapshot_root = state_root(self.service, storage_dir)
        snapshot_root.mkdir(parents=True, exist_ok=True)
        base_model = self.service.base_model
        self.worker_id = retry_database(lambda: store.register_worker(worker_name, base_model=base_model),
                                        "register the engine", within_s=db_retry_s)
        self._last_housekeeping = 0.0
        self._owners: dict[str, None] = {}  # owners by when they were last served, the longest ago first
        # The parts, each given what it reads (see the module docstring).
        self.snapshots = SnapshotWriter(store, self.slots, self.state, self.mcfg, worker_id=self.worker_id,
                                        storage=storage, state_root=snapshot_root)
        self.passes = Passes(store, self.slots, self.state, self.mcfg, self.service, worker_id=self.worker_id,
                             max_datum=max_datum)
        self.models = Models(store, self.slots, self.state, self.mcfg, self.service, snapshots=self.snapshots,
                             passes=self.passes)
        self.checkpoints = Checkpoints(store, self.models, self.snapshots, worker_id=self.worker_id)
        self.sampler = Sampler(store, self.slots, self.state, self.mcfg, self.service, models=self.models,
                               tokenizer=tokenizer, eos_ids=eos_ids)
        self.handlers: dict[str, Callable[[Request], bytes | Outcome]] = {
            protocol.CREATE_MODEL: self.models.create_model,
            protocol.LOAD_WEIGHTS: self.models.load_weights,
            protocol.OPTIM_STEP: self.models.optim_step,
            protocol.SAVE_WEIGHTS: self.checkpoints.save_weights,
            protocol.SAVE_WEIGHTS_FOR_SAMPLER: self.checkpoints.save_weights_for_sampler,
            protocol.SAVE_WEIGHTS_EXTERNAL: self.checkpoints.save_weights_external,
            protocol.SAMPLE: self.sampler.sample,
            protocol.DELETE_CHECKPOINT: self.checkpoints.delete_checkpoint,
        }

    @property
    def params(self) -> Any:
        """The base model's weights (on the device)."""
        return self.state.params

    # -- the loop ------------------------------------------------------------------------------------------------

    def _heartbeat(self, stop: threading.Event) -> None:
        # Its own thread: a compile or a long pass must not make the API think the engine is gone.
        while not stop.wait(ENGINE_HEARTBEAT_S):
            try:
                self.store.worker_heartbeat(self.worker_id)
            except Exception:  # noqa: BLE001 - the database briefly unreachable: the next beat retries
                log.warning("engine heartbeat failed", exc_info=True)

    def restore_live(self) -> None:
        """Rebuild the models of open, recently active sessions (up to the slot count) before taking new work."""
        for model in self.store.live_models(quiet_s=self.service.idle_unload_s)[:self.slots.stack.slots]:
            try:
                self.models.slot(model.id)
            except Exception:  # noqa: BLE001 - one model's bad snapshot must not keep the engine down
                log.exception("restoring %s failed; its next request will try again", model.id)

    def run(self, stop: threading.Event, *, idle_sleep_s: float = 0.01) -> None:
        """Claim and run requests until `stop` is set. Errors (the database unreachable, a failed step) are logged
        and retried, restoring the live models included: the loop ends only when asked to, or when something
        escapes it (then the followers are told it FAILED; the CLI exits 42 either way, never 0)."""
        beat = threading.Thread(target=self._heartbeat, args=(stop,), name="engine-heartbeat", daemon=True)
        beat.start()
        reason = device.FAILED
        try:
            if self.service.warmup:
                self.warm_up()
            restored = False
            while not stop.is_set():
                try:
                    if not restored:  # before any claim: a restored model's state is what its next request runs on
                        self.restore_live()
                        restored = True
                    busy = self.step()
                except Exception:  # noqa: BLE001 - e.g. the database briefly unreachable: log, back off, go on
                    log.exception("engine step failed" if restored else "restoring the live models failed")
                    busy = False
                    stop.wait(1.0)
                if not busy:
                    stop.wait(idle_sleep_s)
            reason = device.STOPPED
        finally:
            stop.set()
            # Snapshots in flight complete their requests; a failed one stays running for the next engine's recover.
            self.snapshots.shutdown()
            with contextlib.suppress(Exception):
                self.store.retire_worker(self.worker_id)
            self.leader.stop(reason)

    def warm_up(self) -> None:
        """Run the programs of the smallest shapes once, on the base model and on no slot's data, before any request
        (what most first requests need; every other shape compiles once, then comes from the compile cache). Nothing
        changes: the rows are on no slot (zero gradients), and the optim step runs on a free slot, all zeros, which
        AdamW with zero gradients keeps at zero."""
        if self.mcfg.max_seq_len < 2:  # no one-token prompt with a one-token answer: nothing to warm
            return
        counts = compile_cache.Counts()
        start = time.monotonic()
        # A one-token prompt with max_tokens 1, then a one-token datum forward and forward_backward.
        self.sampler.warm_up()
        self.passes.warm_up()
        if not self.slots:
            self.state.optim(0, 1, P.AdamHyper(0.0, 0.9, 0.95, 1e-8, 0.0, 0.0).array())
        log.info("engine: warm-up ran %d programs in %.1f s (%d read from the compile cache)", counts.built,
                 time.monotonic() - start, counts.hits)

    def step(self) -> bool:
        """Claim and run one batch; False when nothing was runnable."""
        self.snapshots.settle()
        now = time.monotonic()
        if now - self._last_housekeeping > 5.0:
            self._last_housekeeping = now
            self.housekeeping()
        base_model = self.service.base_model
        # The fair share: the owner served longest ago goes first, and unordered requests (samples) are claimed one
        # at a time, so a backlog of one user's samples interleaves with everyone else's requests.
        rows = self.store.claim(self.worker_id, max_batch=64, base_model=base_model, owner_order=list(self._owners),
                                batch_unordered=False)
        if not rows:
            return False
        if rows[0].kind in FWD_KINDS:
            budget = 8 * datums_per_pass(self.service, self.service.min_bucket)
            while len(rows) < budget:
                more = self.store.claim(self.worker_id, kinds=FWD_KINDS, max_batch=64, base_model=base_model,
                                        owner_order=list(self._owners))
                if not more:
                    break
                rows += more
            self._served_by(rows)
            self.passes.run_forward(rows, self.models.slot)
            return True
        self._served_by(rows)
        for row in rows:
            self._run_one(row)
        return True

    def _served_by(self, rows: list[Request]) -> None:
        for row in rows:
            self._owners.pop(row.owner_id, None)
            self._owners[row.owner_id] = None  # the most recently served last
        while len(self._owners) > MAX_FAIR_OWNERS:
            del self._owners[next(iter(self._owners))]

    def _run_one(self, row: Request) -> None:
        try:
            out = self.handlers[row.kind](row)
        except (UserError, NotFound, losses.BadLossInput, losses.UnsupportedLoss, ValueError) as e:
            fail(self.store, self.worker_id, row, str(e), "user")
            return
        except Exception as e:  # noqa: BLE001 - the engine's own fault: report it, keep serving
            log.exception("request %s (%s) failed", row.request_id, row.kind)
            fail(self.store, self.worker_id, row, f"engine error: {e!r}", "server")
            return
        out = out if isinstance(out, Outcome) else Outcome(out)
        if not out.completed:
            self.store.complete(row.request_id, out.result, worker_id=self.worker_id, state=out.state)
        if out.then is not None:
            out.then()

    def housekeeping(self) -> None:
        """Give back the slots of models whose session finished or went quiet; delete expired checkpoints' files."""
        idle = self.service.idle_unload_s
        now = time.time()
        for slot in list(self.slots.values()):
            if (slot.model_id is None or slot.owner_id is None or slot.session_id is None
                    or slot.index in self.slots.writing):
                continue
            try:
                session = self.store.get_session(slot.owner_id, slot.session_id)
            except NotFound:
                self.slots.release(slot.index)
                continue
            quiet = now - session.heartbeat_at.timestamp()
            if session.finished_at is not None or quiet > idle:
                log.info("unloading %s (session %s)", slot.model_id,
                         "finished" if session.finished_at else f"quiet for {quiet:.0f} s")
                self.slots.release(slot.index)
        for ckpt in self.store.expired_checkpoints():
            try:
                self.store.delete_checkpoint(ckpt.owner_id, ckpt.tinker_path)
            except NotFound:
                continue
            self.snapshots.remove_files(ckpt.storage_path)
