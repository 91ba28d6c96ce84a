"""The sections of a stack file, one typed model each, named for its key (envspec/config.py EnvironmentSpec composes
them and checks what spans several).

- fields.py: the base model every section extends, the field checks several share, the bundled trainer configs
- network.py: `network` (the VPC's ranges, DRANET) · cluster.py: `cluster` (GKE, its system pool, GKE versions)
- slices.py: `slices` (TPU slice groups) · storage.py: `storage` (the checkpoint bucket)
- queues.py: `queues` (Kueue) · trainer.py: `trainer` (the training job, its staging)
- service.py: `service` (the post-training service, its Cloud SQL store, its API's access)
"""
