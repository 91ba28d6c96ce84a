"""The engine (see engine/loop.py): the names its callers import (trainer/service/cli.py, the tests)."""

from trainer.service.engine.loop import (
    MODEL_STATE_LOST,
    Engine,
    UserError,
    recover,
    resolve_base_model,
    run_follower,
    state_root,
)

__all__ = ["MODEL_STATE_LOST", "Engine", "UserError", "recover", "resolve_base_model", "run_follower", "state_root"]
