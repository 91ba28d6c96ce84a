"""The persistent compilation cache the trainer and the engine keep beside their state (trainer/run/compile_cache.py): a
second process reads back what the first compiled, and $JAX_COMPILATION_CACHE_DIR, when set, wins. Each case runs in
its own process: the cache is process-wide jax configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from trainer.run import compile_cache
where = compile_cache.enable(sys.argv[1])
counts = compile_cache.Counts()
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(np.ones(8, np.float32))
print(json.dumps({"where": str(where), "built": counts.built, "hits": counts.hits, "compiled": counts.compiled}))
"""


def _run(directory: Path, **env: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(directory)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
                                            "JAX_PLATFORMS": "cpu", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_back_what_the_first_compiled(tmp_path: Path) -> None:
    cache = tmp_path / "bucket" / "_jax-compile-cache"
    first = _run(cache)
    assert first == {"where": str(cache), "built": 1, "hits": 0, "compiled": 1}
    assert len(list(cache.iterdir())) == 1
    assert _run(cache) == {"where": str(cache), "built": 1, "hits": 1, "compiled": 0}


def test_the_environment_variable_wins(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    out = _run(tmp_path / "ours", JAX_COMPILATION_CACHE_DIR=str(theirs),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert out["where"] == str(theirs) and not (tmp_path / "ours").exists()
    assert len(list(theirs.iterdir())) == 1
