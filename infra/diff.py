"""`plan ENV --diff REF`: the environment's plan at another git revision (its program and its stack file, as they
were there) against today's: resources and Kubernetes objects added, removed and changed, TPU chips and list price."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra import cost
from infra.mockrun import PlanResult
from infra.plan import PlanError, is_kubernetes_type

# Runs inside the old revision's tree with its own infra package (self-contained: the old tree may lack any of
# today's modules). Prints a snapshot as JSON, or {"missing": ...} when the environment did not exist there.
_RUNNER = r"""
import json, sys
from pathlib import Path
root, env = Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, str(root))
import yaml
project = yaml.safe_load((root / "Pulumi.yaml").read_text()) or {}
path = root / (project.get("stackConfigDir") or ".") / f"Pulumi.{env}.yaml"
if not path.is_file():
    print(json.dumps({"missing": f"no {path.relative_to(root)} at this revision"}))
    raise SystemExit(0)
from infra.mockrun import run_stack
result = run_stack(env, (yaml.safe_load(path.read_text()) or {}).get("config") or {})
spec = result.spec
slices = [{"name": g.name, "tpu_type": g.tpu_type, "topology": g.topology, "capacity": g.capacity,
           "count": g.count, "chips": g.count * g.shape.chips} for g in spec.slices]
print(json.dumps({"region": spec.region, "slices": slices, "outputs": result.outputs,
                  "resources": [{"urn": r.urn, "type": r.type, "name": r.name, "custom": r.custom,
                                 "inputs": r.inputs, "options": r.options} for r in result.resources]},
                 default=str))
"""


@dataclass(frozen=True)
class Snapshot:
    """What a diff compares: resources by URN, and the slice groups that decide chips and cost."""

    region: str
    slices: list[dict[str, Any]]
    resources: dict[str, dict[str, Any]]  # urn -> {type, name, custom, inputs, options}
    missing: str | None = None  # why there is no plan at that revision (the environment did not exist)

    @property
    def chips_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slices:
            out[s["tpu_type"]] = out.get(s["tpu_type"], 0) + s["chips"]
        return out

    def cost(self, table: cost.PriceTable | None = None) -> cost.EnvironmentCost:
        return cost.environment_cost(self.slices, self.region, table)


def snapshot(result: PlanResult) -> Snapshot:
    resources = {r.urn: {"type": r.type, "name": r.name, "custom": r.custom, "inputs": r.inputs,
                         "options": r.options} for r in result.resources}
    return Snapshot(result.spec.region, cost.slice_groups(result.spec), resources)


def _git(root: Path, *args: str) -> bytes:
    try:
        return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True).stdout
    except FileNotFoundError:
        raise PlanError("--diff needs git on PATH") from None
    except subprocess.CalledProcessError as e:
        raise PlanError(f"git {' '.join(args)}: {e.stderr.decode(errors='replace').strip()}") from None


def snapshot_at(env: str, ref: str, root: Path) -> Snapshot:
    """Runs the program of revision `ref` on its own stack file for `env`, in a separate Python process."""
    commit = _git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").decode().strip()
    prefix = _git(root, "rev-parse", "--show-prefix").decode().strip()  # Pulumi.yaml may sit below the git root
    with tempfile.TemporaryDirectory(prefix="gke-tpu-rl-diff-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(_git(root, "archive", "--format=tar", commit))) as tar:
            tar.extractall(tmp, filter="data")
        tree = Path(tmp) / prefix
        if not (tree / "Pulumi.yaml").is_file():
            return Snapshot("", [], {}, missing=f"no Pulumi.yaml at {ref}")
        env_vars = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(tree), env], capture_output=True, text=True,
                              cwd=tree, env=env_vars)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PlanError(f"the plan of {env!r} at {ref} ({commit[:12]}) failed: {last}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    if "missing" in doc:
        return Snapshot("", [], {}, missing=doc["missing"])
    return Snapshot(doc["region"], doc["slices"], {r.pop("urn"): r for r in doc["resources"]})


# ---------------------------------------------------------------- comparing


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def changed_inputs(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(path, old, new) for every leaf that differs; a missing side is None."""
    a, b = _flatten(old), _flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


@dataclass(frozen=True)
class Change:
    urn: str
    type: str
    name: str
    kubernetes: bool
    inputs: list[tuple[str, Any, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class PlanDiff:
    env: str
    ref: str
    old: Snapshot
    new: Snapshot
    added: list[Change]
    removed: list[Change]
    changed: list[Change]

    @property
    def chips_delta(self) -> dict[str, tuple[int, int]]:
        """tpu type -> (before, after), for every type whose count changed."""
        a, b = self.old.chips_by_type, self.new.chips_by_type
        return {t: (a.get(t, 0), b.get(t, 0)) for t in sorted(set(a) | set(b)) if a.get(t, 0) != b.get(t, 0)}

    def cost_delta(self, table: cost.PriceTable | None = None) -> tuple[cost.EnvironmentCost, cost.EnvironmentCost]:
        return self.old.cost(table), self.new.cost(table)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


def compare(env: str, ref: str, old: Snapshot, new: Snapshot) -> PlanDiff:
    def change(urn: str, r: dict[str, Any], inputs: list[tuple[str, Any, Any]] | None = None) -> Change:
        return Change(urn, r["type"], r["name"], is_kubernetes_type(r["type"], r["custom"]), inputs or [])

    added = [change(u, new.resources[u]) for u in new.resources if u not in old.resources]
    removed = [change(u, old.resources[u]) for u in old.resources if u not in new.resources]
    changed = []
    for urn in new.resources:
        if urn in old.resources:
            diff = changed_inputs(old.resources[urn]["inputs"], new.resources[urn]["inputs"])
            opts = changed_inputs({"options": old.resources[urn]["options"]},
                                  {"options": new.resources[urn]["options"]})
            # dependsOn lists URNs that move with any rename; the inputs and protect flags are what matter.
            opts = [o for o in opts if not o[0].startswith("options.dependsOn")]
            if diff or opts:
                changed.append(change(urn, new.resources[urn], diff + opts))
    key = lambda c: (c.kubernetes, c.type, c.name)  # noqa: E731
    return PlanDiff(env, ref, old, new, sorted(added, key=key), sorted(removed, key=key), sorted(changed, key=key))


def diff_plan(result: PlanResult, ref: str, root: Path) -> PlanDiff:
    return compare(result.env, ref, snapshot_at(result.env, ref, root), snapshot(result))


# ---------------------------------------------------------------- rendering


def _short(value: Any, limit: int = 80) -> str:
    text = "∅" if value is None else json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"


def headline(d: PlanDiff, table: cost.PriceTable | None = None) -> list[str]:
    """The delta in a few sentences: chips, price, resource counts."""
    lines = []
    if d.old.missing:
        lines.append(f"New environment: {d.old.missing}.")
    chips = d.chips_delta
    if chips:
        lines.append("TPU chips: " + ", ".join(
            f"{after - before:+d} {t} ({before} → {after})" for t, (before, after) in chips.items()) + ".")
    else:
        lines.append("TPU chips: no change.")
    old_cost, new_cost = d.cost_delta(table)
    delta = new_cost.usd_per_hour - old_cost.usd_per_hour
    line = (f"List price: {cost.usd(delta, signed=True)}/hour, {cost.usd(delta * cost.HOURS_PER_MONTH, signed=True)}"
            f"/month ({cost.usd(old_cost.usd_per_hour)} → {cost.usd(new_cost.usd_per_hour)} per hour).")
    unpriced = {g.group for g in old_cost.unpriced + new_cost.unpriced}
    if unpriced:
        line += f" No price for {', '.join(sorted(unpriced))}: not counted."
    lines.append(line)
    k8s = [c for c in d.added + d.removed + d.changed if c.kubernetes]
    lines.append(f"Resources: {len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed "
                 f"({len(k8s)} of them Kubernetes objects)." if not d.empty else "Resources: no change.")
    return lines


def _section(title: str, changes: list[Change], with_inputs: bool) -> list[str]:
    if not changes:
        return []
    out = [f"{title}:"]
    for c in changes:
        out.append(f"  {c.name}  {c.type}")
        if with_inputs:
            out += [f"      {path}: {_short(a)} → {_short(b)}" for path, a, b in c.inputs]
    return out


def text(d: PlanDiff, table: cost.PriceTable | None = None) -> str:
    lines = [f"diff: {d.env}, {d.ref} → working tree", *headline(d, table)]
    for kube, label in ((False, "cloud resources"), (True, "Kubernetes objects")):
        for title, changes, inputs in (("added", d.added, False), ("removed", d.removed, False),
                                       ("changed", d.changed, True)):
            lines += _section(f"{title} {label}", [c for c in changes if c.kubernetes is kube], inputs)
    return "\n".join(lines) + "\n"


def _md(value: str) -> str:
    return value.replace("|", "\\|").replace("`", "'")


def markdown(d: PlanDiff, table: cost.PriceTable | None = None) -> str:
    """The delta first (for the PR comment), then every change in a table."""
    lines = [f"### gke-tpu-rl plan diff: `{d.env}` against `{d.ref}`", ""]
    lines += [f"- **{line.split(':', 1)[0]}**:{line.split(':', 1)[1]}" if ":" in line else f"- {line}"
              for line in headline(d, table)]
    rows = [(c, "added", "") for c in d.added] + [(c, "removed", "") for c in d.removed]
    rows += [(c, "changed", "<br>".join(f"`{_md(p)}`: `{_md(_short(a, 60))}` → `{_md(_short(b, 60))}`"
                                        for p, a, b in c.inputs[:12])
              + (f"<br>… {len(c.inputs) - 12} more" if len(c.inputs) > 12 else "")) for c in d.changed]
    if rows:
        lines += ["", "| | resource | type | what changed |", "|---|---|---|---|"]
        lines += [f"| {what} | `{_md(c.name)}` | `{c.type}` | {detail} |" for c, what, detail in rows]
    return "\n".join(lines) + "\n"
