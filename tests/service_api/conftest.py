"""The API under test: a real uvicorn server (in a thread, on 127.0.0.1, an ephemeral port) over a sqlite store, driven
by the real tinker SDK, with `FakeEngine` standing in for the JAX engine.

`FakeEngine` is a TEST DOUBLE for the engine (trainer/service/engine/, tested in tests/service_engine): it claims
requests from the store (its own Store on the same file, as a separate engine process would) and completes or fails
them with hand-made results in trainer.service.protocol's formats. What these tests check is the API and the contract
(the promise, the long-poll, the result bytes the SDK parses, the error shape), not any model computation.

One server, store and engine for the whole session; every test makes its own API keys, i.e. its own tenant, so
listings start empty per test.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from tinker import types

from trainer.service import auth, protocol
from trainer.service.api import BaseModelSpec, ServerConfig, create_app
from trainer.service.store import Checkpoint, Conflict, Request, Store

BASE_MODEL = "Qwen/Qwen3-0.6B"
OTHER_BASE_MODEL = "acme/tiny-test-model"
TOKENIZER_ID = "acme/tiny-tokenizer"
LONG_POLL_S = 2.0  # short, so the try_again test is quick (the server's default is 40 s)


class EngineFailure(Exception):
    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.message, self.category = message, category


Handler = Callable[[Store, Request], bytes]


def _create_model(store: Store, row: Request) -> bytes:
    return protocol.json_result(types.CreateModelResponse(model_id=row.model_id))


def _load_weights(store: Store, row: Request) -> bytes:
    req = protocol.decode_json(row.kind, row.body)
    return protocol.json_result(types.LoadWeightsResponse(path=req.path, model_id=row.model_id))


def _forward_backward(store: Store, row: Request) -> bytes:
    body = protocol.decode_forward_backward(row.body)
    outputs = [{"logprobs": np.full(len(d.tokens), -0.5, np.float32)} for d in body.data]
    weights = sum(float(d.loss_fn_inputs.get("weights", np.ones(len(d.tokens))).sum()) for d in body.data)
    return protocol.encode_forward_backward_output(outputs, {"loss:sum": 0.5 * weights})


def _optim_step(store: Store, row: Request) -> bytes:
    req = protocol.decode_json(row.kind, row.body)
    return protocol.json_result(types.OptimStepResponse(metrics={"learning_rate:mean": req.optim_params.learning_rate}))


def _save(store: Store, row: Request, kind: str, name: str, req: Any) -> Checkpoint:
    try:
        return store.add_checkpoint(
            row.owner_id, row.model_id, name, kind, f"/fake-storage/{row.model_id}/{kind}/{name}",  # type: ignore[arg-type]
            size_bytes=1234, ttl_seconds=req.ttl_seconds, overwrite=getattr(req, "overwrite", False),
            user_metadata=req.user_metadata,
        )
    except Conflict as e:
        raise EngineFailure(f"{e}; pass overwrite=True to replace it") from e


def _save_weights(store: Store, row: Request) -> bytes:
    req = protocol.decode_json(row.kind, row.body)
    checkpoint = _save(store, row, "training", req.path, req)
    return protocol.json_result(types.SaveWeightsResponse(path=checkpoint.tinker_path))


def _save_weights_for_sampler(store: Store, row: Request) -> bytes:
    req = protocol.decode_json(row.kind, row.body)
    if req.path is not None:
        return protocol.json_result({"path": _save(store, row, "sampler", req.path, req).tinker_path})
    name = protocol.ephemeral_sampler_name(req.sampling_session_seq_id, row.seq_id)
    checkpoint = _save(store, row, "sampler", name, req)
    model = store.get_model(row.owner_id, row.model_id)
    sampler = store.create_sampling_session(
        row.owner_id, model.session_id, req.sampling_session_seq_id, base_model=model.base_model,
        model_path=checkpoint.tinker_path,
    )
    return protocol.json_result({"sampling_session_id": sampler.id, "path": checkpoint.tinker_path})


def _sample(store: Store, row: Request) -> bytes:
    req = protocol.decode_json(row.kind, row.body)
    n = req.sampling_params.max_tokens or 4
    sequences = [
        protocol.SampledOutput(tokens=np.arange(n) + 10 * i, stop_reason="length", logprobs=np.full(n, -1.0))
        for i in range(req.num_samples)
    ]
    prompt_logprobs = None
    if req.prompt_logprobs:
        prompt_logprobs = np.full(req.prompt.length, -2.0, np.float32)
        prompt_logprobs[0] = np.nan
    return protocol.encode_sample_response(sequences, prompt_logprobs=prompt_logprobs)


def _delete_checkpoint(store: Store, row: Request) -> bytes:
    protocol.decode_json(row.kind, row.body)
    return protocol.json_result({})


DEFAULT_HANDLERS: dict[str, Handler] = {
    protocol.CREATE_MODEL: _create_model,
    protocol.LOAD_WEIGHTS: _load_weights,
    protocol.FORWARD: _forward_backward,
    protocol.FORWARD_BACKWARD: _forward_backward,
    protocol.OPTIM_STEP: _optim_step,
    protocol.SAVE_WEIGHTS: _save_weights,
    protocol.SAVE_WEIGHTS_FOR_SAMPLER: _save_weights_for_sampler,
    protocol.SAMPLE: _sample,
    protocol.DELETE_CHECKPOINT: _delete_checkpoint,
}


class FakeEngine:
    """Test double for the not-yet-built JAX engine (see the module docstring): claim, run a handler, report."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.worker_id = store.register_worker("fake-engine")
        self.handlers: dict[str, Handler] = dict(DEFAULT_HANDLERS)
        self.handled: list[tuple[str, str]] = []  # (kind, request_id), in the order run
        self._lock = threading.Lock()  # held while claiming and running, so paused() waits for the step in flight
        self._paused = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the fake engine did not stop"

    @contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                rows = [] if self._paused else self.store.claim(self.worker_id)
                for row in rows:
                    self._run(row)
            if not rows:
                time.sleep(0.02)

    def _run(self, row: Request) -> None:
        self.handled.append((row.kind, row.request_id))
        try:
            result = self.handlers[row.kind](self.store, row)
        except EngineFailure as e:
            self.store.fail(row.request_id, e.message, category=e.category, worker_id=self.worker_id)  # type: ignore[arg-type]
            return
        except Exception as e:  # a bug in a handler should read as a server error, not hang the test
            self.store.fail(row.request_id, f"fake engine: {e!r}", category="server", worker_id=self.worker_id)
            return
        self.store.complete(row.request_id, result, worker_id=self.worker_id)


@dataclass
class Service:
    url: str
    db_url: str
    store: Store  # the API's own store
    engine: FakeEngine

    def new_key(self, name: str = "test") -> tuple[str, str]:
        """A fresh API key (a fresh tenant): (key id, full key)."""
        row, key = auth.create_key(self.store, name)
        return row.id, key


def wait_healthy(url: str, proc: subprocess.Popen[Any], why: Callable[[], str], timeout_s: float = 120) -> None:
    """Until GET {url}/api/v1/healthz answers 200; fails with why() (e.g. the server's log) if the process exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, why()
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def api_in_thread(store: Store, config: ServerConfig) -> Iterator[str]:
    """The API on 127.0.0.1 in a uvicorn thread, on a socket bound before it starts (so the port is known and nobody
    can take it first); yields its URL, and stops it on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(create_app(store, config), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "the API server did not stop"
        sock.close()


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    db_url = f"sqlite:///{Path(tmp_path_factory.mktemp('service_api')) / 'service.db'}"
    store = Store(db_url)
    config = ServerConfig(
        base_models=[
            BaseModelSpec(BASE_MODEL, tokenizer_id=TOKENIZER_ID, max_context_length=4096),
            BaseModelSpec(OTHER_BASE_MODEL),
        ],
        long_poll_s=LONG_POLL_S,
    )
    engine = FakeEngine(Store(db_url))
    try:
        with api_in_thread(store, config) as url:
            engine.start()
            try:
                yield Service(url=url, db_url=db_url, store=store, engine=engine)
            finally:
                if engine._thread.is_alive():
                    engine.stop()
    finally:
        engine.store.close()
        store.close()


@pytest.fixture
def engine(service: Service) -> Iterator[FakeEngine]:
    """The session's fake engine, with its default handlers restored after the test."""
    yield service.engine
    service.engine.handlers = dict(DEFAULT_HANDLERS)
