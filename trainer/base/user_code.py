"""A user's own tasks and reward functions, named in the trainer config as `MODULE:NAME` beside the built-in names.

The stack copies the environment's `trainer.code` folder into the image at USER_CODE_DIR (envspec/pod.py) and installs
it there (`python -m trainer.base.user_code install DIR`, from trainer/Dockerfile): a project with a pyproject.toml (or
setup.py) is pip-installed with its own dependencies, pinned to the versions the image already has; a plain folder of
modules is put on the interpreter's path. Locally, `PYTHONPATH=<folder> gke-tpu-rl train ...` does the same.

No JAX here: the preflight resolves and tries every reference before any device is set up.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The .pth file that puts a plain folder of modules on the path.
PTH_NAME = "gke-tpu-rl-user-code.pth"

_REF = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)$")


def is_ref(name: str) -> bool:
    """`pkg.module:name` (a user's object) rather than a built-in task or reward name."""
    return ":" in name


def parse_ref(ref: str) -> tuple[str, str]:
    """`pkg.module:name` -> (module, name); anything else raises ValueError saying the expected form."""
    m = _REF.match(ref)
    if m is None:
        raise ValueError(f"{ref!r} is not MODULE:NAME (e.g. my_tasks.rewards:boxed_answer)")
    return m["module"], m["attr"]


def resolve(ref: str) -> Callable[..., Any]:
    """Import `pkg.module:name` and return the callable; each way it can fail raises KeyError/TypeError/ValueError
    with a message that says what to do."""
    module_name, attr = parse_ref(ref)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise KeyError(f"{ref!r}: no module {err.name!r} on the path; on the cluster set gke-tpu-rl:trainer.code "
                           "to the folder that holds it, locally run with PYTHONPATH=<that folder>") from None
        raise ValueError(f"{ref!r}: importing {module_name!r} failed: {err}") from None
    except Exception as err:  # the user's module raised while importing: say so with its own message
        raise ValueError(f"{ref!r}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module_name)
        raise KeyError(f"{ref!r}: module {module_name!r} has no {attr!r}; its callables: {', '.join(public) or 'none'}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise TypeError(f"{ref!r} is a {type(obj).__name__}, not a function or class")
    return obj


# ------------------------------------------------------------------------------------------------ install


def pins() -> list[str]:
    """`name==version` of every distribution this interpreter has: the constraints a user's project installs
    under, so its dependencies cannot move what the trainer was built and tested with (jax, libtpu, ray, ...)."""
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            seen.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return [f"{name}=={version}" for name, version in sorted(seen.items())]


def install(folder: Path) -> str:
    """Install the user's folder into this interpreter; returns what was done (for the build log)."""
    folder = folder.resolve()
    if not folder.is_dir():
        raise SystemExit(f"error: {folder} is not a folder")
    if (folder / "pyproject.toml").is_file() or (folder / "setup.py").is_file():
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="pins-") as f:
            f.write("\n".join(pins()) + "\n")
            f.flush()
            # Not editable: the image holds a built copy; the constraints keep every installed version.
            subprocess.run([sys.executable, "-m", "pip", "install", "--constraint", f.name, str(folder)], check=True)
        return f"installed the project in {folder} (its dependencies pinned to the image's versions)"
    if not any(folder.glob("*.py")) and not any(folder.glob("*/__init__.py")):
        return f"{folder} holds no Python modules or packages; nothing to install"
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    pth.write_text(f"{folder}\n")
    return f"put {folder} on the path ({pth})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.base.user_code",
                                description="Install the environment's own tasks and rewards (trainer.code) into "
                                "this interpreter, as the trainer image's build does.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="install FOLDER").add_argument("folder", type=Path)
    args = p.parse_args(argv)
    print(install(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
