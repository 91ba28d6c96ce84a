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


def test_values_cross_the_coordination_service_without_pickle() -> None:
    """What an agreement sends is JSON with arrays as .npy (allow_pickle=False): the bits, dtypes, shapes and the tree
    (tuples stay tuples, numpy scalars stay scalars) come back, and anything else is refused when sent."""
    import numpy as np

    from trainer.rl.agree import decode, encode

    value = {"loss": np.float32(0.1), "tokens": np.arange(6, dtype=np.int32).reshape(2, 3), "none": None,
             "flags": [True, 3, 2.5, "s"], "pair": (np.bool_(True), np.zeros((0,), np.uint32))}
    back = decode(encode(value))
    assert isinstance(back["pair"], tuple) and isinstance(back["flags"], list) and back["none"] is None
    assert back["flags"] == [True, 3, 2.5, "s"]
    assert isinstance(back["loss"], np.float32) and back["loss"].tobytes() == value["loss"].tobytes()
    for got, sent in ((back["tokens"], value["tokens"]), (back["pair"][1], value["pair"][1])):
        assert got.dtype == sent.dtype and got.shape == sent.shape and got.tobytes() == sent.tobytes()
    assert b"pickle" not in encode(value) and encode(value).startswith(b"{")
    with pytest.raises(TypeError, match="cannot send a object"):
        encode(object())
    with pytest.raises(TypeError, match="dict keys must be strings"):
        encode({1: 2})
