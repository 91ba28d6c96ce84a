"""Sharded JAX GRPO/GSPO trainer: `gke-tpu-rl train` / `python -m trainer`.

Importing the package does not touch JAX devices, so `trainer.run.distributed` can still configure the backend. It
does install one import hook: the flat module names of before the floors still import (trainer/base/moved.py).
"""

from trainer.base import moved as _moved

_moved.install()
