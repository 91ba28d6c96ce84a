"""Storage: the checkpoint bucket, readable and writable by the trainer's Kubernetes service account only."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec
from infra.components.iam import after_pool, workload_principal

# Read, write and delete objects; no bucket administration.
CHECKPOINT_ROLE = "roles/storage.objectUser"
# The Ray head only reads (the driver checks the Hugging Face checkpoint before it starts training).
READER_ROLE = "roles/storage.objectViewer"


@dataclass(frozen=True)
class StorageArgs:
    spec: EnvironmentSpec
    project_number: pulumi.Input[str]
    cluster: pulumi.Resource  # the grants to workload principals wait for it: it creates the pool (iam.after_pool)


class Storage(pulumi.ComponentResource):
    bucket: gcp.storage.Bucket
    url: pulumi.Output[str]

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:Storage", name, None, opts)
        spec, s = args.spec, args.spec.storage
        # A protected bucket outlives `pulumi destroy`: it leaves the state, its checkpoints stay.
        bucket_opts = pulumi.ResourceOptions(parent=self, retain_on_delete=s.protect)

        def bucket(suffix: str, bucket_name: str, *, versioning: bool, soft_delete_days: int,
                   hierarchical: bool = False) -> gcp.storage.Bucket:
            opts = bucket_opts
            if hierarchical:
                # GCS sets a hierarchical namespace only when it creates a bucket, and the provider forces a new
                # bucket on any change to it (terraform-provider-google resource_storage_bucket.go
                # hierarchical_namespace: ForceNew, v6.50 to v7.45). A bucket named explicitly is replaced delete
                # first (pulumi-terraform-bridge nameRequiresDeleteBeforeReplace): retained when protected, the new
                # one then fails on the taken name; otherwise deleted, with every object when forceDestroy. So a
                # bucket created before this keeps its flat namespace: the setting applies on creation only.
                opts = pulumi.ResourceOptions.merge(bucket_opts, pulumi.ResourceOptions(
                    ignore_changes=["hierarchicalNamespace"]))
            return gcp.storage.Bucket(
                f"{name}-{suffix}",
                name=bucket_name,
                project=spec.project,
                location=(s.location or spec.region).upper(),
                uniform_bucket_level_access=True,  # a hierarchical namespace requires it
                public_access_prevention="enforced",
                force_destroy=s.force_destroy,
                versioning=gcp.storage.BucketVersioningArgs(enabled=versioning),
                soft_delete_policy=gcp.storage.BucketSoftDeletePolicyArgs(
                    retention_duration_seconds=soft_delete_days * 86400),
                hierarchical_namespace=gcp.storage.BucketHierarchicalNamespaceArgs(enabled=True)
                if hierarchical else None,
                labels=spec.resource_labels(),
                opts=opts,
            )

        self.bucket = bucket("checkpoints", spec.bucket_name, versioning=s.versioning,
                             soft_delete_days=s.soft_delete_days)
        if spec.trainer.enabled:
            member = workload_principal(args.project_number, spec.project, spec.queues.namespace,
                                        spec.trainer.service_account)
            gcp.storage.BucketIAMMember(
                f"{name}-trainer-object-user", bucket=self.bucket.name, role=CHECKPOINT_ROLE, member=member,
                opts=after_pool(self, args.cluster))
        self.state_bucket: gcp.storage.Bucket | None = None
        if spec.service is not None:
            # The engine replaces each model's state snapshot (about 1 GiB for a rank-32 LoRA of an 8B model, Adam
            # moments included) at every optim_step, and deletes the one before. On the checkpoint bucket, versioning
            # and soft delete would keep every replaced one (TBs a day per active user); here neither is on, so only
            # the latest of each model is stored. Protected as the checkpoint bucket is: it holds the users' state.
            # A hierarchical namespace: the engine publishes each snapshot by renaming its folder
            # (service/engine/snapshots.py _write_dir), which gcsfuse does atomically with one RenameFolder call there,
            # and object by object (a copy of every byte, a partial folder if killed) on a flat bucket.
            self.state_bucket = bucket("service-state", spec.service_state_bucket, versioning=False,
                                       soft_delete_days=0, hierarchical=True)
        if spec.runs_on_ray:
            head = workload_principal(args.project_number, spec.project, spec.queues.namespace,
                                      spec.ray_head_service_account)
            gcp.storage.BucketIAMMember(f"{name}-ray-head-object-viewer", bucket=self.bucket.name, role=READER_ROLE,
                                        member=head, opts=after_pool(self, args.cluster))
        self.url = pulumi.Output.concat("gs://", self.bucket.name)
        self.register_outputs({"url": self.url})
