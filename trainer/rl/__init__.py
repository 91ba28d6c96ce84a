"""The RL floor: the sampler, tasks and rewards, losses, the jitted step, the optimizer, checkpoints, metrics and the
train loop. Imports only trainer.base and trainer.model below it (docs/architecture.md)."""
