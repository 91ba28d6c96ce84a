"""The processes' agreement on host values (trainer/rl/agree.py) goes through the coordination service, so it cannot
cross a device program's collectives. Before, the stop flag's agreement was jax.experimental.multihost_utils's
process_allgather: with 2 CPU devices per process and a program over each process's second device started right after
it (the sampling, with placement split within each host), gloo aborted with "Received data size doesn't match expected
size" (issue 43; 4 processes x 2 devices failed on the first try here)."""

from __future__ import annotations

import pytest

from trainer.run.launch import run_local


@pytest.mark.long  # ~20-40 s on 2 cores: 4 processes
def test_agreement_does_not_cross_a_running_program() -> None:
    assert run_local(4, 2, [], module="tests.trainer.agree_worker") == 0
