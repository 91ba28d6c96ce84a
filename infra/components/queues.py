"""Queues: the workload namespace and the Kueue objects that admit TPU slices."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from envspec.config import EnvironmentSpec
from infra.components.k8s import apply
from workloads import core, kueue


@dataclass(frozen=True)
class QueuesArgs:
    spec: EnvironmentSpec


class Queues(pulumi.ComponentResource):
    def __init__(self, name: str, args: QueuesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:Queues", name, None, opts)
        spec = args.spec
        child = pulumi.ResourceOptions(parent=self)
        self.namespace = apply(core.namespace(spec.queues.namespace), child)
        cluster_scoped = [*kueue.resource_flavors(spec), *kueue.priority_classes(spec),
                          *kueue.flex_start_admission(spec)]
        made = [apply(obj, child) for obj in cluster_scoped]
        cq = apply(kueue.cluster_queue(spec), pulumi.ResourceOptions(parent=self, depends_on=made))
        self.local_queue = apply(kueue.local_queue(spec),
                                 pulumi.ResourceOptions(parent=self, depends_on=[cq, self.namespace]))
        self.cluster_queue_name = spec.queues.cluster_queue
        self.local_queue_name = spec.queues.local_queue
        self.register_outputs({"clusterQueue": self.cluster_queue_name, "localQueue": self.local_queue_name})
