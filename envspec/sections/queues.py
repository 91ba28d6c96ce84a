"""The `queues` section: Kueue's namespace, queues and priority classes for the training job and the service's
engine."""

from __future__ import annotations

from pydantic import Field, field_validator

from envspec import rules
from envspec.sections.fields import _Model


class QueuesSpec(_Model):
    namespace: str = Field("rl", description="namespace of the LocalQueue and the training job (its pods, service "
                           "accounts and Hugging Face token secret)")
    cluster_queue: str = Field("tpu-cluster-queue", description="name of the Kueue ClusterQueue that holds the TPU "
                               "quota")
    local_queue: str = Field("tpu", description="name of the Kueue LocalQueue the training job is queued in")
    priority_classes: dict[str, int] = Field(
        default_factory=lambda: {"low": 100, "default": 500, "high": 1000},
        description="Kueue WorkloadPriorityClasses: name to priority value (int32); trainer.priority names one")

    @field_validator("namespace", "local_queue")
    @classmethod
    def _dns(cls, v: str) -> str:
        # The local queue's name is also the JobSet's kueue.x-k8s.io/queue-name label value.
        return rules.dns_label(v)

    @field_validator("cluster_queue")
    @classmethod
    def _subdomain(cls, v: str) -> str:
        return rules.dns_subdomain(v)

    @field_validator("priority_classes")
    @classmethod
    def _priorities(cls, v: dict[str, int]) -> dict[str, int]:
        for name, value in v.items():
            # A WorkloadPriorityClass name, and the JobSet's kueue.x-k8s.io/priority-class label value.
            rules.dns_label(name, what="a priority class name (DNS-1123 label)")
            if not rules.INT32_MIN <= value <= rules.INT32_MAX:
                raise ValueError(f"{name!r}: {value} is outside Kueue's int32 priority range "
                                 f"[{rules.INT32_MIN}, {rules.INT32_MAX}]")
        return v
