"""`gke-tpu-rl status ENV`: what runs in an environment's namespace, what waits and why, on one screen.

It reads the cluster as `kubectl get -o json` prints it (the kubectl the walkthrough's get-credentials set up; no
Kubernetes client library), one call for JobSets, Kueue Workloads, pods and events, and says for each JobSet:
Kueue's verdict (admitted to which flavors, or pending with the scheduler's own message), the JobSet's state and
restarts against its failurePolicy.maxRestarts, its pods by phase, why a pending pod is not scheduled, and the last
exit code of each container with what it means (envspec/pod.py).

Field and condition names are the upstream API types' at the versions the stack deploys: JobSet v0.12.0
(api/jobset/v1alpha2/jobset_types.go: JobSetStatus.restarts, restartsCountTowardsMax, terminalState,
replicatedJobsStatus, conditions Completed / Failed / Suspended / RestartingJobSet); Kueue v0.19.2
(apis/kueue/v1beta2/workload_types.go: conditions QuotaReserved, Admitted, PodsReady, Evicted, Preempted, Finished;
status.admission.clusterQueue and podSetAssignments[].flavors; status.admissionChecks[].state and message; the
Workload's controller ownerReference is its JobSet, pkg/controller/jobframework/reconciler.go); core/v1 Pod
(status.phase, conditions PodScheduled / DisruptionTarget, containerStatuses[].state and lastState).
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from envspec.config import EnvironmentSpec
from envspec.pod import RESTART_EXIT_CODES, exit_code_meaning

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"  # the label JobSet puts on its Jobs and pods
# One kubectl call: what the screen needs (full names: no short name can resolve to another group's type).
KINDS = ("jobsets.jobset.x-k8s.io", "workloads.kueue.x-k8s.io", "pods", "events")


class StatusError(Exception):
    """kubectl could not read the cluster; the message is kubectl's own, with what to try."""


@dataclass
class Objects:
    """The namespace's objects by kind, as the API server returned them."""

    items: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return self.items.get(kind, [])


def kubectl_argv(namespace: str, context: str | None = None, kubeconfig: str | None = None) -> list[str]:
    argv = ["kubectl", "get", ",".join(KINDS), "-n", namespace, "-o", "json"]
    if context:
        argv += ["--context", context]
    if kubeconfig:
        argv += ["--kubeconfig", kubeconfig]
    return argv


def read(namespace: str, context: str | None = None, kubeconfig: str | None = None) -> Objects:
    argv = kubectl_argv(namespace, context, kubeconfig)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise StatusError("kubectl is not on PATH (gcloud components install kubectl)") from None
    except subprocess.TimeoutExpired:
        raise StatusError(f"`{' '.join(argv)}` did not answer within 120 s") from None
    if done.returncode != 0:
        raise StatusError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    out = Objects()
    for item in json.loads(done.stdout).get("items", []):
        out.items.setdefault(item.get("kind", ""), []).append(item)
    return out


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _true(conds: dict[str, dict[str, Any]], kind: str) -> dict[str, Any] | None:
    c = conds.get(kind)
    return c if c is not None and c.get("status") == "True" else None


def _said(c: dict[str, Any]) -> str:
    return f"{c.get('reason', '')}: {c.get('message', '')}".strip(": ")


def workload_line(wl: dict[str, Any] | None) -> str:
    """Kueue's verdict on one Workload."""
    if wl is None:
        return ("no Kueue Workload (Kueue's jobset integration makes one for a JobSet with the queue-name label: is "
                "the Kueue controller running?)")
    conds = _conditions(wl)
    status = wl.get("status") or {}
    name = wl["metadata"]["name"]
    if c := _true(conds, "Finished"):
        return f"finished ({_said(c)}) [{name}]"
    if c := _true(conds, "Evicted"):
        preempted = _true(conds, "Preempted")
        extra = f"; preempted: {_said(preempted)}" if preempted else ""
        return f"EVICTED, waiting to be admitted again: {_said(c)}{extra} [{name}]"
    if _true(conds, "Admitted"):
        admission = status.get("admission") or {}
        flavors = sorted({f for ps in admission.get("podSetAssignments") or []
                          for f in (ps.get("flavors") or {}).values()})
        ready = _true(conds, "PodsReady")
        pods = "pods ready" if ready else "pods not all ready yet"
        return (f"admitted by cluster queue {admission.get('clusterQueue', '?')}, flavor "
                f"{', '.join(flavors) or '?'}; {pods} [{name}]")
    if _true(conds, "QuotaReserved"):
        checks = [f"{c.get('name')}={c.get('state')}" + (f" ({c['message']})" if c.get("message") else "")
                  for c in status.get("admissionChecks") or [] if c.get("state") != "Ready"]
        return f"PENDING: quota reserved, waiting for admission checks: {'; '.join(checks) or '?'} [{name}]"
    c = conds.get("QuotaReserved")
    if c is None:
        return f"PENDING: not yet evaluated by Kueue's scheduler [{name}]"
    return f"PENDING: {_said(c)} [{name}]"


def jobset_line(js: dict[str, Any]) -> tuple[str, str]:
    """(state, restarts) of a JobSet."""
    conds = _conditions(js)
    status = js.get("status") or {}
    max_restarts = ((js.get("spec") or {}).get("failurePolicy") or {}).get("maxRestarts", 0)
    counted = int(status.get("restartsCountTowardsMax") or 0)
    restarts = f"restarts {int(status.get('restarts') or 0)}, {counted} of maxRestarts {max_restarts} counted"
    # JobSet fails instead of restarting once restartsCountTowardsMax >= maxRestarts (restartJobSetActionApplier).
    if counted >= max_restarts:
        restarts += " (the next counted failure fails the JobSet)"
    elif counted == max_restarts - 1:
        restarts += " (one restart left)"
    for kind in ("Failed", "Completed"):
        if c := _true(conds, kind):
            return f"{kind.upper()}: {_said(c)}", restarts
    if (c := _true(conds, "Suspended")) or (js.get("spec") or {}).get("suspend"):
        return "SUSPENDED (Kueue has not admitted it)", restarts
    if c := _true(conds, "RestartingJobSet"):
        return f"RESTARTING: {_said(c)}", restarts
    return "active", restarts


def _pending_why(pod: dict[str, Any], events: list[dict[str, Any]]) -> str | None:
    """Why a pod is not running yet: the scheduler's condition, a waiting container, or its last warning event."""
    conds = _conditions(pod)
    scheduled = conds.get("PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        return _said(scheduled)
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            return f"container {cs['name']}: {_said(waiting)}"
    name = pod["metadata"]["name"]
    warnings = [e for e in events if (e.get("involvedObject") or {}).get("name") == name and e.get("type") == "Warning"]
    if warnings:
        last = max(warnings, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return _said(last)
    return None


def _exits(pod: dict[str, Any]) -> list[str]:
    """Each terminated container's exit code (now, or its last run), with its meaning."""
    lines = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        for when in ("state", "lastState"):
            done = (cs.get(when) or {}).get("terminated")
            if done is None:
                continue
            code = int(done.get("exitCode", 0))
            effect = "" if code == 0 else (" -> the JobSet restarts" if code in RESTART_EXIT_CODES
                                           else " -> the JobSet fails (no restart)")
            reason = f" [{done['reason']}]" if done.get("reason") else ""
            lines.append(f"last exit: {pod['metadata']['name']} {cs['name']}: exit {code}{reason}: "
                         f"{exit_code_meaning(code)}{effect}")
            break
    disrupted = _true(_conditions(pod), "DisruptionTarget")
    if disrupted:
        lines.append(f"disrupted: {pod['metadata']['name']}: {_said(disrupted)}")
    return lines


def report(spec: EnvironmentSpec, objects: Objects, where: str = "") -> str:
    """The one screen."""
    ns = spec.queues.namespace
    lines = [f"status: {spec.env}  (namespace {ns}{', ' + where if where else ''})"]
    jobsets = {j["metadata"]["name"]: j for j in objects.of("JobSet")}
    expected = {}
    if spec.trainer.enabled and spec.trainer.launcher == "jobset":
        expected[spec.trainer.name] = "trainer"
    if spec.service is not None:
        expected[spec.service_engine_name] = "service engine"
    workloads: dict[tuple[str, str], dict[str, Any]] = {}
    for wl in objects.of("Workload"):
        for ref in wl["metadata"].get("ownerReferences") or []:
            if ref.get("controller"):
                workloads[ref["kind"], ref["name"]] = wl
    events = [e for e in objects.of("Event") if (e.get("involvedObject") or {}).get("kind") == "Pod"]
    pods: dict[str, list[dict[str, Any]]] = {}
    for pod in objects.of("Pod"):
        pods.setdefault((pod["metadata"].get("labels") or {}).get(JOBSET_NAME, ""), []).append(pod)
    for name in sorted(set(jobsets) | set(expected)):
        role = f" ({expected[name]})" if name in expected else ""
        js = jobsets.get(name)
        if js is None:
            lines.append(f"JobSet {name}{role}: NOT FOUND (not created yet by `pulumi up`, or deleted)")
            continue
        state, restarts = jobset_line(js)
        lines.append(f"JobSet {name}{role}: {state}; {restarts}")
        lines.append(f"  Kueue: {workload_line(workloads.get(('JobSet', name)))}")
        mine = pods.get(name, [])
        phases = Counter((p.get("status") or {}).get("phase", "Unknown") for p in mine)
        want = sum(int(rj.get("replicas", 1)) * int(rj["template"]["spec"].get("parallelism", 1))
                   for rj in js["spec"].get("replicatedJobs", []))
        lines.append(f"  pods: {', '.join(f'{n} {p}' for p, n in sorted(phases.items())) or 'none'} "
                     f"(the JobSet runs {want})")
        whys = Counter(why for p in mine if (p.get("status") or {}).get("phase") == "Pending"
                       for why in [_pending_why(p, events)] if why)
        for why, n in whys.most_common(3):
            lines.append(f"  pending ({n} pod{'s' if n > 1 else ''}): {why}")
        for exit_line in [x for p in sorted(mine, key=lambda p: p["metadata"]["name"]) for x in _exits(p)][:4]:
            lines.append(f"  {exit_line}")
    others = [wl for key, wl in workloads.items() if key[0] != "JobSet"]
    for wl in sorted(others, key=lambda w: w["metadata"]["name"]):
        ref = next(r for r in wl["metadata"]["ownerReferences"] if r.get("controller"))
        lines.append(f"{ref['kind']} {ref['name']}: Kueue: {workload_line(wl)}")
    if len(lines) == 1:
        lines.append("nothing of this environment in the namespace")
    return "\n".join(lines) + "\n"
