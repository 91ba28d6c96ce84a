"""Exit codes are the contract with the JobSet: bugs fail it at once, preemption and transient runtime errors
restart it from the last checkpoint (workloads/jobset.py's podFailurePolicy and failurePolicy)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
import yaml

from trainer.run import cli
from workloads import jobset


def test_the_jobset_restarts_exactly_on_the_trainers_retry_codes() -> None:
    restart = set(jobset.RESTART_EXIT_CODES)
    assert {cli.EXIT_TRANSIENT, cli.EXIT_STOPPED, 137, 134} <= restart
    assert not {0, 1, cli.EXIT_CONFIG} & restart  # a traceback (1) or a bad config (2) is a bug: fail fast
    assert list(jobset.RESTART_EXIT_CODES) == sorted(restart) and len(restart) <= 255  # Kubernetes' limits


@pytest.mark.parametrize(("message", "transient"), [
    ("UNAVAILABLE: failed to connect to all addresses", True),
    ("DEADLINE_EXCEEDED: barrier timed out", True),
    ("ABORTED: megascale peer lost", True),
    ("INVALID_ARGUMENT: shapes do not match", False),
    ("RESOURCE_EXHAUSTED: out of HBM", False),
])
def test_transient_runtime_errors_exit_42_and_bugs_raise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_train_dict: dict, message: str, transient: bool
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**tiny_train_dict, "mesh": {"slices": 1, "fsdp": 1, "tensor": 1}}))

    def failing_train(cfg: object, **kwargs: object) -> None:
        raise jax.errors.JaxRuntimeError(message)

    import trainer.rl.train

    monkeypatch.setattr(trainer.rl.train, "train", failing_train)
    import signal

    before = signal.getsignal(signal.SIGTERM)
    if transient:
        assert cli.main(["--config", str(config)]) == cli.EXIT_TRANSIENT
    else:
        with pytest.raises(jax.errors.JaxRuntimeError):
            cli.main(["--config", str(config)])
    assert signal.getsignal(signal.SIGTERM) == before  # the stop flag is gone again unless a signal came
