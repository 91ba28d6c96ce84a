"""Quiet by default (issue 17): a CPU run shows the trainer's own lines only, no libtpu start-up errors from a TPU
backend it will never use and no gloo connection chatter from the local launcher's children; a mesh that does not
fit the CPU devices is one error line with the fix, exit 2, before JAX starts."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.run import cli

ROOT = Path(__file__).resolve().parents[2]

# What libtpu prints when JAX tries the TPU backend on a machine without one, and gloo's per-group connection line.
LIBTPU_NOISE = re.compile(
    r"libtpu|TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|Failed to find host bounds|InitGoogle|"
    r"Source Location Trace|Unable to initialize backend|^[EWIF]\d{4} "
)
GLOO_NOISE = re.compile(r"Gloo|is connected to \d+ peer ranks|connected peer ranks")

# Small enough for a few seconds of compile on 2 cores (one layer: the compile is most of each run, and the noise
# checked here comes from the backend and the launcher, not the model); mesh axes come per test.
TINY = ["--set=steps=1", "--set=model.n_layers=1", "--set=rl.prompts_per_step=2", "--set=rl.group_size=4",
        "--set=rl.mu_iterations=1", "--set=sampling.max_new_tokens=4", "--set=checkpoint.every=0",
        "--set=progress=false"]

needs_cpu_only_host = pytest.mark.skipif(
    bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.path.exists("/dev/nvidia0")),
    reason="checks the CPU path; this machine has an accelerator",
)


def _env(**extra: str) -> dict[str, str]:
    """A user's shell: no platform chosen, no CPU device count, no verbose switch."""
    drop = ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "TRAINER_CPU_DEVICES", "TRAINER_VERBOSE",
            "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "COORDINATOR_ADDRESS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


def _train(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer", *args, "--run-dir", str(tmp_path / "run")],
                          cwd=tmp_path, env=_env(**env), capture_output=True, text=True, timeout=120)


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if LIBTPU_NOISE.search(line) or GLOO_NOISE.search(line)]


@needs_cpu_only_host
@pytest.mark.slow
def test_plain_cpu_run_has_no_libtpu_noise(tmp_path: Path) -> None:
    """`gke-tpu-rl train` on a laptop or CI box: libtpu is installed (jax[tpu]) but must not be started."""
    r = _train(tmp_path, *TINY, "--set=mesh.slices=1", "--set=mesh.fsdp=1", "--set=mesh.tensor=1")
    assert r.returncode == 0, r.stderr
    assert _noise(r.stderr) == [] and _noise(r.stdout) == []
    assert "finished 1 steps" in r.stdout


@needs_cpu_only_host
@pytest.mark.slow
def test_local_processes_run_has_no_noise(tmp_path: Path) -> None:
    """`--local-processes`: the parent starts no backend, the children use CPU + gloo without its chatter."""
    r = _train(tmp_path, "--local-processes", "2", "--devices-per-process", "2", *TINY,
               "--set=mesh.slices=2", "--set=mesh.fsdp=2", "--set=mesh.tensor=1")
    assert r.returncode == 0, r.stderr
    assert _noise(r.stderr) == [] and _noise(r.stdout) == []
    assert "finished 1 steps" in r.stdout


@needs_cpu_only_host
def test_mesh_too_big_for_the_cpu_devices_is_one_line_with_the_fix(tmp_path: Path) -> None:
    """The embedded demo's 2x2x2 mesh on a plain single process (1 CPU device)."""
    r = _train(tmp_path, "--set=steps=1")
    assert r.returncode == cli.EXIT_CONFIG
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("error: ") and "slices=2 x fsdp=2 x tensor=2" in line and "1 CPU device" in line
    assert "--local-processes 2 --devices-per-process 4" in line
    assert "--set mesh.slices=1 --set mesh.fsdp=1 --set mesh.tensor=1" in line
    assert r.stdout == ""


_FAKE_GLOO = textwrap.dedent("""
    import os, sys, time
    from trainer.run.launch import quiet_native_stdout
    quiet_native_stdout()
    # Two gloo groups connecting on two threads: their pieces interleave within one stdio buffer.
    os.write(1, b"[Gloo] Rank [Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks "
                b"is : 3\\n3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\\n")
    os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n")
    # A split at another piece (seen in a real 2 x 2 run): the tail of a line starts with the peer count.
    os.write(1, b"[Gloo] Rank 1 is connected to [Gloo] Rank 0 is connected to 3\\n3 peer ranks. Expected number of "
                b"connected peer ranks is : 3\\n")
    os.write(1, b"F0000 a real native message\\n")
    print("python line", flush=True)
    time.sleep(0.3)
""")


@pytest.mark.parametrize("verbose", [False, True])
def test_child_stdout_filter_drops_interleaved_gloo_lines_only(tmp_path: Path, verbose: bool) -> None:
    env = {"TRAINER_VERBOSE": "1"} if verbose else {}
    r = subprocess.run([sys.executable, "-c", _FAKE_GLOO], cwd=tmp_path, env=_env(**env), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "F0000 a real native message" in lines and "python line" in lines
    gloo = [line for line in lines if GLOO_NOISE.search(line)]
    assert (len(gloo) == 5) if verbose else (gloo == [])
