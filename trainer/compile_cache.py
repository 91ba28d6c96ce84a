"""JAX's persistent compilation cache in a directory that outlives the process (a bucket mounted through GCS FUSE):
a process restarted after a preemption or a crash loads the programs its predecessor compiled instead of compiling
them again, which on a real model and slice is minutes. Every program is cached (no minimum compile time): a small
one is read back faster than it compiles, and reading back never changes what it computes."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Final

# A directory name no owner, model or step folder takes (ids are hex, steps are numbers).
DIR_NAME: Final = "_jax-compile-cache"
_HIT_EVENT: Final = "/jax/compilation_cache/cache_hits"
_COMPILE_EVENT: Final = "/jax/core/compile/backend_compile_duration"


def enable(directory: str | Path) -> Path:
    """Cache every compiled program of this process in `directory` (made if missing), unless
    $JAX_COMPILATION_CACHE_DIR names one already (jax reads it itself). Call before the first compile."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


class Counts:
    """Programs built (compiled, or read back from the persistent cache) and read back, since this object was made:
    process-wide jax monitoring events (jax's backend-compile event spans the cache lookup, so it counts both)."""

    _lock = threading.Lock()
    _hits = 0
    _compiles = 0
    _installed = False

    def __init__(self) -> None:
        Counts._install()
        self.hits0, self.compiles0 = Counts._hits, Counts._compiles

    @property
    def hits(self) -> int:
        return Counts._hits - self.hits0

    @property
    def built(self) -> int:
        return Counts._compiles - self.compiles0

    @property
    def compiled(self) -> int:
        """Built and not read back: compiled here."""
        return self.built - self.hits

    @classmethod
    def _install(cls) -> None:
        import jax.monitoring

        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_event(name: str, **_kw: object) -> None:
            if name == _HIT_EVENT:
                cls._hits += 1

        def on_duration(name: str, _secs: float, **_kw: object) -> None:
            if name == _COMPILE_EVENT:
                cls._compiles += 1

        jax.monitoring.register_event_listener(on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)
