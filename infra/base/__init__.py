"""The bottom floor of infra/: the stack file and the running stack's config into the typed spec (envspec/config.py),
and what the wings above share: the trainer config as the pod loads it, trainer.code's folder and digest. Imports no
other wing of infra/."""
