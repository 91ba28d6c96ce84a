"""The eval of a saved checkpoint (`gke-tpu-rl eval RUN_DIR --step N`): the run set up as training sets it up (its
mesh, task, programs), the weights of checkpoint N restored, and the held-out eval run on them. With the run's own
config and mesh it repeats the scores the run logged after that step (trainer/rl/evaluate.py: the eval's noise does
not depend on the step)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.base.config import ConfigError, TrainConfig
from trainer.rl.checkpoint import CheckpointDamaged, Checkpointer
from trainer.rl.evaluate import Evaluator
from trainer.rl.train import checkpoint_dir, start_run


@dataclass(frozen=True)
class CheckpointEval:
    step: int  # the checkpoint's completed steps
    directory: Path  # the checkpoint folder it was read from
    scores: dict[str, float]


def evaluate_checkpoint(cfg: TrainConfig, step: int | None = None) -> CheckpointEval:
    """Score checkpoint `step` (default: the newest) of the run `cfg` describes with `cfg.eval` (its defaults when
    unset). JAX must already be initialised for this process; every process calls it. Raises ConfigError when there
    is no such checkpoint or it is damaged."""
    where = checkpoint_dir(cfg, Path(cfg.run_dir))
    if not where.is_dir():
        raise ConfigError(f"no checkpoint folder {where} (checkpoint.dir, else $CHECKPOINT_DIR, else "
                          "<run_dir>/checkpoints)")
    run = start_run(cfg)
    ckpt = Checkpointer(where, every=0, keep=cfg.checkpoint.keep, async_save=False)
    try:
        steps = ckpt.steps()
        if not steps:
            raise ConfigError(f"no finished checkpoint in {where}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ConfigError(f"--step {step}: no checkpoint of that step in {where}; there are steps "
                              f"{', '.join(map(str, steps))}")
        try:
            state, _ = ckpt.restore(run.saved_target, step)
        except CheckpointDamaged as err:
            raise ConfigError(f"{err} ({where})") from None
    finally:
        ckpt.close()
    params = run.params_of(state, step, where)
    run.params = run.opt_state = None  # type: ignore[assignment]  # the fresh state is not needed: free it
    evaluator = Evaluator(run.cfg, run.data, run.mesh, run.programs)
    return CheckpointEval(step, where, evaluator(params))
