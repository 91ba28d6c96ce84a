"""A peer slow to come back after a preemption costs one JobSet restart, not the run: a process group that does not
form within the start-up timeout exits 42 (restart me) with one line on stderr. Left to itself jax 0.10.2 aborts
from native code after its own deadline (SIGABRT: a C++ stack trace, exit 134)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import pytest
import yaml

from trainer.run import cli
from trainer.run import distributed as D
from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
POD = D.cpu_slice_env("127.0.0.1:1", 2, 1, 0)  # process 1 of 2; 0 CPU devices: no CPU simulation (jax is mocked)


@pytest.mark.parametrize("slice_index", [0, 1], ids=["coordinator-waits-for-peer", "peer-waits-for-coordinator"])
def test_a_process_group_that_never_forms_exits_42_with_one_line(tmp_path: Path, slice_index: int) -> None:
    # Process 0 runs the coordination service and waits for the peer; process 1 dials a coordinator that never
    # comes up (jax retries a refused connection until its deadline). Either way the other process never starts.
    env = {**os.environ, **D.cpu_slice_env(f"127.0.0.1:{free_port()}", 2, slice_index, 4),
           D.ENV_INIT_TIMEOUT: "2", "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trainer", "--run-dir", str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    text = done.stdout + done.stderr
    assert done.returncode == cli.EXIT_TRANSIENT, text[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith("error:") and f"within 2 s ({D.ENV_INIT_TIMEOUT})" in errors[0], errors
    assert f"process {slice_index} of 2" in errors[0]
    assert "Traceback" not in text and "Check failure" not in text  # no Python traceback, no native abort
    assert time.monotonic() - start < 30
    assert not (tmp_path / "run").exists()  # nothing ran


@pytest.mark.parametrize("value", ["soon", "0", "-5", "1.5"])
def test_a_bad_start_up_timeout_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_train_dict: dict,
    value: str,
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**tiny_train_dict, "mesh": {"slices": 1, "fsdp": 1, "tensor": 1}}))
    monkeypatch.setenv(D.ENV_INIT_TIMEOUT, value)
    assert cli.main(["--config", str(config)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{D.ENV_INIT_TIMEOUT}={value!r}" in err and "Traceback" not in err


def _record_initialize(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    return calls


def test_the_start_up_timeout_reaches_jax_behind_the_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record_initialize(monkeypatch)
    assert D.initialize_from_env(POD).init_timeout_s == D.DEFAULT_INIT_TIMEOUT_S == 900
    D.initialize_from_env({**POD, D.ENV_INIT_TIMEOUT: "1"}, exit_on_timeout=cli.EXIT_TRANSIENT)
    # Without the watchdog jax's deadline is the timeout; with it, jax's native abort is only a later backstop.
    assert [c["initialization_timeout"] for c in calls] == [900, 1 + D._JAX_BACKSTOP_S]
    assert (calls[0]["num_processes"], calls[0]["process_id"]) == (2, 1)
    # Once the group has formed the watchdog is gone (had it fired it would have ended this test process).
    for t in threading.enumerate():
        if t.name == "jax-init-watchdog":
            t.join(timeout=2)
            assert not t.is_alive()


def test_a_transient_runtime_error_from_initialize_exits_42(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_train_dict: dict
) -> None:
    """If jax raises instead of aborting (a status it returns to Python), the same rule as in the training loop
    applies: a cluster status restarts, anything else is a bug."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_train_dict))

    def unavailable(**kwargs: object) -> None:
        raise jax.errors.JaxRuntimeError("UNAVAILABLE: failed to connect to all addresses\n\nRPC: RegisterTask")

    monkeypatch.setattr(jax.distributed, "initialize", unavailable)
    for name, value in POD.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["--config", str(config)]) == cli.EXIT_TRANSIENT
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "UNAVAILABLE: failed to connect to all addresses RPC: RegisterTask" in lines[0]

    def port_taken(**kwargs: object) -> None:  # observed: process 0 when the coordinator port is in use
        raise jax.errors.JaxRuntimeError("UNKNOWN: Failed to start RPC server")

    monkeypatch.setattr(jax.distributed, "initialize", port_taken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Failed to start RPC server"):
        cli.main(["--config", str(config)])
