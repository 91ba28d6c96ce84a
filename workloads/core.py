"""Core objects of the workload namespace: the namespace itself and the trainer's service account."""

from __future__ import annotations

from typing import Any

from workloads.labels import MANAGED_BY, WORKLOAD_IDENTITY_GSA


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(MANAGED_BY)}}


def service_account(name: str, namespace: str, gsa_email: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)}
    if gsa_email:
        meta["annotations"] = {WORKLOAD_IDENTITY_GSA: gsa_email}
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
