"""The engine on a multi-host slice, as local processes joined by jax.distributed (the trainer's contract): process 0
serves and runs the engine, process 1 follows its device ops. The same requests give the same numbers as one process
with the same 4 devices, and SIGTERM stops the whole group cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.service_api.conftest import free_port, wait_healthy
from tests.service_engine.service import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]


def _serve(tmp: Path, name: str, processes: int, devices: int) -> tuple[subprocess.Popen[str], str, str, Path]:
    work = tmp / name
    work.mkdir()
    config = work / "service.yaml"
    config.write_text(json.dumps({
        "model": TINY_MODEL, "lora": {"rank": 8, "alpha": 32, "slots": 4},
        "service": {"base_model": "tiny/random", "min_bucket": 16, "storage_dir": str(work / "ckpt"),
                    "warmup": False},  # the as-deployed service warms up its 4 processes (tests/deployed)
    }))
    db = work / "service.db"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    key = subprocess.run([sys.executable, "-m", "trainer.service", "keys", "create", "t", "--db", str(db)], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    port = free_port()
    log = work / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.service", "serve", "--config", str(config), "--db", str(db), "--port",
         str(port), "--local-processes", str(processes), "--devices-per-process", str(devices), "--log-level",
         "info"], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, lambda: log.read_text()[-3000:], 180)
    return proc, url, key, log


def _workload(url: str, key: str) -> dict[str, Any]:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="tiny/random", rank=4, seed=1).result()
    rng = np.random.default_rng(0)
    data = []
    for n in (10, 17, 5, 12):
        t = rng.integers(1, 128, n + 1).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                                loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * n}))
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2, grad_clip_norm=5.0)).result()
    saved = tc.save_state("end").result().path
    restored = sc.create_training_client_from_state_with_optimizer(saved).result()
    again = restored.forward(data, "cross_entropy").result().metrics["loss:sum"]
    sampler = tc.save_weights_and_get_sampling_client()
    tokens = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                            types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0].tokens
    sc.close("success").result(timeout=30)
    return {"losses": losses, "restored": again, "tokens": tokens}


def _stop(proc: subprocess.Popen[str], log: Path) -> str:
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher and its children, as `kubectl delete` would signal each pod
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return log.read_text()


def test_two_processes_compute_what_one_does_and_stop_cleanly(tmp_path: Path) -> None:
    results = {}
    for name, processes, devices in (("one", 1, 4), ("two", 2, 2)):
        proc, url, key, log = _serve(tmp_path, name, processes, devices)
        try:
            results[name] = _workload(url, key)
        finally:
            out = _stop(proc, log)
        assert "Check failure" not in out and "Traceback" not in out, out[-4000:]
        if processes == 2:
            assert "engine follower: stop" in out and "engine: followers stopped" in out, out[-4000:]
    one, two = results["one"], results["two"]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert two["losses"][-1] < two["losses"][0]
    assert two["restored"] == pytest.approx(one["restored"], rel=1e-5)
    assert two["tokens"] == one["tokens"]
