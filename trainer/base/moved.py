"""Where trainer/'s flat modules went when trainer/ was put in floors (2026-11-29), and the import hook that keeps the
old names working. A user's own task or reward module written against them (docs/own-tasks.md said
`from trainer.tasks import Example`) would otherwise fail the trainer's pre-flight with exit 2 after a kit upgrade,
and the rendered failure policy ends such a JobSet for good. Each old name imports the new module, with a
FutureWarning (shown by default: it is meant for the users who wrote the import) naming where it is now.
`gke-tpu-rl plan` reads the same table (infra/checks/code_refs.py). Remove a name once no release documents it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# Old module (under trainer.) -> its module now (under trainer.). `trainer.model` and `trainer.fit` are packages now,
# so those two names cannot point elsewhere: their old contents are in trainer.model.decoder and trainer.fit.preflight.
MOVED: dict[str, str] = {
    "config": "base.config", "presets": "base.presets", "user_code": "base.user_code", "yamlfile": "base.yamlfile",
    "decode_kernel": "model.decode_kernel", "hf": "model.hf", "lora": "model.lora", "sharding": "model.sharding",
    "tokenizer": "model.tokenizer",
    "batch": "rl.batch", "checkpoint": "rl.checkpoint", "losses": "rl.losses", "metrics": "rl.metrics",
    "optim": "rl.optim", "rewards": "rl.rewards", "sampler": "rl.sampler", "step": "rl.step",
    "task_data": "rl.task_data", "tasks": "rl.tasks", "train": "rl.train",
    "cli": "run.cli", "compile_cache": "run.compile_cache", "distributed": "run.distributed", "launch": "run.launch",
    "ray_train": "run.ray_train",
    "fit_estimate": "fit.estimate", "flops": "fit.flops", "fit_loops": "fit.loops", "fit_phases": "fit.phases",
    "fit_report": "fit.report", "fit_search": "fit.search",
}
PREFIX = "trainer."


def new_name(module: str) -> str | None:
    """The module an old `trainer.X` name now is (`trainer.tasks` -> `trainer.rl.tasks`), or None if it did not move."""
    if not module.startswith(PREFIX):
        return None
    moved = MOVED.get(module.removeprefix(PREFIX))
    return None if moved is None else PREFIX + moved


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the module it moved to, so both names are the same module object."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if new_name(fullname) else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None  # find_spec returned a spec for moved names only
        warnings.warn(f"{spec.name} moved to {new}: import it from there (the old name goes in a later release)",
                      FutureWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module it moved to is already executed


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
