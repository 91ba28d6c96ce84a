"""The floor every other package reads: the typed environment spec and the facts it is checked against.

- tpu.py: the one TPU catalog (generations, topologies, machine types, per-chip figures)
- machines.py: Compute Engine machine types and what GKE leaves of them to pods
- zones.py (+ tpu_zones.yaml): which zones offer each TPU generation
- rules.py: what GCP, Kubernetes, Helm and registries accept
- repo.py: paths inside this repository that the spec names (trainer.code)
- config.py: stack config in, a validated EnvironmentSpec out (parse_spec, ConfigError, the checks across sections)
- sections/: one typed model per section of the stack file (network, cluster, slices, storage, queues, trainer,
  service), with fields.py, what they share
- pod.py, engine_args.py: the pod contract (env names, exit codes, paths; the engine's argument parser)

Data flows one way: config -> this spec -> components (infra/, workloads/, a Terraform renderer) -> objects. The
trainer image holds this package beside trainer/ (trainer/Dockerfile), so the trainer reads the same catalog. Nothing
here imports infra, workloads, trainer or Pulumi (tests/test_layers.py): what the spec needs from the trainer (its
bundled configs) is passed in, see config.parse_spec.
"""
