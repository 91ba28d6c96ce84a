"""A preemption as the stack runs the service: the API and the engine as separate processes with the commands their
pods run (`serve --base-model`, `engine --config`) on a real PostgreSQL, a client mid-training, the engine killed with
SIGKILL while a forward_backward's gradient waits in its memory, then started again. The API keeps accepting and
answers paused_capacity meanwhile; the client's loss curve goes on exactly as an uninterrupted twin's, with every
request done once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.service.conftest import pg_database
from tests.service_api.conftest import free_port, wait_healthy
from tests.service_engine.service import TINY_MODEL
from trainer.service.store import Store

ROOT = Path(__file__).resolve().parents[2]
BASE = "tiny/random"
STEPS = 6
KILL_AFTER = 2  # the engine dies once step 2's forward_backward is done and before its optim_step is sent


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    with pg_database(pg_server_url) as url:
        yield url


def _data(step: int) -> list[types.Datum]:
    rng = np.random.default_rng(step)
    out = []
    for n in (9, 17):
        t = rng.integers(1, 128, n + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                               loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * n}))
    return out


def _engine(work: Path, db: str, log_name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.service", "engine", "--config", str(work / "engine.yaml"), "--db", db,
         "--log-level", "info"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=(work / log_name).open("w"),
        stderr=subprocess.STDOUT)


def _train(tc: Any, steps: int, *, pause: threading.Event | None = None, go: threading.Event | None = None,
           done_at: list[float] | None = None) -> list[float]:
    """A plain SFT loop: per step a forward_backward (its loss is the curve) and an optim_step."""
    losses = []
    adam = types.AdamParams(learning_rate=2e-2)
    for step in range(steps):
        losses.append(tc.forward_backward(_data(step), "cross_entropy").result().metrics["loss:sum"])
        if done_at is not None:
            done_at.append(time.monotonic())
        if step == KILL_AFTER and pause is not None and go is not None:
            pause.set()
            assert go.wait(120)
        tc.optim_step(adam).result()
        if done_at is not None:
            done_at.append(time.monotonic())
    return losses


def test_engine_sigkill_mid_training_loses_no_request_and_no_step(tmp_path: Path, pg_url: str) -> None:
    (tmp_path / "engine.yaml").write_text(json.dumps({
        "model": TINY_MODEL, "lora": {"rank": 8, "alpha": 32, "slots": 4},
        "service": {"base_model": BASE, "min_bucket": 16, "storage_dir": str(tmp_path / "bucket"), "warmup": False},
    }))
    key = subprocess.run([sys.executable, "-m", "trainer.service", "keys", "create", "t", "--db", pg_url], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    port = free_port()
    api_log = tmp_path / "api.log"
    api = subprocess.Popen(
        [sys.executable, "-m", "trainer.service", "serve", "--base-model", BASE, "--db", pg_url, "--port", str(port),
         "--long-poll-s", "5", "--log-level", "warning"],
        cwd=ROOT, stdout=api_log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    engine = _engine(tmp_path, pg_url, "engine-1.log")
    try:
        wait_healthy(url, api, lambda: api_log.read_text()[-3000:], 60)
        sc = tinker.ServiceClient(base_url=url, api_key=key)
        twin = sc.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
        want = _train(twin, STEPS)

        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
        seen: list[tuple[str, str | None]] = []
        observer = tc._queue_state_logger  # the SDK's own observer of the queue_state it parsed from try_again
        real = observer.on_queue_state_change

        def record(state: Any, reason: str | None) -> None:
            seen.append((str(state.value), reason))
            real(state, reason)

        observer.on_queue_state_change = record  # type: ignore[method-assign]
        pause, go, done_at, got = threading.Event(), threading.Event(), [], []
        loop = threading.Thread(target=lambda: got.extend(_train(tc, STEPS, pause=pause, go=go, done_at=done_at)))
        loop.start()
        assert pause.wait(120)
        engine.send_signal(signal.SIGKILL)  # a forward_backward's gradient is in its memory, nowhere else yet
        engine.wait(30)
        go.set()  # the optim_step is accepted while no engine runs
        time.sleep(16)  # the dead engine's heartbeat goes stale (10 s); then the API answers paused_capacity
        completed_before = len(done_at)
        restarted = time.monotonic()
        engine = _engine(tmp_path, pg_url, "engine-2.log")
        loop.join(300)
        assert not loop.is_alive(), (tmp_path / "engine-2.log").read_text()[-3000:]
        resumed_s = done_at[completed_before] - restarted
        print(f"engine restart to the next completed request: {resumed_s:.1f} s; queue states seen: {seen[:3]}")

        assert any(state == "paused_capacity" and reason and "no engine is running" in reason
                   for state, reason in seen), seen
        np.testing.assert_allclose(got, want, rtol=1e-5)  # the curve goes on from the step it had reached
        store = Store(pg_url)
        try:
            # Each of the STEPS optim_steps applied once; the forward_backward replayed after the restart is the one
            # whose gradient died with the engine.
            assert store.model_state(tc.model_id).step == STEPS  # type: ignore[union-attr]
        finally:
            store.close()
        assert "replayed 1 forward_backward" in (tmp_path / "engine-2.log").read_text()
        # One snapshot per model is kept (each replaces the last), under the prefix the stack expires old versions of.
        deadline = time.monotonic() + 10  # the replaced one is deleted just after the commit
        while len(snapshots := [p.parent.name for p in (tmp_path / "bucket" / "state").glob("*/*/seq*")]) > 2:
            assert time.monotonic() < deadline, snapshots
            time.sleep(0.1)
        assert len(set(snapshots)) == 2, snapshots
        sc.close("success").result(timeout=30)
    finally:
        for proc in (engine, api):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
