"""Data flows one way: config -> envspec (the typed spec, the TPU catalog) -> components (infra/, workloads/) ->
objects, and each fact lives on the lowest floor that needs it. So envspec/ imports nothing above it, nor Pulumi (a
Terraform renderer reads it too); workloads/ never imports infra/; what the trainer image holds (trainer/, envspec/)
never imports infra/ or workloads/, which the image lacks; infra/'s wings (base, checks, components, offline,
terraform, then the CLI) each import only the wings below them; the trainer's floors (base, model, rl, run, service,
fit, then the entry points) likewise; and no infra or trainer module takes part in an import circle. Imports inside
functions count for every rule."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A call that imports the module its first argument names: the rule covers those too.
_DYNAMIC = ("import_module", "__import__")


def imports(path: Path, root: Path = ROOT, members: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a Python file, wherever it is (module level, function
    bodies, TYPE_CHECKING blocks) and however written (relative, importlib.import_module("...") with a literal).
    members: `from M import a, b` gives M.a and M.b (a module or a name in M) in place of M."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(root).parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from .. import workloads` from a top-level package imports the package it names.
            if module and members:
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
            else:
                found += [(node.lineno, module)] if module else [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in _DYNAMIC:
                found.append((node.lineno, node.args[0].value))
    return found


def violations(folder: str, banned: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """`file:line imports module` for each import of a banned top-level package (a name ending in '*' is a prefix:
    'pulumi*' is pulumi, pulumi_gcp, ...) in the .py files under `folder`."""

    def is_banned(module: str) -> bool:
        top = module.split(".")[0]
        return any(top.startswith(b[:-1]) if b.endswith("*") else top == b for b in banned)

    files = sorted((root / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    return [f"{path.relative_to(root)}:{line} imports {module}"
            for path in files for line, module in sorted(imports(path, root)) if is_banned(module)]


# infra/'s wings from the bottom floor up (docs/architecture.md): each imports only the wings below it. The pre-flight
# checks and the Pulumi components never reach the offline tools, the Terraform renderer or the CLI.
INFRA_WINGS = ("infra.base", "infra.checks", "infra.components", "infra.offline", "infra.terraform", "infra.cli")


def wing_violations(folder: str, banned: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """`file:line imports module` for each import, in the .py files under `folder`, of a module that is or lies in
    one of `banned` (dotted names; `from infra import cli` imports infra.cli)."""
    files = sorted((root / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    return [f"{path.relative_to(root)}:{line} imports {module}"
            for path in files for line, module in sorted(imports(path, root, members=True))
            if any(module == b or module.startswith(b + ".") for b in banned)]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(folder: str, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of `folder` it imports, wherever the import is (function bodies included): a name
    imported from a module is an arrow to that module, `from P import m` of a submodule an arrow to m."""
    paths = {module_name(p, root): p for p in sorted((root / folder).rglob("*.py"))}

    def home(name: str) -> str | None:  # the longest module of the folder that `name` is or lies in
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    return {name: {m for _, imported in imports(path, root, members=True) if (m := home(imported)) not in (None, name)}
            for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: each set of modules that reach one another (Tarjan's strongly connected
    components of two or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_scanner_finds_imports_however_they_are_written(tmp_path: Path) -> None:
    pkg = tmp_path / "envspec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(
        "from __future__ import annotations\n"
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "from . import tpu\n"  # its own package: allowed
        "if TYPE_CHECKING:\n"
        "    from infra.config import X\n"
        "def f() -> None:\n"
        "    import pulumi.errors\n"
        "    from pulumi_gcp import compute\n"
        "    importlib.import_module('trainer.fit.preflight')\n"
        "    from .. import workloads\n")
    found = violations("envspec", ("infra", "workloads", "trainer", "pulumi*"), tmp_path)
    assert found == ["envspec/bad.py:6 imports infra.config", "envspec/bad.py:8 imports pulumi.errors",
                     "envspec/bad.py:9 imports pulumi_gcp", "envspec/bad.py:10 imports trainer.fit.preflight",
                     "envspec/bad.py:11 imports workloads"]
    assert violations("envspec", ("tests",), tmp_path) == []


def test_the_circle_finder_sees_imports_inside_functions(tmp_path: Path) -> None:
    pkg = tmp_path / "infra"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text("")
    (pkg / "a.py").write_text("from infra.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f() -> None:\n    from infra.c import thing\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('infra.a')\n")
    (pkg / "d.py").write_text("from . import a\n")  # imports into the circle, not part of it
    graph = import_graph("infra", tmp_path)
    assert graph["infra.a"] == {"infra.sub.b"} and graph["infra.sub.b"] == {"infra.c"}
    assert circles(graph) == [["infra.a", "infra.c", "infra.sub.b"]]
    (pkg / "c.py").write_text("")
    assert circles(import_graph("infra", tmp_path)) == []


def test_the_wing_rule_sees_imports_however_they_are_written(tmp_path: Path) -> None:
    pkg = tmp_path / "infra" / "components"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "import importlib\n"
        "from infra.base import stack_file\n"  # a floor below: allowed
        "from infra import cli\n"
        "def f() -> None:\n"
        "    from infra.offline import plan\n"
        "    importlib.import_module('infra.terraform.document')\n"
        "    from ..offline.mockrun import run_stack\n")
    assert wing_violations("infra/components", ("infra.offline", "infra.terraform", "infra.cli"), tmp_path) == [
        "infra/components/x.py:3 imports infra.cli", "infra/components/x.py:5 imports infra.offline.plan",
        "infra/components/x.py:6 imports infra.terraform.document",
        "infra/components/x.py:7 imports infra.offline.mockrun.run_stack"]


@pytest.mark.parametrize("floor", range(len(INFRA_WINGS) - 1), ids=INFRA_WINGS[:-1])
def test_each_infra_wing_imports_only_the_wings_below_it(floor: int) -> None:
    assert wing_violations(INFRA_WINGS[floor].replace(".", "/"), INFRA_WINGS[floor + 1:]) == []


def test_every_infra_module_lives_in_a_wing() -> None:
    # A new file goes into the wing it belongs to (docs/architecture.md); only the entry points stand at the top.
    top = sorted(p.name for p in (ROOT / "infra").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py"]
    wings = sorted(p.name for p in (ROOT / "infra").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert wings == sorted(w.split(".")[1] for w in INFRA_WINGS if w != "infra.cli")


def test_no_import_circle_in_infra() -> None:
    # Function-level imports count: a circle through them is still two modules that each need the other.
    assert circles(import_graph("infra")) == []


def test_the_floor_imports_nothing_above_it_nor_pulumi() -> None:
    assert violations("envspec", ("infra", "workloads", "trainer", "tests", "pulumi*")) == []


def test_workloads_never_import_infra_or_the_trainer() -> None:
    # The pod's side of what workloads/ renders (env names, exit codes, paths, the engine's argument parser) is the
    # pod contract on the floor (envspec/pod.py, envspec/engine_args.py); what needs the trainer's own code (loading a
    # trainer config) the caller in infra/ does and hands down (infra/base/engine_config.py).
    assert violations("workloads", ("infra", "trainer")) == []


def test_the_pod_contract_imports_nothing_but_the_standard_library() -> None:
    # envspec/pod.py and the engine's argument parser: what a pod and its builder share, read by the trainer image and
    # the stack alike, so nothing of either side (nor of the floor's own YAML and spec code) may come with them.
    for name in ("pod.py", "engine_args.py"):
        path = ROOT / "envspec" / name
        found = [f"{path.relative_to(ROOT)}:{line} imports {module}" for line, module in imports(path)
                 if module.split(".")[0] not in sys.stdlib_module_names]
        assert found == []


def test_a_spec_section_imports_no_other_section_nor_the_spec_above_it() -> None:
    # envspec/sections/: one model per stack-file section, over what they share (fields.py); a check that reads two
    # sections belongs in envspec/config.py EnvironmentSpec, which composes them (docs/architecture.md).
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / "envspec" / "sections").glob("*.py"))
             for line, module in imports(path, ROOT, members=True)
             if (module == "envspec.config" or module.startswith(("envspec.config.", "envspec.sections.")))
             and not module.startswith("envspec.sections.fields.")]
    assert found == []


@pytest.mark.parametrize("folder", ["trainer", "envspec"])
def test_what_the_trainer_image_holds_never_imports_infra_or_workloads(folder: str) -> None:
    assert violations(folder, ("infra", "workloads")) == []


# trainer/'s floors from the bottom up (docs/architecture.md): each imports only the floors below it. The service
# reuses the trainer's model, RL programs and launchers; `fit` sizes the trainer's and the service's programs, so it
# stands above both (the pass rule both read is trainer/service/passes.py). Above every floor stand the entry points
# pods run: `python -m trainer` (__main__.py) and `python -m trainer.stage` (stage.py).
TRAINER_FLOORS = ("trainer.base", "trainer.model", "trainer.rl", "trainer.run", "trainer.service", "trainer.fit")
TRAINER_ENTRIES = ("trainer.__main__", "trainer.stage")
# Folders of trainer/ that hold data, not modules: package data (pyproject's package-data) and the empty user code.
TRAINER_DATA = ("configs", "data", "no_user_code", "presets")


@pytest.mark.parametrize("floor", range(len(TRAINER_FLOORS)), ids=TRAINER_FLOORS)
def test_each_trainer_floor_imports_only_the_floors_below_it(floor: int) -> None:
    above = TRAINER_FLOORS[floor + 1:] + TRAINER_ENTRIES
    assert wing_violations(TRAINER_FLOORS[floor].replace(".", "/"), above) == []


def test_every_trainer_module_lives_in_a_floor() -> None:
    # A new file goes into the floor it belongs to (docs/architecture.md); only the entry points stand at the top.
    top = sorted(p.name for p in (ROOT / "trainer").glob("*.py"))
    assert top == sorted(["__init__.py", *(f"{e.split('.')[1]}.py" for e in TRAINER_ENTRIES)])
    folders = sorted(p.name for p in (ROOT / "trainer").iterdir()
                     if p.is_dir() and p.name != "__pycache__" and p.name not in TRAINER_DATA)
    assert folders == sorted(f.split(".")[1] for f in TRAINER_FLOORS)
    for data in TRAINER_DATA:
        assert not list((ROOT / "trainer" / data).rglob("*.py")), f"trainer/{data} is data, not a floor"


def test_no_import_circle_in_the_trainer() -> None:
    # Among all of trainer/ (the service included), function-level imports counted.
    assert circles(import_graph("trainer")) == []


def test_the_floor_runs_without_pulumi_or_the_packages_above_it() -> None:
    # Every module imports, and each shipped environment parses, with those packages made unimportable: what a
    # Terraform renderer or the trainer image (which have no Pulumi) get.
    code = """
import importlib, pkgutil, sys
from pathlib import Path
import yaml
for name in ("pulumi", "pulumi_gcp", "pulumi_kubernetes", "pulumi_docker_build", "infra", "workloads", "trainer"):
    sys.modules[name] = None
import envspec
for m in pkgutil.walk_packages(envspec.__path__, "envspec."):
    importlib.import_module(m.name)
from envspec.config import NAMESPACE, parse_spec
from envspec.sections.fields import BundledConfigs
# The spec only checks that a config is named in these lists; the trainer's own listing would need the trainer.
names = tuple(sorted(p.name for p in Path("trainer/configs").glob("*.yaml")))
for path in sorted(Path("environments").glob("Pulumi.*.yaml")):
    raw = yaml.safe_load(path.read_text())["config"]
    env = path.name.split(".")[1]
    spec = parse_spec({k.removeprefix(NAMESPACE + ":"): v for k, v in raw.items()}, env, BundledConfigs(names, names))
    print(env, spec.slices[0].shape.key)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dev v6e-2x2" in result.stdout.splitlines()
