"""A Tinker-compatible post-training service: `python -m trainer.service` (docs/service.md).

One module per concern: `api` (the HTTP API the tinker SDK speaks), `engine` (claims requests and runs them),
`device` (the engine's device state and ops, in lock step on every host), `programs` (the jitted passes on a stack
of LoRA slots), `passes` (which passes run: the rule `fit` sizes too), `losses` (Tinker's losses), `protocol` (the
API <-> engine contract), `store` (the durable state in SQLAlchemy: sqlite by default, PostgreSQL by URL), `auth`
(API keys), `cli` (the command line; the engine's options are in envspec/engine_args.py, which the stack reads
too). Importing the package touches no database and no accelerator.
"""
