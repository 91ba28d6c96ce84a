"""On PYTHONPATH for the processes the tests start (tests/conftest.py) and for the as-deployed harness's slice pods
(tests/deployed/cluster.py): CPU processes standing in for a slice's hosts read the programs process 0 compiled, as
the hosts of a TPU slice do.

jax writes persistent-cache entries from process 0 only, and keys them by, among other things, the topology of the
program's devices. On TPU that is the slice's, the same on every host, so every host reads process 0's entries back
(what `checkpoint.compile_cache` and `service.compile_cache` rely on after a preemption). On CPU the topology's
fingerprint differs per process, so every process but 0 compiled every program at every start: about half the CPU of
a restarted local 2-process run. Here a CPU program's key names its devices (global id and process) in place of that
fingerprint: the same on every process, and still different for another layout of processes and devices. What the
fingerprint held and this key drops: the process's local device count (a program over some devices, one device say,
is shared by runs with more or fewer devices: the same compile inputs but the intra-op thread count, which changes no
result) and the host's CPU features (an entry never travels to another machine: the cache is per test session, and
XLA refuses an executable built for features the host lacks; jax then warns and compiles).
Checked: a 2-process run whose process 1 reads process 0's programs gives the same metrics, bit for bit, as one
compiled from scratch.

jax's cache-key module is patched when it is first imported (a finder on sys.meta_path), so a process that never
imports jax pays nothing. `jax._src.cache_key._hash_accelerator_config` is private: jax 0.10.2's. If it is renamed,
the patch refuses to load rather than silently doing nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

MODULE = "jax._src.cache_key"


def _patch(module: ModuleType) -> None:
    original = getattr(module, "_hash_accelerator_config", None)
    if original is None:
        raise RuntimeError(f"{__file__}: {MODULE} has no _hash_accelerator_config any more (jax upgraded?): update "
                           "this patch or drop it from the tests' PYTHONPATH")

    def _hash_accelerator_config(hash_obj: Any, accelerators: Any) -> None:
        devices = list(accelerators.flat)
        if devices and all(d.platform == "cpu" for d in devices):
            hash_obj.update(repr([(d.id, d.process_index) for d in devices]).encode())
            return
        original(hash_obj, accelerators)

    module._hash_accelerator_config = _hash_accelerator_config


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchOnImport())
