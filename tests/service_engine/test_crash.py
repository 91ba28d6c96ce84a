"""SIGKILL of `serve --config` (API and engine in one process) with requests queued and in flight, then a restart on
the same database and storage: every accepted request completes, each optim_step applied once (the model's step
counts them), and the session, its checkpoints and its sampler adapter saved before the kill all work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.service_api.conftest import free_port, wait_healthy
from tests.service_engine.service import TINY_MODEL
from trainer.service.store import Store

ROOT = Path(__file__).resolve().parents[2]


def _start(work: Path, port: int, log_name: str) -> subprocess.Popen[bytes]:
    log = (work / log_name).open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.service", "serve", "--config", str(work / "service.yaml"), "--db",
         str(work / "service.db"), "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}", proc, lambda: (work / log_name).read_text()[-3000:], 120)
    return proc


def _data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (12, 20, 7):
        t = rng.integers(1, 128, n + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                               loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * n}))
    return out


def test_sigkill_with_requests_in_flight_loses_nothing(tmp_path: Path) -> None:
    (tmp_path / "service.yaml").write_text(json.dumps({
        "model": TINY_MODEL, "lora": {"rank": 8, "alpha": 32, "slots": 4},
        "service": {"base_model": "tiny/random", "min_bucket": 16, "storage_dir": str(tmp_path / "ckpt"),
                    "warmup": False},
    }))
    key = subprocess.run([sys.executable, "-m", "trainer.service", "keys", "create", "t", "--db",
                          str(tmp_path / "service.db")], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    port = free_port()
    proc = _start(tmp_path, port, "first.log")
    url = f"http://127.0.0.1:{port}"
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="tiny/random", rank=4, seed=2).result()
    data = _data(0)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("before-kill").result().path
    sampler_path = tc.save_weights_for_sampler("sampler-before-kill").result().path
    loss_before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    sampler = sc.create_sampling_client(model_path=sampler_path).result()
    prompt = types.ModelInput.from_ints([3, 1, 4, 1, 5])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    tokens_before = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens

    # Accepted, not yet answered: a train loop's worth of requests, plus samples from the saved adapter.
    pending = []
    for i in range(6):
        pending.append(("forward_backward", tc.forward_backward(_data(i + 1), "cross_entropy")))
        pending.append(("optim_step", tc.optim_step(types.AdamParams(learning_rate=1e-2))))
    pending += [("sample", sampler.sample(prompt, 1, greedy)) for _ in range(3)]
    time.sleep(0.3)  # the API has taken them (each call returned a promise); the engine is working through them
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)

    proc = _start(tmp_path, port, "second.log")  # same port, database and storage
    try:
        for kind, future in pending:
            result = future.result(timeout=180)  # none is lost: a failure would raise RequestFailedError here
            if kind == "sample":
                assert result.sequences[0].tokens == tokens_before  # the saved adapter serves after the restart
        # Each optim_step took effect exactly once: 2 before the kill, 6 accepted around it.
        saved = Store(f"sqlite:///{tmp_path / 'service.db'}").model_state(tc.model_id)
        assert saved is not None and saved.step == 8

        # The session and what it saved are all there: the checkpoint continues where it was.
        restored = sc.create_training_client_from_state_with_optimizer(state).result()
        assert restored.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(loss_before,
                                                                                                    rel=1e-6)
        rest = tinker.RestClient(base_url=url, api_key=key)
        paths = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert {state, sampler_path} <= paths
        sc.close("success").result(timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
