"""The engine's shared vocabulary: the user error, a handler's outcome, failing a request, the constants of the
snapshot layout, and what every process builds alike (`prepare`, `recover`, `run_follower`)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import jax

from trainer.base.config import (
    ConfigError,
    ServiceConfig,
    TrainConfig,
    resolve_mesh,
    with_model,
)
from trainer.model import hf
from trainer.model.sharding import make_mesh
from trainer.service import device, protocol
from trainer.service import programs as P
from trainer.service.device import DeviceState
from trainer.service.store import (
    ErrorCategory,
    Request,
    StateUpdate,
    Store,
    default_data_dir,
    retry_database,
)

log = logging.getLogger("trainer.service.engine")  # one logger for the engine's modules, as before the split

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


def fail(store: Store, worker_id: str, row: Request, message: str, category: ErrorCategory) -> None:
    """Fail a request this engine (`worker_id`) is running: "user" for the caller's mistake, "server" for ours."""
    store.fail(row.request_id, message, category=category, worker_id=worker_id)


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


