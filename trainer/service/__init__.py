"""A Tinker-compatible post-training service: `python -m trainer.service`.

One module per concern: `store` (the durable state in SQLAlchemy: sqlite by default, PostgreSQL by URL), `auth`
(API keys), `cli` (key administration). Importing the package touches no database and no accelerator.
"""
