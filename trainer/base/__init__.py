"""The trainer's bottom floor: its typed config (YAML + overrides), the bundled model presets, and the user's own code
(trainer.code). Imports no other trainer floor (docs/architecture.md)."""
