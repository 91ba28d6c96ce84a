"""trainer.code's references: the trainer config's MODULE:NAME tasks and rewards, checked without importing the user's
code (its dependencies need not be installed where `pulumi` runs): the module's file must exist in the folder
(infra/base/user_code.py) and define the name at top level. The trainer's preflight imports and tries them in the image
(trainer/rl/task_data.py try_task).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from envspec.config import NAMESPACE, ConfigError
from envspec.repo import REPO_ROOT
from infra.base.pod_config import env_job
from infra.base.user_code import folder
from trainer.base.moved import new_name

if TYPE_CHECKING:
    from envspec.config import EnvironmentSpec
    from trainer.base.config import TrainConfig


def references(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(config key, MODULE:NAME) of every user object the trainer config names."""
    found = [("task.name", cfg.task.name)] if ":" in cfg.task.name else []
    found += [(f"rewards[{i}]", r) for i, r in enumerate(cfg.rewards or []) if ":" in r]
    return found


def _module_file(root: Path, module: str) -> Path | None:
    # A project may keep its packages under src/ (the src layout); a plain folder holds them at its top.
    rel = Path(*module.split("."))
    for base in (root, root / "src"):
        for candidate in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    # Statements that run at import: the module's own, and those inside its if/try/with blocks.
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.With | ast.Try):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                out.extend(_top_level(block))
    return out


def _defines(tree: ast.Module, name: str) -> bool | None:
    """Whether the module binds `name` at import; None when that cannot be told without running it (a star
    import, a module __getattr__)."""
    unknown = False
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
            unknown |= node.name == "__getattr__"
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    unknown = True
                elif (alias.asname or alias.name.split(".")[0]) == name:
                    return True
    return None if unknown else False


def check_references(spec: EnvironmentSpec, cfg: TrainConfig) -> list[str]:
    """Problems with the trainer config's MODULE:NAME references, each naming the key: empty when all resolve."""
    from trainer.base.user_code import parse_ref

    root, problems = folder(spec), []
    for key, ref in references(cfg):
        try:
            module, name = parse_ref(ref)
        except ValueError as err:
            problems.append(f"{key}: {err}")
            continue
        # The kit's own modules are in the image too (trainer.rl.rewards:gsm8k_answer is a valid reference), under
        # their names of before the floors as well (trainer/base/moved.py).
        module = new_name(module) or module
        homes = [REPO_ROOT] if module.split(".")[0] == "trainer" else ([root] if root else [])
        if not homes:
            problems.append(f"{key}: {ref!r} names your own code, but trainer.code is not set; set it to the folder "
                            "of this repository that holds module " + repr(module))
            continue
        path = next((p for p in (_module_file(h, module) for h in homes) if p is not None), None)
        if path is None:
            problems.append(f"{key}: {ref!r}: no module {module!r} in {_shown(homes[0]) or '.'} "
                            f"(looked for {module.replace('.', '/')}.py or its __init__.py, also under src/)")
            continue
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as err:
            problems.append(f"{key}: {ref!r}: {_shown(path)} line {err.lineno}: {err.msg}")
            continue
        if _defines(tree, name) is False:
            problems.append(f"{key}: {ref!r}: {_shown(path)} defines no {name!r} at top level")
        problems += [f"{key}: {ref!r}: {problem}" for problem in _kit_imports(tree, path)]
    return problems


def _shown(path: Path) -> Path:
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


def _kit_imports(tree: ast.Module, path: Path) -> list[str]:
    """The imports of the kit's own modules (trainer.*) in a module the config names that the image would not have:
    a user's task written against a name the kit dropped fails the trainer's pre-flight with exit 2, which the
    rendered failure policy makes final. Names that moved still import (trainer/base/moved.py)."""
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for module in names:
            if module.split(".")[0] != "trainer" or new_name(module) or _module_file(REPO_ROOT, module):
                continue
            problems.append(f"{_shown(path)} line {node.lineno} imports {module!r}, which the kit "
                            "does not have (its modules: docs/architecture.md, the trainer's floors)")
    return problems


def check(spec: EnvironmentSpec) -> None:
    """The trainer config's MODULE:NAME references resolve in trainer.code; raises ConfigError naming each key."""
    if not spec.trainer.enabled:
        return
    job = env_job(spec)
    problems = check_references(spec, job.cfg)
    if problems:
        where = spec.trainer.config or "the demo config"
        raise ConfigError(f"{NAMESPACE}:trainer: the trainer config ({where}, with trainer.args) names code the image "
                          "would not have:\n  " + "\n  ".join(problems))
