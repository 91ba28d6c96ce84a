"""Controllers: JobSet and Kueue from their upstream Helm charts, versions from config."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s
import yaml

from envspec.config import EnvironmentSpec
from workloads import kueue

JOBSET_CHART = "oci://registry.k8s.io/jobset/charts/jobset"
KUEUE_CHART = "oci://registry.k8s.io/kueue/charts/kueue"
# Keep the controllers on the CPU system pool, never on TPU hosts.
SYSTEM_POOL_SELECTOR = {"gke-tpu-rl/pool": "system"}


@dataclass(frozen=True)
class ControllersArgs:
    spec: EnvironmentSpec


class Controllers(pulumi.ComponentResource):
    jobset: k8s.helm.v3.Release
    kueue: k8s.helm.v3.Release

    def __init__(self, name: str, args: ControllersArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:Controllers", name, None, opts)
        c = args.spec.controllers
        child = pulumi.ResourceOptions(parent=self)
        self.jobset = k8s.helm.v3.Release(
            f"{name}-jobset", name="jobset", chart=JOBSET_CHART, version=c.jobset_version,
            namespace=c.namespace, create_namespace=True, atomic=True,
            values={"controller": {"nodeSelector": SYSTEM_POOL_SELECTOR}}, opts=child)
        # Kueue's JobSet integration needs the JobSet CRDs first.
        self.kueue = k8s.helm.v3.Release(
            f"{name}-kueue", name="kueue", chart=KUEUE_CHART, version=c.kueue_version,
            namespace=c.namespace, create_namespace=True, atomic=True,
            values={"controllerManager": {"nodeSelector": SYSTEM_POOL_SELECTOR},
                    # This chart version's own default config (restated per version in workloads/kueue.py; config
                    # validation refuses a version it lacks) plus the DRANET DeviceClass mapping, without which
                    # Kueue never admits a JobSet whose pods claim DRANET devices.
                    "managerConfig": {"controllerManagerConfigYaml": yaml.safe_dump(
                        kueue.manager_config(args.spec), sort_keys=False)}},
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.jobset]))
        self.register_outputs({"jobset": self.jobset.status, "kueue": self.kueue.status})
