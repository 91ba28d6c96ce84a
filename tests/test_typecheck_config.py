"""pyproject's [tool.mypy] follows only the pulumi_gcp services the program uses (the rest would double a cold run):
a service used anew must be added there, or mypy would see it as Any and check none of its calls."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envspec", "infra", "workloads", "trainer", "bench")
# `gcp.<service>.` after `import pulumi_gcp as gcp`, `pulumi_gcp.<service>` and `from pulumi_gcp import <service>`.
_USE = re.compile(r"\bgcp\.([a-z_0-9]+)\.|\bpulumi_gcp\.([a-z_0-9]+)|from pulumi_gcp import ([a-z_0-9, ]+)")


def followed_gcp_services() -> set[str]:
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    return {m.removeprefix("pulumi_gcp.").removesuffix(".*") for o in overrides
            if o.get("follow_imports") == "normal" for m in o["module"] if m.startswith("pulumi_gcp.")}


def used_gcp_services() -> dict[str, str]:
    """service -> a file that uses it."""
    used: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for m in _USE.finditer(path.read_text()):
                names = m.group(3).split(",") if m.group(3) else [m.group(1) or m.group(2)]
                for name in (n.strip() for n in names):
                    used.setdefault(name, str(path.relative_to(ROOT)))
    return used


def test_mypy_follows_every_pulumi_gcp_service_the_program_uses() -> None:
    followed = followed_gcp_services()
    assert {"container", "storage"} <= followed  # the pattern reads the config
    missing = {s: f for s, f in used_gcp_services().items() if s not in followed}
    assert not missing, f"add these pulumi_gcp services to pyproject's [tool.mypy] follow list: {missing}"
