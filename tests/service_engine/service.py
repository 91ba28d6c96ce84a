"""A real service for the engine tests: the API (uvicorn, in a thread, on 127.0.0.1) and the JAX engine (in a thread)
over one sqlite database, driven by the real tinker SDK. Only the process boundary is left out: the two share nothing
but the database, as separate processes would."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tinker

from tests.service_api.conftest import api_in_thread
from trainer.base.config import TrainConfig, config_from_dict
from trainer.service import auth
from trainer.service.api import BaseModelSpec, ServerConfig
from trainer.service.engine import Engine, recover
from trainer.service.store import Store

TINY_MODEL: dict[str, Any] = {
    "vocab_size": 128, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 64,
    "max_seq_len": 64, "qk_norm": True, "tie_embeddings": False,
}


def tiny_config(storage: Path, **service: Any) -> TrainConfig:
    return config_from_dict({
        "model": TINY_MODEL, "lora": {"rank": 8, "alpha": 32, "slots": 16},
        # warmup off: these tests build many engines; the warm-up runs in the as-deployed service (tests/deployed).
        "service": {"base_model": "tiny/random", "storage_dir": str(storage), "min_bucket": 16, "warmup": False,
                    **service},
        "sampling": {"max_new_tokens": 8},
    })


@dataclass
class LiveService:
    url: str
    store: Store
    cfg: TrainConfig
    engine: Engine
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _clients: list[tuple[tinker.ServiceClient, str]] = field(default_factory=list)

    def start_engine(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.engine.run, args=(self._stop,), name="engine", daemon=True)
        self._thread.start()

    def stop_engine(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            assert not self._thread.is_alive(), "the engine did not stop"

    def restart_engine(self) -> Engine:
        """A new engine on the same database and storage, as after a crash: nothing of the old one's memory."""
        self.stop_engine()
        recover(self.store)
        self.engine = Engine(Store(str(self.store.url.render_as_string(hide_password=False))), self.cfg)
        self.start_engine()
        return self.engine

    def client(self, name: str = "test") -> tinker.ServiceClient:
        """A ServiceClient with a fresh key (a fresh tenant), closed when the service stops."""
        _, key = auth.create_key(self.store, name)
        client = tinker.ServiceClient(base_url=self.url, api_key=key)
        self._clients.append((client, key))
        return client

    def rest(self, client: tinker.ServiceClient) -> tinker.RestClient:
        """A RestClient with the key of `client` (ServiceClient.create_rest_client is deprecated in tinker 0.38)."""
        return tinker.RestClient(base_url=self.url, api_key=next(k for c, k in self._clients if c is client))

    def close_clients(self) -> None:
        # Their heartbeat threads would otherwise outlive the server and complain at interpreter exit.
        for client, _ in self._clients:
            with contextlib.suppress(Exception):
                client.close("success").result(timeout=10)
        self._clients.clear()


@contextmanager
def live_service(tmp: Path, cfg: TrainConfig | None = None) -> Iterator[LiveService]:
    cfg = cfg or tiny_config(tmp / "checkpoints")
    db = f"sqlite:///{tmp / 'service.db'}"
    store = Store(db)
    assert cfg.service is not None
    config = ServerConfig([BaseModelSpec(cfg.service.base_model, max_context_length=cfg.model_cfg.max_seq_len)],
                          long_poll_s=5.0)
    live = LiveService("", store, cfg, Engine(Store(db), cfg))
    try:
        with api_in_thread(store, config) as url:
            live.url = url
            live.start_engine()
            try:
                yield live
            finally:
                live.close_clients()
                live.stop_engine()
    finally:
        live.engine.store.close()
        store.close()
