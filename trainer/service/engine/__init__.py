"""The engine (see engine/loop.py): the names its callers import (trainer/service/cli.py, the tests)."""

from trainer.service.engine.batches import Accepted
from trainer.service.engine.common import (
    MODEL_STATE_LOST,
    Outcome,
    UserError,
    prepare,
    recover,
    resolve_base_model,
    run_follower,
    state_root,
)
from trainer.service.engine.loop import Engine

__all__ = ["MODEL_STATE_LOST", "Accepted", "Engine", "Outcome", "UserError", "prepare", "recover", "resolve_base_model",
           "run_follower", "state_root"]
