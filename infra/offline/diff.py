"""`plan ENV --diff REF`: the environment's plan at another git revision (its program and its stack file, as they
were there) against today's: resources and Kubernetes objects added, removed and changed, TPU chips and list price."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.base import user_code
from infra.base.digests import tree_files
from infra.base.stack_file import PlanError
from infra.checks import placement
from infra.offline import cost, shipped
from infra.offline.changes import changed_inputs, show
from infra.offline.mockrun import IMAGE_TYPE, PlanResult
from infra.offline.plan import is_kubernetes_type

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
if (root / "infra" / "offline" / "mockrun.py").is_file():
    from infra.offline.mockrun import run_stack
else:  # a revision from before infra/ was split into wings
    from infra.mockrun import run_stack
result = run_stack(env, (yaml.safe_load(path.read_text()) or {}).get("config") or {})
spec = result.spec
slices = [{"name": g.name, "tpu_type": g.tpu_type, "topology": g.topology, "capacity": g.capacity,
           "count": g.count, "chips": g.count * g.shape.chips} for g in spec.slices]
pool = getattr(getattr(spec, "cluster", None), "system_pool", None)
system_pool = None if pool is None else {"machine_type": pool.machine_type, "nodes": pool.nodes}
svc = getattr(spec, "service", None)  # today's infra.offline.cost.service_record, restated for a tree that may lack it
if system_pool is not None and svc is not None:
    db, group = svc.database, spec.service_group
    trainer = spec.trainer_group if spec.trainer.enabled else None
    system_pool["service"] = {
        "slice_group": group.name, "suspend": svc.suspend, "shared": trainer is not None and trainer.name == group.name,
        "database": {"tier": db.tier, "cpus": db.cpus, "memory_gib": db.memory_gib, "disk_gb": db.disk_gb,
                     "availability": db.availability}}
code = getattr(getattr(spec, "trainer", None), "code", None)  # trainer.code, where the revision has it
if (root / "infra" / "checks" / "placement.py").is_file():  # where sampling and the update run, in words
    from infra.checks.placement import line as placement_line
    placement = placement_line(spec)
else:
    placement = "unknown"
print(json.dumps({"region": spec.region, "slices": slices, "system_pool": system_pool, "outputs": result.outputs,
                  "code": code, "placement": placement,
                  "resources": [{"urn": r.urn, "type": r.type, "name": r.name, "custom": r.custom,
                                 "inputs": r.inputs, "options": r.options} for r in result.resources]},
                 default=str))
"""


IMAGE_OUTPUT = "trainerImage"
PLACEMENT_UNKNOWN = "unknown"


@dataclass(frozen=True)
class Snapshot:
    """What a diff compares: resources by URN, and the slice groups that decide chips and cost."""

    region: str
    slices: list[dict[str, Any]]
    resources: dict[str, dict[str, Any]]  # urn -> {type, name, custom, inputs, options}
    missing: str | None = None  # why there is no plan at that revision (the environment did not exist)
    context: str | None = None  # the built image's stand-in digest (StandIn; None: the stack builds none)
    system_pool: dict[str, Any] | None = None  # {machine_type, nodes, service?}; None: the slices alone are priced
    sources: dict[str, str] = field(default_factory=dict)  # path -> sha256 of what the image is built from
    code: str | None = None  # trainer.code: the user's own folder among the sources
    warnings: list[str] = field(default_factory=list)  # settings that cost performance (infra/offline/shipped.py)
    # The trainer's placement in words (infra/checks/placement.py); None: the default (colocated, lag 0), or no
    # trainer; PLACEMENT_UNKNOWN: a revision from before the stack could say.
    placement: str | None = None
    plan: PlanResult | None = field(default=None, compare=False, repr=False)  # this revision's plan, as the diff has it

    @property
    def chips_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slices:
            out[s["tpu_type"]] = out.get(s["tpu_type"], 0) + s["chips"]
        return out

    def cost(self, table: cost.PriceTable | None = None, gke: cost.GkeTable | None = None) -> cost.EnvironmentCost:
        # A revision without the environment costs nothing: no cluster, no fee.
        return cost.environment_cost(self.slices, self.region, table, None if self.missing else self.system_pool, gke)


# ---------------------------------------------------------------- the image the stack builds


@functools.cache
def _pattern(glob: str) -> re.Pattern[str]:
    # .dockerignore's glob (Go's filepath.Match plus '**'): '*' stays within a folder, '**/' spans any depth.
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(glob[i], re.escape(glob[i])), i + 1
    return re.compile(out + r"\Z")


def _dockerignore(tree: Path) -> list[tuple[bool, str]]:
    """(keep, glob) per line of the tree's .dockerignore, in order."""
    path = tree / ".dockerignore"
    lines = [line.strip() for line in (path.read_text().splitlines() if path.is_file() else [])]
    return [(line.startswith("!"), line.lstrip("!").strip("/")) for line in lines if line and not line.startswith("#")]


def _ignored(rel: str, rules: list[tuple[bool, str]]) -> bool:
    # The last pattern that matches the path or a folder above it decides; '!' keeps what it matches.
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for keep, glob in rules:
        if any(_pattern(glob).match(p) for p in prefixes):
            ignored = not keep
    return ignored


def _may_keep_below(folder: str, rules: list[tuple[bool, str]]) -> bool:
    """Whether a '!' pattern could keep something inside `folder`: its leading segments match the folder's, or it
    starts with '**' (any depth)."""
    depth = folder.count("/") + 1
    return any(keep and (glob.startswith("**") or (len(glob.split("/")) > depth and
                                                   _pattern("/".join(glob.split("/")[:depth])).match(folder)))
               for keep, glob in rules)


def context_files(tree: Path) -> dict[str, str]:
    """{path: sha256} of the files the image build sees (the tree's .dockerignore applied): what decides whether
    pulumi-docker-build rebuilds, and so whether the training job gets a new image digest."""
    rules = _dockerignore(tree)
    # An ignored folder is skipped unless a '!' pattern could keep something inside it (not .venv's 10^5 files).
    return tree_files(tree, lambda rel: not _ignored(rel, rules) or _may_keep_below(rel, rules),
                      lambda rel: not _ignored(rel, rules))


def image_sources(tree: Path, code: str | None) -> dict[str, str]:
    """{path in the repository: sha256} of what the trainer image is built from: the build context, and trainer.code's
    folder (a named context of its own, infra/base/user_code.py)."""
    files = context_files(tree)
    if code is not None and (tree / code).is_dir():
        folder = Path(code).as_posix().rstrip("/")
        files.update({f"{folder}/{rel}": h for rel, h in user_code.files(tree / code).items()})
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class StandIn:
    """The built image's stand-in digest of one revision: a hash of its sources and build arguments, in place of the
    plan's mocked digest (a hash of the build's arguments alone), so a change under trainer/ or in trainer.code
    reaches the job's image as it does on `up`. The one digest of that revision: its tree and its diff show it."""

    mocked: str
    digest: str
    sources: dict[str, str]

    def apply(self, value: Any) -> Any:
        return json.loads(json.dumps(value).replace(self.mocked, self.digest))


def stand_in(resources: list[dict[str, Any]], outputs: dict[str, Any], tree: Path, code: str | None
             ) -> StandIn | None:
    """None when the stack builds no image (trainer.image names one)."""
    ref = outputs.get(IMAGE_OUTPUT)
    images = [r for r in resources if r["type"] == IMAGE_TYPE]
    if not isinstance(ref, str) or "@sha256:" not in ref or not images:
        return None
    sources = image_sources(tree, code)
    args = [r["inputs"].get("buildArgs") for r in images]
    digest = hashlib.sha256(json.dumps({"sources": sources, "buildArgs": args}, sort_keys=True).encode()).hexdigest()
    return StandIn(ref.split("@sha256:", 1)[1], digest, sources)


def with_stand_in(result: PlanResult, tree: Path) -> tuple[PlanResult, StandIn | None]:
    """The plan with the stand-in digest in place of the mocked one, everywhere (resources and outputs): what
    `plan --diff` renders, so the tree and the diff above it name the same image."""
    code = result.spec.trainer.code
    s = stand_in([{"type": r.type, "inputs": r.inputs} for r in result.resources], result.outputs, tree, code)
    if s is None:
        return result, None
    resources = [dataclasses.replace(r, inputs=s.apply(r.inputs)) for r in result.resources]
    return dataclasses.replace(result, resources=resources, outputs=s.apply(result.outputs)), s


def snapshot(result: PlanResult, tree: Path | None = None) -> Snapshot:
    """The plan as a diff compares it; with `tree` (the repository it ran in), the built image's stand-in digest."""
    built = None
    if tree is not None:
        result, built = with_stand_in(result, tree)
    resources = {r.urn: {"type": r.type, "name": r.name, "custom": r.custom, "inputs": r.inputs,
                         "options": r.options} for r in result.resources}
    return Snapshot(result.spec.region, cost.slice_groups(result.spec), resources,
                    context=None if built is None else built.digest, system_pool=cost.system_pool(result.spec),
                    sources={} if built is None else built.sources, code=result.spec.trainer.code,
                    warnings=shipped.warnings(result.spec), placement=placement.line(result.spec), plan=result)


def _git(root: Path, *args: str, silent_failure: str | None = None) -> bytes:
    """git's stdout; a failure raises PlanError with git's message, or `silent_failure` when git printed none."""
    try:
        return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True).stdout
    except FileNotFoundError:
        raise PlanError("--diff needs git on PATH") from None
    except subprocess.CalledProcessError as e:
        detail = e.stderr.decode(errors="replace").strip()
        if not detail and silent_failure is not None:
            raise PlanError(silent_failure) from None
        raise PlanError(f"git {' '.join(args)}: {detail or f'exit status {e.returncode}'}") from None


def snapshot_at(env: str, ref: str, root: Path) -> Snapshot:
    """Runs the program of revision `ref` on its own stack file for `env`, in a separate Python process."""
    # --quiet: an unknown ref exits 1 with nothing on stderr (outside a repository git still says so itself).
    commit = _git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}",
                  silent_failure=f"--diff {ref}: not a commit, branch or tag in this repository").decode().strip()
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
        code = doc.get("code")
        built = stand_in(doc["resources"], doc["outputs"], tree, code)
        if built is not None:
            doc["resources"] = built.apply(doc["resources"])
    resources = {r.pop("urn"): r for r in doc["resources"]}
    return Snapshot(doc["region"], doc["slices"], resources, context=None if built is None else built.digest,
                    system_pool=doc.get("system_pool"), sources={} if built is None else built.sources, code=code,
                    placement=doc.get("placement", PLACEMENT_UNKNOWN))


# ---------------------------------------------------------------- comparing


# Kinds whose replacement restarts training (the trainer's JobSet or RayJob, infra/components/trainer_job.py).
TRAINING_JOB_TYPES = ("kubernetes:jobset.x-k8s.io/v1alpha2:JobSet", "kubernetes:ray.io/v1:RayJob")
RESTARTS_TRAINING = "training restarts from its last checkpoint"


@dataclass(frozen=True)
class Change:
    urn: str
    type: str
    name: str
    kubernetes: bool
    inputs: list[tuple[str, Any, Any]] = field(default_factory=list)
    replaced: bool = False  # `pulumi up` deletes and re-creates it rather than updating it in place

    @property
    def consequence(self) -> str | None:
        if not self.replaced:
            return None
        return RESTARTS_TRAINING if self.type in TRAINING_JOB_TYPES else "deleted and created again"


def _matches(path: str, pattern: str) -> bool:
    """A changed input path under a replaceOnChanges property path (Pulumi's rule: the property or anything in it)."""
    return pattern == "*" or path == pattern or path.startswith((f"{pattern}.", f"{pattern}["))


def replaces(options: dict[str, Any], inputs: list[tuple[str, Any, Any]]) -> bool:
    """Whether the engine replaces a resource whose inputs changed so: any change under one of its replaceOnChanges
    paths (the new program's options decide, as they do for `pulumi up`)."""
    patterns = options.get("replaceOnChanges") or []
    return any(_matches(path, p) for path, _, _ in inputs for p in patterns)


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

    @property
    def replaced(self) -> list[Change]:
        return [c for c in self.changed if c.replaced]

    @property
    def rebuilt(self) -> bool:
        """Both revisions build the image, from different sources or arguments."""
        return self.old.context is not None and self.new.context is not None and self.old.context != self.new.context

    @property
    def changed_sources(self) -> list[tuple[str, str | None, str | None]]:
        """(path, old sha256, new sha256) of every file the image is built from that was added, removed or changed."""
        if not self.rebuilt:
            return []
        a, b = self.old.sources, self.new.sources
        return [(p, a.get(p), b.get(p)) for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)]


def in_code(path: str, code: str | None) -> bool:
    """The file is in trainer.code's folder: the user's own tasks and rewards."""
    return code is not None and path.startswith(Path(code).as_posix().rstrip("/") + "/")


def _file(sha: str | None) -> str | None:
    return None if sha is None else f"sha256:{sha[:12]}"


def compare(env: str, ref: str, old: Snapshot, new: Snapshot) -> PlanDiff:
    def change(urn: str, r: dict[str, Any], inputs: list[tuple[str, Any, Any]] | None = None,
               replaced: bool = False) -> Change:
        return Change(urn, r["type"], r["name"], is_kubernetes_type(r["type"], r["custom"]), inputs or [], replaced)

    added = [change(u, new.resources[u]) for u in new.resources if u not in old.resources]
    removed = [change(u, old.resources[u]) for u in old.resources if u not in new.resources]
    changed = []
    probe = PlanDiff(env, ref, old, new, [], [], [])
    for urn in new.resources:
        if urn in old.resources:
            diff = changed_inputs(old.resources[urn]["inputs"], new.resources[urn]["inputs"])
            if probe.rebuilt and new.resources[urn]["type"] == IMAGE_TYPE:
                # What it builds changed (its sources: trainer/, envspec/, trainer.code, ...): each file, by name.
                diff = [("stand-in digest", old.context, new.context), *diff,
                        *((f"file {p}", _file(a), _file(b)) for p, a, b in probe.changed_sources)]
            opts = changed_inputs({"options": old.resources[urn]["options"]},
                                  {"options": new.resources[urn]["options"]})
            # dependsOn lists URNs that move with any rename; the inputs and protect flags are what matter.
            opts = [o for o in opts if not o[0].startswith("options.dependsOn")]
            if diff or opts:
                changed.append(change(urn, new.resources[urn], diff + opts,
                                      replaces(new.resources[urn]["options"], diff)))
    key = lambda c: (c.kubernetes, c.type, c.name)  # noqa: E731
    return PlanDiff(env, ref, old, new, sorted(added, key=key), sorted(removed, key=key), sorted(changed, key=key))


def diff_plan(result: PlanResult, ref: str, root: Path) -> PlanDiff:
    return compare(result.env, ref, snapshot_at(result.env, ref, root), snapshot(result, root))


# ---------------------------------------------------------------- rendering


def _rate(o: cost.OtherCost) -> str:
    """What is billed and its price, e.g. '2 x e2-standard-8 $0.54'."""
    return f"{o.detail} {'not priced' if o.usd_per_hour is None else cost.usd(o.usd_per_hour)}".lstrip()


def _changed_others(old: cost.EnvironmentCost, new: cost.EnvironmentCost
                    ) -> list[tuple[cost.OtherCost, cost.OtherCost]]:
    """The costs besides the TPU slices (the system pool, the cluster fee) present on both sides that changed."""
    before = {o.name: o for o in old.others}
    return [(before[o.name], o) for o in new.others if o.name in before and before[o.name] != o]


KIT_FILES_NAMED = 5  # the headline names this many of the kit's changed files; the image's row lists every one


def _image_line(d: PlanDiff) -> str | None:
    """Why the image is rebuilt, by file: the user's own code (trainer.code) first, by name."""
    if not d.rebuilt:
        return None
    files = d.changed_sources
    word = {(True, False): "added", (False, True): "removed"}

    def named(paths: list[tuple[str, str | None, str | None]], prefix: str = "") -> str:
        return ", ".join(f"{p.removeprefix(prefix)} ({word.get((a is None, b is None), 'changed')})"
                         for p, a, b in paths)

    code = d.new.code or d.old.code
    own = [f for f in files if in_code(f[0], code)]
    kit = [f for f in files if not in_code(f[0], code)]
    parts = []
    if own:
        parts.append(f"your code (trainer.code {code}): {named(own, Path(str(code)).as_posix().rstrip('/') + '/')}")
    if kit:
        more = len(kit) - KIT_FILES_NAMED
        parts.append("the kit: " + named(kit[:KIT_FILES_NAMED]) + (f" and {more} more, listed with the image"
                                                                   if more > 0 else ""))
    what = "; ".join(parts) or "its build arguments changed"
    return (f"Image: rebuilt: {what}. Stand-in digest {str(d.old.context)[:12]} → {str(d.new.context)[:12]}, the "
            "same in the plan below.")


DEFAULT_PLACEMENT = "sampling and the update on the same chips, one after the other (colocated, lag 0)"


def _placement_line(d: PlanDiff) -> str | None:
    """Where the trainer samples and updates, when that changed (a trainer config's placement or lag: the JobSet's
    args or its config's digest show the keys, this says what they mean)."""
    old, new = d.old.placement, d.new.placement
    if old == new or d.old.missing or d.new.missing:
        return None
    if old == PLACEMENT_UNKNOWN:
        return None if new is None else f"Trainer placement: {new} (not known at {d.ref})."
    return f"Trainer placement: {old or DEFAULT_PLACEMENT} → {new or DEFAULT_PLACEMENT}."


def headline(d: PlanDiff, table: cost.PriceTable | None = None) -> list[str]:
    """The delta in a few sentences: chips, price, resource counts, why the image is rebuilt, warnings."""
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
    line += "".join(f" {o.name[:1].upper()}{o.name[1:]}: {_rate(was)} → {_rate(o)} per hour."
                    for was, o in _changed_others(old_cost, new_cost))
    unpriced = {g.group for g in old_cost.unpriced + new_cost.unpriced}
    unpriced |= {f"{o.label} ({o.lacking})" for o in old_cost.unpriced_others + new_cost.unpriced_others}
    if unpriced:
        line += f" No price for {', '.join(sorted(unpriced))}: not counted."
    lines.append(line)
    k8s = [c for c in d.added + d.removed + d.changed if c.kubernetes]
    replaced = f", {len(d.replaced)} of the changes replacements" if d.replaced else ""
    lines.append(f"Resources: {len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed{replaced} "
                 f"({len(k8s)} of them Kubernetes objects)." if not d.empty else "Resources: no change.")
    for c in d.replaced:
        lines.append(f"Replaced: {c.name} ({c.type.rsplit(':', 1)[-1]}): {c.consequence}.")
    trainer = _placement_line(d)
    if trainer:
        lines.append(trainer)
    image = _image_line(d)
    if image:
        lines.append(image)
    lines += [f"Warning: {w}" for w in d.new.warnings]
    return lines


def _section(title: str, changes: list[Change], with_inputs: bool) -> list[str]:
    if not changes:
        return []
    out = [f"{title}:"]
    for c in changes:
        out.append(f"  {c.name}  {c.type}" + (f"  REPLACED: {c.consequence}" if c.replaced else ""))
        if with_inputs:
            out += [f"      {path}: {show(a)} → {show(b)}" for path, a, b in c.inputs]
    return out


def text(d: PlanDiff, table: cost.PriceTable | None = None) -> str:
    lines = [f"diff: {d.env}, {d.ref} → working tree", *headline(d, table)]
    for kube, label in ((False, "cloud resources"), (True, "Kubernetes objects")):
        for title, changes, inputs in (("added", d.added, False), ("removed", d.removed, False),
                                       ("changed", d.changed, True)):
            lines += _section(f"{title} {label}", [c for c in changes if c.kubernetes is kube], inputs)
    return "\n".join(lines) + "\n"


def _code(value: str, cell: bool = True) -> str:
    """`value` as inline code: a backtick would end the span; in a table cell a pipe would end the cell."""
    value = value.replace("`", "'")
    return "`" + (value.replace("|", "\\|") if cell else value) + "`"


INLINE_INPUTS = 6  # a change with more inputs is folded under the table (every input shown, none dropped)
INLINE_ROWS = 15  # more added or removed resources than this are folded


def _input_line(path: str, a: Any, b: Any, cell: bool) -> str:
    return f"{_code(path, cell)}: {_code(show(a), cell)} → {_code(show(b), cell)}"


SHARED_PATH = 24  # a longer path that all of a change's inputs start with is said once, before them


def _shared(paths: list[str]) -> str:
    """The longest leading part of every path that ends where each continues with '.': '' when short or alone."""
    if len(paths) < 2:
        return ""
    shared = os.path.commonprefix(paths)
    while shared and not all(p[len(shared):].startswith(".") for p in paths):
        shared = shared[:-1]
    return shared if len(shared) >= SHARED_PATH else ""


def _input_lines(c: Change, cell: bool) -> list[str]:
    """Each input as `path: old → new`; the pod template's long path (or any shared one) said once, in front."""
    shared = _shared([p for p, _, _ in c.inputs])
    lines = [_input_line(p.removeprefix(shared + "." if shared else ""), a, b, cell) for p, a, b in c.inputs]
    return ([f"under {_code(shared, cell)}:"] if shared else []) + lines


def _rows(rows: list[tuple[Change, str, str]]) -> list[str]:
    return ["| | resource | type | what changed |", "|---|---|---|---|",
            *(f"| {what} | {_code(c.name)} | {_code(c.type)} | {detail} |" for c, what, detail in rows)]


def _fold(summary: str, body: list[str]) -> list[str]:
    return ["", f"<details><summary>{summary}</summary>", "", *body, "", "</details>"]


def markdown(d: PlanDiff, table: cost.PriceTable | None = None) -> str:
    """The delta first (for the PR comment), then every change: short ones in a table, long ones folded under it,
    each input by name (a container's args as flags, env by name), none cut short."""
    lines = [f"### gke-tpu-rl plan diff: `{d.env}` against `{d.ref}`", ""]
    lines += [f"- **{line.split(':', 1)[0]}**:{line.split(':', 1)[1]}" if ":" in line else f"- {line}"
              for line in headline(d, table)]
    folded: list[Change] = []

    def detail(c: Change) -> str:
        if len(c.inputs) <= INLINE_INPUTS:
            return "<br>".join(_input_lines(c, cell=True))
        folded.append(c)
        return f"{len(c.inputs)} changes, folded below"

    changed = [(c, f"**replaced** ({c.consequence})" if c.replaced else "changed", detail(c)) for c in d.changed]
    new_or_gone = [(c, "added", "") for c in d.added] + [(c, "removed", "") for c in d.removed]
    if changed or (new_or_gone and len(new_or_gone) <= INLINE_ROWS):
        lines += ["", *_rows((new_or_gone if len(new_or_gone) <= INLINE_ROWS else []) + changed)]
    for c in folded:
        lines += _fold(f"{_code(c.name, cell=False)} ({c.type.rsplit(':', 1)[-1]}): {len(c.inputs)} changes",
                       [f"- {line}" for line in _input_lines(c, cell=False)])
    if len(new_or_gone) > INLINE_ROWS:
        lines += _fold(f"{len(d.added)} added, {len(d.removed)} removed", _rows(new_or_gone))
    return "\n".join(lines) + "\n"
