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

Over ~600 lines for now: the engine is being split into objects with their own state (issue 41, item 3). Done: the
typed device door (service/device.py: `self.state.run_pass(...)`) and the slot table with the rank and scale policy
(service/slots.py); still here: the loop, the snapshot writer, the passes and sampling.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, NamedTuple

import jax
import numpy as np
from tinker import types

from trainer import compile_cache, hf
from trainer import lora as L
from trainer.config import (
    ConfigError,
    LoraConfig,
    ServiceConfig,
    TrainConfig,
    resolve_mesh,
    with_model,
)
from trainer.service import device, losses, protocol, provenance, sampling
from trainer.service import programs as P
from trainer.service.device import DeviceState
from trainer.service.passes import datum_length, datums_per_pass, service_longest_datum
from trainer.service.shapes import bucket, tinker_targets
from trainer.service.slots import Slot, SlotsFull, SlotTable
from trainer.service.store import (
    DONE,
    ENGINE_HEARTBEAT_S,
    Conflict,
    Model,
    NotFound,
    Request,
    StateUpdate,
    Store,
    default_data_dir,
    retry_database,
    sampling_session_id_for,
    tinker_path,
)
from trainer.sharding import make_mesh

log = logging.getLogger("trainer.service.engine")  # the logger name it had as engine.py

MODEL_STATE_LOST: Final = (
    "this model's training state is not in the engine and has no saved state to rebuild it from (it was created "
    "by a server before state snapshots); load its last checkpoint with create_training_client_from_state"
)
STATE_KIND: Final = "state"  # snapshot directories: <service.state_dir or storage/state>/<owner>/<model>/
MAX_SNAPSHOT_ATTEMPTS: Final = 3  # a request whose state cannot be saved this often fails (server error)
OPTIMIZER_FILE: Final = "optimizer.safetensors"
STATE_FILE: Final = "state.json"
FWD_KINDS: Final = (protocol.FORWARD, protocol.FORWARD_BACKWARD)
MAX_FAIR_OWNERS: Final = 256  # owners the fair share remembers (one not among them counts as never served)


class UserError(Exception):
    """The caller's mistake or a limit it hit: the request fails with category "user"."""


@dataclass(frozen=True)
class Outcome:
    """A handler's result: the response, the model state it leaves (committed with the completion), or that the
    handler completed the request itself (with its checkpoint row); `then` runs once the completion is committed."""

    result: bytes = b""
    state: StateUpdate | None = None
    completed: bool = False
    then: Callable[[], None] | None = None


class Accepted(NamedTuple):
    """A forward/forward_backward request that passed validation: its decoded body, its model's slot and one loss
    row per datum (stable_reinforce's carry what their provenance resolved to)."""

    row: Request
    body: protocol.FwdBwdBody
    slot: int
    loss_rows: list[losses.Row]


def resolve_base_model(cfg: TrainConfig) -> TrainConfig:
    """init.from hf without init.path: the Hugging Face cache entry named service.base_model (offline)."""
    if cfg.init.from_ != "hf" or cfg.init.path:
        return cfg
    assert cfg.service is not None
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(cfg.service.base_model, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises several kinds here
        raise ConfigError(
            f"service.base_model {cfg.service.base_model!r}: not in the Hugging Face cache ({e}); set init.path to a "
            "local checkpoint directory or fill the cache ($HF_HOME)") from None
    return cfg.model_copy(update={"init": cfg.init.model_copy(update={"path": path})})


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def state_root(service: ServiceConfig, storage_dir: str | Path | None = None) -> Path:
    """Where the models' state snapshots go (service.state_dir, else state/ in the checkpoint storage), and the
    persistent compilation cache with them."""
    storage = Path(storage_dir or service.storage_dir or default_data_dir() / "checkpoints")
    return Path(service.state_dir) if service.state_dir else storage / STATE_KIND


def prepare(cfg: TrainConfig) -> tuple[TrainConfig, DeviceState, str | None]:
    """What every process of an engine builds alike: the resolved config (model from the checkpoint, mesh from the
    devices), the programs and the device state; and where the tokenizer is (process 0 uses it)."""
    if cfg.service is None or cfg.lora is None:
        raise ConfigError("the engine needs a config with service and lora sections")
    cfg = resolve_base_model(cfg)
    params_host = None
    tok_dir: str | None = None
    if cfg.init.from_ == "hf":
        params_host, mcfg = hf.import_hf(cfg.init.path or "", cfg.compute.param_dtype)
        cfg = with_model(cfg, mcfg)
        tok_dir = cfg.init.path
    elif cfg.tokenizer != "char":
        tok_dir = cfg.tokenizer
    cfg = resolve_mesh(cfg, jax.device_count(), exact=jax.process_count() > 1)
    n = cfg.mesh.slices * cfg.mesh.fsdp * cfg.mesh.tensor
    mesh = make_mesh(cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor, jax.devices()[:n])
    return cfg, DeviceState(cfg, P.build(cfg, mesh), params_host), tok_dir


def recover(store: Store, *, db_retry_s: float = 0.0) -> None:
    """Settle what a dead engine left running, before a new one starts on the database: every kind runs again, as
    nothing it did survived except through a committed completion (see Durability). Retried for up to db_retry_s
    while the database is unavailable (store.retry_database)."""
    recovered = retry_database(lambda: store.recover(rerunnable_kinds=set(protocol.KINDS)),
                               "settle the previous engine's requests", within_s=db_retry_s)
    if recovered.requeued:
        log.warning("re-queued %d requests a previous engine was running", len(recovered.requeued))


def run_follower(cfg: TrainConfig) -> str:
    """A process other than 0 of a multi-host engine: build the same state, then run process 0's ops. Returns why
    they ended: device.STOPPED (process 0 was asked to stop), device.FAILED (process 0 stopped after an error, its
    op stream broke, or an op failed here) or device.BUG (process 0's start-up failed on a configuration error).
    Errors while building the state propagate."""
    _, state, _ = prepare(cfg)
    try:
        return device.follow(state)
    except Exception:  # noqa: BLE001 - the op stream broke (process 0 gone) or an op failed here: not a clean stop
        log.exception("engine follower: following process 0 failed")
        return device.FAILED


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
        self.service = self.cfg.service
        assert self.service is not None
        self.progs = self.state.progs
        self.mcfg = self.state.mcfg
        self.stack = self.state.stack
        self.tokenizer = None
        if tok_dir is not None and (Path(tok_dir) / "tokenizer.json").is_file():
            from trainer.tokenizer import HFTokenizer

            self.tokenizer = HFTokenizer.from_dir(tok_dir)
        self.eos_ids = self._eos_ids(tok_dir)
        # The longest datum one pass holds (what `fit` sizes): data-parallel rows x its bucket <= max_batch_tokens.
        self.max_datum = service_longest_datum(self.cfg, self.progs.data_parallel)
        self.slots = SlotTable(self.state, self.stack)
        self.storage = Path(storage_dir or self.service.storage_dir or default_data_dir() / "checkpoints")
        self.storage.mkdir(parents=True, exist_ok=True)
        self.state_root = state_root(self.service, storage_dir)
        self.state_root.mkdir(parents=True, exist_ok=True)
        base_model = self.service.base_model
        self.worker_id = retry_database(lambda: store.register_worker(worker_name, base_model=base_model),
                                        "register the engine", within_s=db_retry_s)
        self._last_housekeeping = 0.0
        self._owners: dict[str, None] = {}  # owners by when they were last served, the longest ago first
        # Snapshots being written (self.slots.writing), one thread writing them in order, and the ones that failed, for
        # the main loop to settle.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._failed_writes: queue.Queue[tuple[Request, int, Exception]] = queue.Queue()
        # Observability (tests and logs read them): snapshot writes and restores, with their seconds.
        self.persist_seconds: deque[float] = deque(maxlen=1000)
        self.restores: list[tuple[str, int, float]] = []  # (model id, forward_backward requests replayed, seconds)
        # Requests per fused forward/backward claim, newest last (observability; tests read it).
        self.fused_sizes: deque[int] = deque(maxlen=1000)
        self.handlers: dict[str, Callable[[Request], bytes | Outcome]] = {
            protocol.CREATE_MODEL: self._create_model,
            protocol.LOAD_WEIGHTS: self._load_weights,
            protocol.OPTIM_STEP: self._optim_step,
            protocol.SAVE_WEIGHTS: self._save_weights,
            protocol.SAVE_WEIGHTS_FOR_SAMPLER: self._save_weights_for_sampler,
            protocol.SAVE_WEIGHTS_EXTERNAL: self._save_weights_external,
            protocol.SAMPLE: self._sample,
            protocol.DELETE_CHECKPOINT: self._delete_checkpoint,
        }

    @property
    def params(self) -> Any:
        return self.state.params

    def _eos_ids(self, tok_dir: str | None) -> tuple[int, ...]:
        ids: list[int] = []
        if tok_dir is not None:
            for name in ("generation_config.json", "config.json"):
                path = Path(tok_dir) / name
                if path.is_file():
                    value = json.loads(path.read_text()).get("eos_token_id")
                    ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
        if self.tokenizer is not None:
            ids.append(self.tokenizer.eos_id)
        return tuple(sorted(set(ids)))

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
        for model in self.store.live_models(quiet_s=self.service.idle_unload_s)[:self.stack.slots]:
            try:
                self._model_slot(model.id)
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
            self._writer.shutdown(wait=True)
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
        # The shapes of a one-token prompt with max_tokens 1 and of a one-token datum, as _sample and _pass make them.
        rows, chunk, plen, new = self._sample_shape(1, 1, 1)
        prompt = np.zeros((rows, plen), np.int32)
        valid = np.zeros(prompt.shape, bool)
        valid[:, 0] = True
        settings = sampling.row_settings(types.SamplingParams(max_tokens=1), rows, self.eos_ids[:1],
                                         self.mcfg.vocab_size)
        key = np.asarray(jax.random.key_data(jax.random.PRNGKey(0)))
        self.state.sample(prompt, valid, np.full((rows,), -1, np.int32), key, tuple(settings), (new, 0, chunk))
        n_rows, length = self.progs.rows(1), datum_length(self.service, self.mcfg.max_seq_len, 1)
        packed = losses.pack_rows([losses.Row("cross_entropy", {"target_tokens": np.zeros(1, np.int32),
                                                                "weights": np.zeros(1, np.float32)})],
                                  length=length, num_rows=n_rows, vocab_size=self.mcfg.vocab_size)
        for backward in (False, True):
            self.state.run_pass(np.zeros((n_rows, length), np.int32), np.full((n_rows,), -1, np.int32), packed,
                                backward)
        if not self.slots:
            self.state.optim(0, 1, P.AdamHyper(0.0, 0.9, 0.95, 1e-8, 0.0, 0.0).array())
        log.info("engine: warm-up ran %d programs in %.1f s (%d read from the compile cache)", counts.built,
                 time.monotonic() - start, counts.hits)

    def step(self) -> bool:
        """Claim and run one batch; False when nothing was runnable."""
        self._settle_writes()
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
            self._run_forward(rows)
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
            self._fail(row, str(e), "user")
            return
        except Exception as e:  # noqa: BLE001 - the engine's own fault: report it, keep serving
            log.exception("request %s (%s) failed", row.request_id, row.kind)
            self._fail(row, f"engine error: {e!r}", "server")
            return
        out = out if isinstance(out, Outcome) else Outcome(out)
        if not out.completed:
            self.store.complete(row.request_id, out.result, worker_id=self.worker_id, state=out.state)
        if out.then is not None:
            out.then()

    def _fail(self, row: Request, message: str, category: str) -> None:
        self.store.fail(row.request_id, message, category=category, worker_id=self.worker_id)  # type: ignore[arg-type]

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
            self._remove_files(ckpt.storage_path)

    # -- slots ---------------------------------------------------------------------------------------------------

    def _model_slot(self, model_id: str) -> Slot:
        """The model's slot, rebuilt from its saved state if it is not in one (see Durability above)."""
        return self.slots.find(model_id) or self._restore(model_id)

    def _free_slot(self) -> int:
        """A free slot (SlotTable.free: maybe another model's, evicted), or the request fails as the caller's."""
        try:
            return self.slots.free()
        except SlotsFull as e:
            raise UserError(str(e)) from None

    def _check_rank(self, rank: int) -> None:
        if (why := self.slots.rank_refused(rank)) is not None:
            raise UserError(why)

    # -- models --------------------------------------------------------------------------------------------------

    def _served(self, base_model: str) -> None:
        # One engine serves one base model; an API that lists more needs an engine for each (issue 19 routes them).
        if base_model != self.service.base_model:
            raise UserError(f"base model {base_model!r} is not served by this engine (it serves "
                            f"{self.service.base_model!r})")

    def _create_model(self, row: Request) -> Outcome:
        model = self.store.get_model(row.owner_id, row.model_id or "")
        self._served(model.base_model)
        if (old := self.slots.find(model.id)) is not None:  # a re-run after a restart that restored it
            self.slots.release(old.index)
        self._init_adapter(model, self._free_slot())
        state = StateUpdate(model.id, row.seq_id or 0, 0, None)
        return Outcome(protocol.json_result(types.CreateModelResponse(model_id=model.id)), state)

    def _init_adapter(self, model: Model, index: int) -> Slot:
        """The model's initial adapter (its lora_config and seed) in slot `index`: create_model, and its restore."""
        lc = types.LoraConfig.model_validate(model.lora_config or {"rank": 32})
        self._check_rank(lc.rank)
        targets = tinker_targets(lc.train_attn, lc.train_mlp, lc.train_unembed)
        if not targets:
            raise UserError("lora_config trains nothing: set train_attn, train_mlp or train_unembed")
        scale = self.slots.scale(lc.rank)
        single_cfg = LoraConfig(rank=lc.rank, alpha=self.stack.alpha, targets=list(targets),
                                rslora=self.stack.rslora, slots=1)
        seed = lc.seed if lc.seed is not None else _stable_int(model.id)
        single = jax.device_get(L.init_lora(self.mcfg, single_cfg, jax.random.PRNGKey(seed)))
        single = jax.tree.map(lambda x: np.asarray(x, np.float32), single)
        self.state.write_slot(index, scale, single, single_cfg)
        slot = Slot(index, lc.rank, targets, scale, model_id=model.id, owner_id=model.owner_id,
                    session_id=model.session_id)
        self.slots[index] = slot
        return slot

    def _restore(self, model_id: str) -> Slot:
        """Rebuild a model that is in no slot: its saved state, then the forward_backward requests done since."""
        t0 = time.perf_counter()
        state = self.store.model_state(model_id)
        if state is None:
            raise UserError(MODEL_STATE_LOST)
        model = self.store.model(model_id)
        self._served(model.base_model)
        index = self._free_slot()
        if state.storage_path is None:
            slot = self._init_adapter(model, index)
        else:
            slot = self._load_dir(model, index, Path(state.storage_path), with_optimizer=True)
        slot.step = state.step
        replay = self.store.replay_log(model_id, state.seq_id, (protocol.FORWARD_BACKWARD,))
        if replay:
            self.slots.pinned.add(index)
            try:
                bodies = [(r, protocol.decode_forward_backward(r.body)) for r in replay]
                self._fused([Accepted(r, b, index, self._loss_rows(r, b)) for r, b in bodies])
            finally:
                self.slots.pinned.discard(index)
        seconds = time.perf_counter() - t0
        self.restores.append((model_id, len(replay), seconds))
        log.info("restored %s at step %d (after seq %d) and replayed %d forward_backward in %.2f s", model_id,
                 state.step, state.seq_id, len(replay), seconds)
        return slot

    def _load_dir(self, model: Model, index: int, root: Path, *, with_optimizer: bool) -> Slot:
        """A saved adapter (and its Adam moments and step) into slot `index` for `model`."""
        single, single_cfg = L.import_peft(root, self.mcfg)
        self._check_rank(single_cfg.rank)
        moments, step = self._read_moments(root, single_cfg) if with_optimizer else (None, 0)
        scale = single_cfg.scale
        self.state.write_slot(index, scale, jax.tree.map(lambda x: np.asarray(x, np.float32), single), single_cfg,
                              moments)
        slot = Slot(index, single_cfg.rank, tuple(single_cfg.targets), scale, model_id=model.id,
                    owner_id=model.owner_id, session_id=model.session_id, step=step)
        self.slots[index] = slot
        return slot

    def _persist(self, row: Request, slot: Slot, result: bytes) -> Outcome:
        """Snapshot the slot's state after `row` and complete `row` with it, the snapshot it replaces deleted after.

        The slot is read to the host now; the files are written and the completion committed by the snapshot thread,
        so the engine goes on with other models meanwhile (the model's own next request waits: its seq_id is not
        claimable before this one completes). Until then the slot is neither evicted nor unloaded. A write that fails
        is handed back to the main loop, which drops the slot (its state ran ahead of the committed one) and queues
        the request again (`_settle_writes`)."""
        host = self._read_adapter(slot)
        model_id, index = slot.model_id or "", slot.index
        self.slots.writing[index] = model_id

        def write_and_commit() -> None:
            t0 = time.perf_counter()
            try:
                previous = self.store.model_state(model_id)
                path = self._write_adapter(row, STATE_KIND, f"seq{row.seq_id or 0:08d}", host, with_optimizer=True)
                self.store.complete(row.request_id, result, worker_id=self.worker_id,
                                    state=StateUpdate(model_id, row.seq_id or 0, host[4], str(path)))
            except Exception as e:  # noqa: BLE001 - e.g. the bucket or the database unreachable for a moment
                log.exception("snapshot of %s after seq %s failed", model_id, row.seq_id)
                self._failed_writes.put((row, index, e))
                return
            finally:
                self.persist_seconds.append(time.perf_counter() - t0)
                self.slots.writing.pop(index, None)
            old = previous.storage_path if previous is not None else None
            if old and self.state_root in Path(old).parents:
                self._remove_files(old, release=False)

        self._writer.submit(write_and_commit)
        return Outcome(completed=True)

    def _settle_writes(self) -> None:
        """On the main loop: requests whose snapshot failed run again on the model rebuilt from its committed state."""
        while True:
            try:
                row, index, error = self._failed_writes.get_nowait()
            except queue.Empty:
                return
            slot = self.slots.get(index)
            if slot is not None and slot.model_id == row.model_id:
                self.slots.release(index)
            if row.attempts >= MAX_SNAPSHOT_ATTEMPTS:
                self._fail(row, f"saving the model's state failed {row.attempts} times: {error!r}", "server")
            else:
                self.store.requeue(row.request_id, worker_id=self.worker_id)

    def _load_weights(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        ckpt = self.store.get_checkpoint(row.owner_id, req.path)
        root = Path(ckpt.storage_path)
        if req.optimizer and not (root / OPTIMIZER_FILE).is_file():
            raise UserError(f"{req.path} holds no optimizer state (a sampler checkpoint); load it without the "
                            "optimizer")
        model = self.store.get_model(row.owner_id, row.model_id or "")
        self._served(model.base_model)
        # The load replaces the whole state: no need to rebuild the old one first.
        old = self.slots.find(model.id)
        slot = self._load_dir(model, old.index if old is not None else self._free_slot(), root,
                              with_optimizer=req.optimizer)
        # A copy of its own as the model's state: the user may delete the checkpoint it came from.
        return self._persist(row, slot, protocol.json_result(types.LoadWeightsResponse(path=req.path,
                                                                                        model_id=model.id)))

    def _optim_step(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        p = req.optim_params
        if not isinstance(p, types.AdamParams):
            raise UserError(f"optimizer {getattr(p, 'type', type(p).__name__)!r} is not supported; use AdamParams")
        if not (p.learning_rate >= 0 and 0 <= p.beta1 < 1 and 0 <= p.beta2 < 1 and p.eps > 0
                and p.weight_decay >= 0 and p.grad_clip_norm >= 0):
            raise UserError(f"AdamParams out of range: {p.model_dump()}")
        slot = self._model_slot(row.model_id or "")
        slot.step += 1
        hyper = P.AdamHyper(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
        norm = self.state.optim(slot.index, slot.step, hyper.array())
        metrics = {"grad_norm:mean": norm, "learning_rate:mean": p.learning_rate}
        return self._persist(row, slot, protocol.json_result(types.OptimStepResponse(metrics=metrics)))

    # -- forward / forward_backward -----------------------------------------------------------------------------

    def _run_forward(self, rows: list[Request]) -> None:
        """Validate each request, fuse the valid ones' datums, run them in bucketed passes, answer each request."""
        accepted: list[Accepted] = []
        try:
            self._validate_forward(rows, accepted)
        finally:
            self.slots.pinned.clear()
        if not accepted:
            return
        self.fused_sizes.append(len(accepted))
        try:
            outputs = self._fused(accepted)
        except Exception as e:  # noqa: BLE001
            log.exception("forward/backward batch failed")
            for row, *_ in accepted:
                self._fail(row, f"engine error: {e!r}", "server")
            return
        for (row, *_), (logps, row_losses) in zip(accepted, outputs, strict=True):
            result = protocol.encode_forward_backward_output(
                [{"logprobs": lp} for lp in logps], losses.request_metrics(row_losses, slice(None)))
            self.store.complete(row.request_id, result, worker_id=self.worker_id)

    def _validate_forward(self, rows: list[Request], accepted: list[Accepted]) -> None:
        for row in rows:
            try:
                body = protocol.decode_forward_backward(row.body)
                total = sum(len(d.tokens) for d in body.data)
                if total > self.service.max_request_tokens:
                    raise UserError(f"the request carries {total} tokens; this server takes at most "
                                    f"{self.service.max_request_tokens} per request (service.max_request_tokens): "
                                    "split it into several forward_backward calls before the optim_step")
                slot = self._model_slot(row.model_id or "")
                self.slots.pinned.add(slot.index)
                for i, d in enumerate(body.data):
                    if len(d.tokens) > self.max_datum:
                        raise UserError(
                            f"datum {i} has {len(d.tokens)} tokens; this server takes at most {self.max_datum} (the "
                            f"model's context is {self.mcfg.max_seq_len}; a pass holds service.max_batch_tokens = "
                            f"{self.service.max_batch_tokens})")
                    if len(d.tokens) and (d.tokens.min() < 0 or d.tokens.max() >= self.mcfg.vocab_size):
                        raise UserError(f"datum {i}: token ids must be in [0, {self.mcfg.vocab_size})")
                for i, d in enumerate(body.data):
                    targets = d.loss_fn_inputs.get("target_tokens")
                    if targets is not None and len(targets) != len(d.tokens):
                        raise UserError(f"datum {i}: loss_fn_inputs have {len(targets)} positions, model_input has "
                                        f"{len(d.tokens)}")
                # Validates loss names, configs, inputs and provenance: a bad request fails alone.
                loss_rows = self._loss_rows(row, body)
                losses.pack_rows(loss_rows, vocab_size=self.mcfg.vocab_size)
                accepted.append(Accepted(row, body, slot.index, loss_rows))
            except (UserError, NotFound, losses.BadLossInput, losses.UnsupportedLoss, ValueError) as e:
                self._fail(row, str(e), "user")
            except Exception as e:  # noqa: BLE001 - whatever one request's input does, its batch-mates still run
                log.exception("request %s (%s): validation failed", row.request_id, row.kind)
                self._fail(row, f"engine error while reading the request: {e!r}", "server")

    def _loss_rows(self, row: Request, body: protocol.FwdBwdBody) -> list[losses.Row]:
        """One loss row per datum; a stable_reinforce datum's spans are resolved against the sampler's records."""
        if body.loss_fn != "stable_reinforce":
            return [losses.Row(body.loss_fn, d.loss_fn_inputs, body.loss_fn_config) for d in body.data]
        session_id = self.store.model(row.model_id or "").session_id
        spans = [provenance.decode(d.raw, i) for i, d in enumerate(body.data)]
        # Every sample request the datums name, in one read (a cookbook batch names hundreds).
        named = self.store.requests_with_session(row.owner_id, protocol.SAMPLE, provenance.request_ids(spans))
        records: dict[str, provenance.Record] = {}

        def lookup(request_id: str) -> provenance.Record:
            if request_id not in records:
                records[request_id] = self._sample_record(named.get(request_id), session_id, request_id)
            return records[request_id]

        out = []
        for i, (d, datum_spans) in enumerate(zip(body.data, spans, strict=True)):
            targets = d.loss_fn_inputs.get("target_tokens")
            if targets is None:
                raise losses.BadLossInput(f"datum {i} (stable_reinforce): missing loss_fn_inputs ['target_tokens']")
            prov = provenance.resolve(i, d.tokens, targets, datum_spans, lookup)
            out.append(losses.Row(body.loss_fn, d.loss_fn_inputs, body.loss_fn_config, prov))
        return out

    @staticmethod
    def _sample_record(found: tuple[Request, str] | None, session_id: str, request_id: str) -> provenance.Record:
        """The record of a sample request of this owner (`found`: the request and its sampler's session), made with
        record_stability_info in the training model's session."""
        name = f"sequences of request {request_id!r}"
        if found is None:
            raise losses.BadLossInput(f"{name}: no such sample request")
        sample, sampled_in = found
        if sample.status != DONE or sample.result is None:
            raise losses.BadLossInput(f"{name}: not a finished sample request")
        req: types.SampleRequest = protocol.decode_json(protocol.SAMPLE, sample.body)
        if not req.record_stability_info:
            raise losses.BadLossInput(f"{name}: sampled without record_stability_info=True (make the sampling client "
                                      "with record_stability_info=True)")
        if sampled_in != session_id:
            raise losses.BadLossInput(f"{name}: sampled in another session; provenance works only within the "
                                      "session that sampled (sample and train with one ServiceClient)")
        return provenance.sampled_record(req.prompt.to_ints(), sample.result)

    def _fused(self, accepted: list[Accepted]) -> list[tuple[list[np.ndarray], np.ndarray]]:
        """Every datum of every accepted request, grouped by length bucket and backward-or-not, in passes of at most
        max_batch_tokens; returns per request its datums' logprobs and row losses."""
        svc = self.service
        items = []  # (request index, datum index, backward, datum, loss row, slot)
        for r, (_, body, slot, loss_rows) in enumerate(accepted):
            for i, (d, loss_row) in enumerate(zip(body.data, loss_rows, strict=True)):
                items.append((r, i, not body.forward_only, d, loss_row, slot))
        out_lp: list[list[np.ndarray | None]] = [[None] * len(a.body.data) for a in accepted]
        out_loss: list[np.ndarray] = [np.zeros(len(a.body.data)) for a in accepted]
        groups: dict[tuple[bool, int], list[Any]] = {}
        for item in items:
            length = datum_length(svc, self.mcfg.max_seq_len, len(item[3].tokens))
            groups.setdefault((item[2], length), []).append(item)
        for (backward, length), group in sorted(groups.items()):
            per_pass = datums_per_pass(svc, length)
            for start in range(0, len(group), per_pass):
                part = group[start:start + per_pass]
                lp, row_loss = self._pass(part, length, backward)
                for k, (r, i, _, d, *_rest) in enumerate(part):
                    out_lp[r][i] = lp[k, :len(d.tokens)].astype(np.float32)
                    out_loss[r][i] = row_loss[k]
        return [([x for x in lps if x is not None], loss_) for lps, loss_ in zip(out_lp, out_loss, strict=True)]

    def _pass(self, part: list[Any], length: int, backward: bool) -> tuple[np.ndarray, np.ndarray]:
        n_rows = self.progs.rows(len(part))
        packed = losses.pack_rows([loss_row for *_, loss_row, _ in part], length=length, num_rows=n_rows,
                                  vocab_size=self.mcfg.vocab_size)
        tokens = np.zeros((n_rows, length), np.int32)
        slot_B = np.full((n_rows,), -1, np.int32)
        for k, (*_, d, _loss_row, slot) in enumerate(part):
            tokens[k, :len(d.tokens)] = d.tokens
            slot_B[k] = slot
        return self.state.run_pass(tokens, slot_B, packed, backward)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _write_dir(self, owner_id: str, model_id: str, kind: str, name: str, write: Callable[[Path], None]) -> Path:
        """A fresh directory for one save, filled by `write` under a temporary name and renamed into place."""
        model_dir = Path(owner_id) / model_id.replace(":", "_")
        # Snapshots have a root of their own (service.state_dir): the stack puts it on a bucket that keeps no old
        # versions, as one is replaced at every optim_step.
        where = self.state_root / model_dir if kind == STATE_KIND else self.storage / model_dir / kind
        final = where / f"{name}-{uuid.uuid4().hex[:12]}"
        tmp = final.with_name(final.name + ".partial")
        tmp.mkdir(parents=True)
        try:
            write(tmp)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _remove_files(self, storage_path: str, *, release: bool = True) -> None:
        path = Path(storage_path)
        if self.storage in path.parents or self.state_root in path.parents:  # never delete outside our own storage
            shutil.rmtree(path, ignore_errors=True)
        if release:  # a sampler slot loaded from these files (main thread only: a device op)
            for slot in list(self.slots.values()):
                if slot.storage_path == storage_path:
                    self.slots.release(slot.index)

    def _record(self, row: Request, name: str, kind: str, path: Path, req: Any, result: bytes,
                sampler_seq_id: int | None = None) -> Outcome:
        """Add the checkpoint row and complete the request in one transaction; on overwrite the files it replaces are
        deleted, on a conflict ours are."""
        previous = None
        with contextlib.suppress(NotFound):
            previous = self.store.get_checkpoint(row.owner_id, tinker_path(row.model_id or "", kind, name))  # type: ignore[arg-type]
        try:
            ckpt = self.store.add_checkpoint(
                row.owner_id, row.model_id or "", name, kind, str(path), size_bytes=_dir_size(path),  # type: ignore[arg-type]
                ttl_seconds=req.ttl_seconds, overwrite=getattr(req, "overwrite", False),
                user_metadata=getattr(req, "user_metadata", None), sampler_seq_id=sampler_seq_id,
                completes=(row.request_id, self.worker_id, result))
        except Conflict as e:
            self._remove_files(str(path))
            raise UserError(f"{e}; pass overwrite=True to replace it") from None
        except ValueError:
            self._remove_files(str(path))
            raise
        assert ckpt.tinker_path == tinker_path(row.model_id or "", kind, name)  # type: ignore[arg-type]
        then = None
        if previous is not None and previous.storage_path != str(path):
            then = lambda: self._remove_files(previous.storage_path)  # noqa: E731
        return Outcome(completed=True, then=then)

    def _save_adapter(self, row: Request, kind: str, name: str, *, with_optimizer: bool) -> Path:
        return self._write_adapter(row, kind, name, self._read_adapter(self._model_slot(row.model_id or "")),
                                   with_optimizer=with_optimizer)

    def _read_adapter(self, slot: Slot) -> tuple[Any, Any, Any, LoraConfig, int, Slot]:
        """The slot's weights and Adam moments on the host (a device op: the main thread, before the slot changes)."""
        single, m, v = self.state.read_slot(slot.index, slot.rank, slot.targets)
        return single, m, v, self.slots.single_cfg(slot), slot.step, replace(slot)

    def _write_adapter(self, row: Request, kind: str, name: str, host: tuple[Any, Any, Any, LoraConfig, int, Slot], *,
                       with_optimizer: bool) -> Path:
        """Write what _read_adapter read as a PEFT directory (plus optimizer and state files); any thread."""
        single, m, v, single_cfg, step, slot = host
        base = self.store.get_model(row.owner_id, row.model_id or "").base_model

        def write(d: Path) -> None:
            L.export_peft(single, single_cfg, d, base_model_name_or_path=base)
            if with_optimizer:
                tensors = {f"exp_avg.{k}": t for k, t in L.peft_tensors(m).items()}
                tensors |= {f"exp_avg_sq.{k}": t for k, t in L.peft_tensors(v).items()}
                hf.write_safetensors(d / OPTIMIZER_FILE, tensors, {"format": "pt"})
                state = {"step": step, "rank": slot.rank, "targets": list(slot.targets), "scale": slot.scale}
                (d / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

        return self._write_dir(row.owner_id, row.model_id or "", kind, name, write)

    def _read_moments(self, root: Path, single_cfg: LoraConfig) -> tuple[tuple[Any, Any], int]:
        tensors = hf.read_safetensors(root / OPTIMIZER_FILE)
        state = json.loads((root / STATE_FILE).read_text())
        moments = tuple(
            jax.tree.map(lambda x: np.asarray(x, np.float32), L.adapter_from_tensors(
                {k[len(prefix):]: tensors[k] for k in tensors if k.startswith(prefix)}, self.mcfg, single_cfg,
                root / OPTIMIZER_FILE))
            for prefix in ("exp_avg.", "exp_avg_sq."))
        return (moments[0], moments[1]), int(state["step"])

    def _save_weights(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        name = req.path or f"step{self._model_slot(row.model_id or '').step:06d}"
        path = self._save_adapter(row, "weights", name, with_optimizer=True)
        result = protocol.json_result(types.SaveWeightsResponse(path=tinker_path(row.model_id or "", "training",
                                                                                 name)))
        return self._record(row, name, "training", path, req, result)

    def _save_weights_for_sampler(self, row: Request) -> Outcome:
        req = protocol.decode_json(row.kind, row.body)
        model_id = row.model_id or ""
        if req.path is not None:
            path = self._save_adapter(row, "sampler_weights", req.path, with_optimizer=False)
            result = protocol.json_result({"path": tinker_path(model_id, "sampler", req.path)})
            return self._record(row, req.path, "sampler", path, req, result)
        if req.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a path or a sampling_session_seq_id")
        name = protocol.ephemeral_sampler_name(req.sampling_session_seq_id, row.seq_id or 0)
        path = self._save_adapter(row, "sampler_weights", name, with_optimizer=False)
        model = self.store.get_model(row.owner_id, model_id)
        sampler_id = sampling_session_id_for(model.session_id, req.sampling_session_seq_id)
        result = protocol.json_result({"sampling_session_id": sampler_id,
                                       "path": tinker_path(model_id, "sampler", name)})
        return self._record(row, name, "sampler", path, req, result, sampler_seq_id=req.sampling_session_seq_id)

    def _save_weights_external(self, row: Request) -> Outcome:
        # The PEFT adapter alone, as for sampler weights: the HF format the SDK documents for external weights.
        req = protocol.decode_json(row.kind, row.body)
        path = self._save_adapter(row, "external_weights", req.path, with_optimizer=False)
        result = protocol.json_result(types.SaveWeightsExternalResponseInternal(
            path=tinker_path(row.model_id or "", "external", req.path), size_bytes=_dir_size(path)))
        return self._record(row, req.path, "external", path, req, result)

    def _delete_checkpoint(self, row: Request) -> bytes:
        req = protocol.decode_json(row.kind, row.body)
        self._remove_files(req.storage_path)
        return protocol.json_result({})

    # -- sampling ------------------------------------------------------------------------------------------------

    def _sampler_slot(self, owner_id: str, model_path: str | None) -> int:
        if model_path is None:
            return -1
        ckpt = self.store.get_checkpoint(owner_id, model_path)
        for slot in self.slots.values():
            if slot.storage_path == ckpt.storage_path:
                slot.last_used = time.monotonic()
                return slot.index
        single, single_cfg = L.import_peft(ckpt.storage_path, self.mcfg)
        self._check_rank(single_cfg.rank)
        index = self._free_slot()
        self.state.write_slot(index, single_cfg.scale, jax.tree.map(lambda x: np.asarray(x, np.float32), single),
                              single_cfg)
        self.slots[index] = Slot(index, single_cfg.rank, tuple(single_cfg.targets), single_cfg.scale,
                                 storage_path=ckpt.storage_path)
        return index

    def _stops(self, stop: str | Sequence[str] | Sequence[int] | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if stop is None:
            return self.eos_ids, ()
        if isinstance(stop, str):
            stop = [stop]
        if all(isinstance(s, int) for s in stop):
            return tuple(int(s) for s in stop), ()  # type: ignore[arg-type]
        if self.tokenizer is None:
            raise UserError("stop strings need the model's tokenizer, which this server does not have; pass token ids")
        return self.eos_ids, tuple(str(s) for s in stop)

    def _sample(self, row: Request) -> bytes:
        req: types.SampleRequest = protocol.decode_json(row.kind, row.body)
        unsupported = [name for name, on in (
            ("topk_sample_logprobs", req.topk_sample_logprobs > 0),
            ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
            ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0)) if on]
        if unsupported:
            raise UserError(f"{', '.join(unsupported)} not supported by this server")
        sp = req.sampling_params
        if wrong := sampling.problems(sp, req.num_samples, self.service.max_num_samples):
            raise UserError("; ".join(wrong))
        assert sp.max_tokens is not None
        if sp.top_k > self.mcfg.vocab_size:
            raise UserError(f"sampling_params.top_k must be at most this model's vocabulary ({self.mcfg.vocab_size}), "
                            f"not {sp.top_k}")
        prompt = np.array(req.prompt.to_ints(), np.int32)
        if len(prompt) == 0:
            raise UserError("the prompt is empty")
        if len(prompt) + sp.max_tokens > self.mcfg.max_seq_len:
            raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({sp.max_tokens}) exceed this model's "
                            f"context of {self.mcfg.max_seq_len}")
        if prompt.min() < 0 or prompt.max() >= self.mcfg.vocab_size:
            raise UserError(f"prompt token ids must be in [0, {self.mcfg.vocab_size})")
        sampler = self.store.get_sampling_session(row.owner_id, req.sampling_session_id or "")
        self._served(sampler.base_model)
        slot = self._sampler_slot(row.owner_id, sampler.model_path)
        stop_ids, stop_strs = self._stops(sp.stop)
        if len(stop_ids) > sampling.MAX_STOP_IDS:
            raise UserError(f"sampling_params.stop: {len(stop_ids)} stop token ids; at most {sampling.MAX_STOP_IDS}")
        seed = sp.seed if sp.seed is not None else _stable_int(row.request_id)
        key = jax.random.PRNGKey(seed)
        n = req.num_samples
        rows, chunk, plen, new = self._sample_shape(len(prompt), sp.max_tokens, n)
        prompt_BP = np.zeros((rows, plen), np.int32)
        valid_BP = np.zeros((rows, plen), bool)
        prompt_BP[:, :len(prompt)] = prompt
        valid_BP[:, :len(prompt)] = True
        slot_B = np.full((rows,), slot, np.int32)
        per_row = sampling.row_settings(sp, rows, stop_ids, self.mcfg.vocab_size)
        tokens, logprobs, mask = self.state.sample(prompt_BP, valid_BP, slot_B, np.asarray(jax.random.key_data(key)),
                                                   tuple(per_row), (new, 0, chunk))
        sequences = [self._sequence(tokens[b], logprobs[b], mask[b], stop_ids, stop_strs) for b in range(n)]
        prompt_lp = self._prompt_logprobs(prompt, slot) if req.prompt_logprobs else None
        topk = self._prompt_topk(prompt, slot, req.topk_prompt_logprobs) if req.topk_prompt_logprobs > 0 else None
        return protocol.encode_sample_response(sequences, prompt_logprobs=prompt_lp, topk_prompt_logprobs=topk)

    def _sample_shape(self, prompt_len: int, max_tokens: int, n: int) -> tuple[int, int, int, int]:
        """The shapes that pick a sample's program: rows (n's row bucket, a multiple of the chunk decoded at once),
        the chunk, the prompt bucket and the token bucket (each row stops at its own max_tokens inside it). Needs
        prompt_len + max_tokens <= the context."""
        svc = self.service
        chunk = min(svc.sample_max_sequences, self.progs.rows(n))
        rows = -(-self.progs.rows(n) // chunk) * chunk
        plen = bucket(prompt_len, svc.min_bucket, self.mcfg.max_seq_len - max_tokens)
        return rows, chunk, plen, bucket(max_tokens, svc.min_bucket, self.mcfg.max_seq_len - plen)

    def _prompt_topk(self, prompt: np.ndarray, slot: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k likeliest tokens at each prompt position given the tokens before it; the first has none."""
        if k > self.mcfg.vocab_size:
            raise UserError(f"topk_prompt_logprobs={k} exceeds the vocabulary ({self.mcfg.vocab_size})")
        n = len(prompt) - 1
        ids = np.zeros((len(prompt), k), np.int32)
        logprobs = np.full((len(prompt), k), protocol.TOPK_MASK_LOGPROB, np.float32)
        if n == 0:
            return ids, logprobs
        tokens, slot_B = self._prompt_row(prompt, slot)
        valid = np.zeros(tokens.shape, bool)
        valid[0, :n] = True
        top_ids, top_lp = self.state.prompt_topk(tokens, slot_B, valid, k)
        ids[1:], logprobs[1:] = top_ids[0, :n], top_lp[0, :n]
        return ids, logprobs

    def _sequence(self, tokens: np.ndarray, logprobs: np.ndarray, mask: np.ndarray, stop_ids: tuple[int, ...],
                  stop_strs: tuple[str, ...]) -> protocol.SampledOutput:
        k = int(mask.sum())
        toks, lps = tokens[:k], logprobs[:k]
        reason = "stop" if k and int(toks[-1]) in stop_ids else "length"
        if stop_strs and self.tokenizer is not None:
            for j in range(1, k + 1):
                text = self.tokenizer.decode([int(t) for t in toks[:j]])
                if any(s in text for s in stop_strs):
                    toks, lps, reason = toks[:j], lps[:j], "stop"
                    break
        return protocol.SampledOutput(tokens=toks, stop_reason=reason, logprobs=lps)  # type: ignore[arg-type]

    def _prompt_logprobs(self, prompt: np.ndarray, slot: int) -> np.ndarray:
        """log p(prompt[i] | prompt[:i]) under the sampler's weights; the first token has none (NaN)."""
        n = len(prompt) - 1
        out = np.full(len(prompt), np.nan, np.float32)
        if n == 0:
            return out
        tokens, slot_B = self._prompt_row(prompt, slot)
        packed = losses.pack_rows([losses.Row("cross_entropy", {"target_tokens": prompt[1:],
                                                                "weights": np.zeros(n, np.float32)})],
                                  length=tokens.shape[1], num_rows=tokens.shape[0], vocab_size=self.mcfg.vocab_size)
        lp, _ = self.state.run_pass(tokens, slot_B, packed, False)
        out[1:] = np.asarray(lp)[0, :n]
        return out

    def _prompt_row(self, prompt: np.ndarray, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """A one-prompt batch for the prompt's own predictions: row 0 holds prompt[:-1] on `slot`, bucketed; the
        other rows (data-parallel padding) are empty on the base model."""
        n = len(prompt) - 1
        tokens = np.zeros((self.progs.rows(1), datum_length(self.service, self.mcfg.max_seq_len, n)), np.int32)
        tokens[0, :n] = prompt[:-1]
        slot_B = np.full((tokens.shape[0],), -1, np.int32)
        slot_B[0] = slot
        return tokens, slot_B
