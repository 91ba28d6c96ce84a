"""Turns the plain objects from workloads/ into pulumi_kubernetes resources (typed where one exists)."""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_kubernetes as k8s


def resource_name(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    ns = f"{meta['namespace']}-" if meta.get("namespace") else ""
    return f"{obj['kind'].lower()}-{ns}{meta['name']}"


class KubernetesObject(pulumi.CustomResource):
    """Any custom-resource object, all top-level fields kept (Kueue's WorkloadPriorityClass has no spec)."""

    def __init__(self, name: str, obj: dict[str, Any], opts: pulumi.ResourceOptions) -> None:
        # The same type token pulumi_kubernetes' CustomResource registers: kubernetes:<apiVersion>:<Kind>.
        super().__init__(f"kubernetes:{obj['apiVersion']}:{obj['kind']}", name, dict(obj), opts)


def apply(obj: dict[str, Any], opts: pulumi.ResourceOptions) -> pulumi.CustomResource:
    name, kind = resource_name(obj), obj["kind"]
    if kind == "Namespace":
        return k8s.core.v1.Namespace(name, metadata=obj["metadata"], opts=opts)
    if kind == "ServiceAccount":
        return k8s.core.v1.ServiceAccount(name, metadata=obj["metadata"], opts=opts)
    if kind == "Secret":
        return k8s.core.v1.Secret(name, metadata=obj["metadata"], type=obj.get("type"),
                                  string_data=obj.get("stringData"), opts=opts)
    if kind == "ResourceClaimTemplate":
        return k8s.resource.v1.ResourceClaimTemplate(name, metadata=obj["metadata"], spec=obj["spec"], opts=opts)
    return KubernetesObject(name, obj, opts)
