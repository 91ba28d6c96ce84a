"""The preflight floor (`fit`): compiles the trainer's and the service's own programs for a TPU slice and estimates
what they need. The top floor: imports every floor below it, and none imports it (docs/architecture.md)."""
