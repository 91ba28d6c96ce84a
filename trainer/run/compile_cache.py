"""JAX's persistent compilation cache in a directory that outlives the process (a bucket mounted through GCS FUSE):
a process restarted after a preemption or a crash loads the programs its predecessor compiled instead of compiling
them again, which on a real model and slice is minutes. Every program is cached (no minimum compile time): a small
one is read back faster than it compiles, and reading back never changes what it computes.

Only process 0 of a group writes entries (jax's compiler._cache_write); every process reads them, as every host's
key is the same on TPU. On CPU (`--local-processes`) jax keys a program by the process's own topology, so there only
process 0 reads them back (the tests re-key them: tests/hosts_share_compiles/sitecustomize.py). A damaged entry is
never replaced (jax skips a key whose file exists) and costs a warning and a compile at each start: delete the folder
to reset it, which is always safe. Nothing evicts entries: each new jax/libtpu version adds its own set."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

# A directory name no owner, model or step folder takes (ids are hex, steps are numbers).
DIR_NAME: Final = "_jax-compile-cache"
_HIT_EVENT: Final = "/jax/compilation_cache/cache_hits"
_COMPILE_EVENT: Final = "/jax/core/compile/backend_compile_duration"


def enable(directory: str | Path) -> Path | None:
    """Cache every compiled program of this process in `directory`, unless $JAX_COMPILATION_CACHE_DIR names one
    already (jax reads it itself). Call before the first compile. A cache that cannot be made (the bucket briefly
    unwritable) is only logged: the process compiles as it would without one, rather than fail its job over it (jax
    itself makes the folder, and a write or read error there only warns)."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("compile cache: %s is not usable (%s); compiling without it", path, err)
        return None
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

        def on_event(event: str, **_kw: str | int) -> None:
            if event == _HIT_EVENT:
                cls._hits += 1

        def on_duration(event: str, duration_secs: float, **_kw: str | int) -> None:
            if event == _COMPILE_EVENT:
                cls._compiles += 1

        jax.monitoring.register_event_listener(on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)
