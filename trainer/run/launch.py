"""Run the trainer as N local OS processes joined by jax.distributed, each with a TPU pod's environment.

Process 0 keeps the terminal (progress bar); the others' output is forwarded with a "[pN]" prefix. If one
process fails the others are stopped, and the first failure's exit code is returned.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from trainer.run import distributed as D

GRACE_S = 15.0  # after a failure/signal: time to save and exit before SIGKILL


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on `host` ("" = every interface, for peers on other machines)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_env(
    base: Mapping[str, str], index: int, n_processes: int, devices_per_process: int, port: int
) -> dict[str, str]:
    """One slice per process, like a multislice JobSet with one host per slice."""
    env = dict(base)
    env.update(D.cpu_slice_env(f"127.0.0.1:{port}", n_processes, index, devices_per_process), JAX_PLATFORMS="cpu")
    # The children must import this same trainer package even when it is not installed.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH", "")) if p)
    return env


ENV_VERBOSE = "TRAINER_VERBOSE"  # 1: keep the native chatter (gloo's connection lines) the children drop

# Gloo prints a connection line per collective group, on stdout, from C++: noise, not progress. It is written in
# pieces, and groups connect on several threads at once, so the pieces of two lines can interleave
# ("[Gloo] Rank [Gloo] Rank 2 is connected ...\n3 is connected ...\n"): a line is noise when it is made of these
# pieces only, so a line with anything else in it (a real error) is always kept.
_GLOO_WORDS = (rb"\[Gloo\] Rank", rb"is connected to", rb"peer ranks\.",
               rb"Expected number of connected peer ranks is :")
_GLOO_WORD = re.compile(b"|".join(_GLOO_WORDS))
_GLOO_PIECES = re.compile(b"|".join((*_GLOO_WORDS, rb"\d+", rb"\s+")))


def is_gloo_noise(line: bytes) -> bool:
    # Any fragment of a connection line ("3 peer ranks. Expected ... is : 3" too), and nothing but such fragments.
    return bool(_GLOO_WORD.search(line)) and not _GLOO_PIECES.sub(b"", line)


def _forward(stream: IO[bytes], prefix: str, out: IO[str]) -> None:
    for raw in iter(stream.readline, b""):
        out.write(prefix + raw.decode(errors="replace"))
        out.flush()


def quiet_native_stdout() -> None:
    """In a child: send fd 1 (native code's stdout) through a filter that drops gloo's connection lines,
    while Python's sys.stdout keeps the original stream (so a terminal still shows the live progress bar).
    TRAINER_VERBOSE=1 leaves fd 1 alone."""
    if os.environ.get(ENV_VERBOSE, "") not in ("", "0"):
        return
    sys.stdout.flush()
    original_fd = os.dup(1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.close(write_fd)
    sys.stdout = open(original_fd, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives for the process)

    def pump() -> None:
        with open(read_fd, "rb", closefd=True) as native:
            for line in iter(native.readline, b""):
                if not is_gloo_noise(line):
                    os.write(original_fd, line)

    threading.Thread(target=pump, daemon=True, name="native-stdout-filter").start()


def _stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(n_processes: int, devices_per_process: int, argv: Sequence[str], module: str = "trainer") -> int:
    """Spawn `python -m MODULE ARGV` n times; returns 0 or the first non-zero exit code."""
    port = free_port()
    cmd = [sys.executable, "-m", module, *argv]
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    for i in range(n_processes):
        env = child_env(os.environ, i, n_processes, devices_per_process, port)
        if i == 0:
            proc = subprocess.Popen(cmd, env=env)  # keeps the terminal: live progress bar
        else:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            t = threading.Thread(target=_forward, args=(proc.stdout, f"[p{i}] ", sys.stdout), daemon=True)
            t.start()
            threads.append(t)
        procs.append(proc)

    signalled = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal signalled
        signalled = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # children save a checkpoint and exit

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed and not signalled:
                rc = failed[0].returncode
                print(f"launch: process {procs.index(failed[0])} exited with {rc}; stopping the others",
                      file=sys.stderr)
                _stop_all(procs)
                break
            time.sleep(0.2)
    finally:
        # Once stopping, further signals (the rest of a Ctrl-C burst) stay absorbed until this process exits.
        if not signalled:
            for s, h in previous.items():
                signal.signal(s, h)
    for t in threads:
        t.join(timeout=5)
    if rc == 0:
        rc = next((p.returncode for p in procs if p.returncode != 0), 0)
    # A child killed by signal n reports -n; exit as a shell would (128 + n), never as 256 - n.
    return 128 - rc if rc < 0 else rc
