"""DRANET: the ResourceClaimTemplate that gives each TPU pod one network device per extra network."""

from __future__ import annotations

from typing import Any

from workloads.labels import MANAGED_BY

# GKE installs this DeviceClass when managed DRANET is enabled.
DRANET_DEVICE_CLASS = "netdev.google.com"


def netdev_claim_template(name: str, namespace: str, networks: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "netdev",
                            "exactly": {
                                "deviceClassName": DRANET_DEVICE_CLASS,
                                "allocationMode": "ExactCount",
                                "count": networks,
                            },
                        }
                    ]
                }
            }
        },
    }
