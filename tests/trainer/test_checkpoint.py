from __future__ import annotations

import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer.base.config import ModelConfig, OptimConfig
from trainer.model import decoder as M
from trainer.model.sharding import make_mesh, named_shardings, opt_state_shardings
from trainer.rl.checkpoint import Checkpointer, Meta, StopFlag, abstract_like
from trainer.rl.optim import make_optimizer

from .conftest import TINY_MODEL

CFG = ModelConfig(**TINY_MODEL)


def _state_shardings(mesh: jax.sharding.Mesh, opt: object) -> dict:
    abstract = M.abstract_params(CFG)
    p_sh = named_shardings(mesh, M.param_axes(CFG), abstract)
    return {"params": p_sh, "opt_state": opt_state_shardings(mesh, opt, p_sh, abstract)}


def test_save_on_one_mesh_restore_on_another(tmp_path: Path) -> None:
    opt = make_optimizer(OptimConfig(lr=1e-2), total_steps=4)
    src_mesh = make_mesh(2, 2, 2)
    sh = _state_shardings(src_mesh, opt)
    params = jax.jit(M.init_params, static_argnums=0, out_shardings=sh["params"])(CFG, jax.random.PRNGKey(0))
    opt_state = jax.jit(opt.init, out_shardings=sh["opt_state"])(params)
    grads = jax.tree.map(lambda p: 0.01 * p, params)  # one real update so the moments are non-zero
    updates, opt_state = jax.jit(opt.update)(grads, opt_state, params)
    state = {"params": params, "opt_state": opt_state}

    ckpt = Checkpointer(tmp_path / "ckpt", every=2, keep=2)
    assert ckpt.latest_step() is None
    meta = Meta(step=3, data_position=24, rng=[0, 42])
    assert ckpt.save(state, meta)
    assert not ckpt.save(state, meta)  # the same step twice is a no-op
    ckpt.close()

    for shape in [(1, 8, 1), (1, 1, 1)]:
        mesh = make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
        target = abstract_like(state, _state_shardings(mesh, opt))
        restored, got_meta = Checkpointer(tmp_path / "ckpt", every=2, keep=2).restore(target)
        assert got_meta == meta
        assert restored["params"]["layers"]["wq"].sharding.mesh.devices.shape == shape
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_keeps_last_k(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, every=1, keep=2)
    state = {"x": jax.numpy.arange(4.0)}
    for step in (1, 2, 3):
        ckpt.save(state, Meta(step, step, [0, 0]))
    ckpt.wait()
    assert ckpt.latest_step() == 3
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 3]
    assert ckpt.due(3) and not Checkpointer(tmp_path, every=0, keep=2).due(3)
    ckpt.close()


def test_stop_flag_set_by_sigterm_and_repeated_signals_change_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    flag = StopFlag().install()
    try:
        assert not flag.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.agreed()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):  # a Ctrl-C burst plus the launcher's SIGTERM
            os.kill(os.getpid(), sig)
        assert flag.agreed()
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_whether_a_step_is_saved_is_process_0s_answer_everywhere(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A process holding none of the state's arrays (placement split by slice or host) lists the folder where process
    0 asks orbax: should they disagree on a step being saved already, one would skip the checksums' collective that
    the others enter, and the job would hang. So every process takes process 0's answer (a broadcast)."""
    from trainer.rl import checkpoint as C

    (tmp_path / "2").mkdir()
    (tmp_path / "2" / C.COMMIT_MARKER).write_text("")  # this process sees step 2 finished
    ckpt = Checkpointer(tmp_path, every=1, keep=2, holders={1})  # process 0 here plays one holding no array
    assert ckpt.steps() == [2]
    sent: list[int] = []
    entered: list[object] = []
    with monkeypatch.context() as m:
        m.setattr(C.jax, "process_count", lambda: 2)
        m.setattr(C.agree, "broadcast", lambda x, source: sent.append(int(x)) or False)  # process 0: not saved yet
        m.setattr(C, "checksums", lambda state: entered.append(state) or [])
        assert not ckpt.save({"x": jax.numpy.arange(4.0)}, Meta(2, 2, [0, 0]))  # no orbax on this process
    assert sent == [1] and len(entered) == 1  # it asked, then went on with the others
    ckpt.close()
