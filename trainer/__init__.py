"""Sharded JAX GRPO/GSPO trainer: `gke-tpu-rl train` / `python -m trainer`.

Importing the package does not touch JAX devices, so `trainer.run.distributed` can still configure the backend.
"""
