from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from trainer.base.config import ModelConfig, OptimConfig
from trainer.model import decoder as M
from trainer.model.sharding import (
    DATA_AXES,
    batch_sharding,
    logical_to_spec,
    make_mesh,
    named_shardings,
    opt_state_shardings,
    regroup,
)
from trainer.rl.batch import from_rows, local_rows, process_rows, read_local_rows
from trainer.rl.optim import make_optimizer

from .conftest import TINY_MODEL


def test_mesh_axes_are_auto() -> None:
    mesh = make_mesh(2, 2, 2)
    assert mesh.axis_names == ("slices", "fsdp", "tensor")
    assert dict(mesh.shape) == {"slices": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3


def test_regroup_keeps_the_devices_in_order() -> None:
    """The sampler's mesh: each slice's fsdp x tensor devices as (fsdp x tensor / t, t), the same devices in the same
    order (one program may take arrays on the one and compute on the other), the new tensor axis whole old tensor
    groups of neighbouring fsdp rows."""
    mesh = make_mesh(2, 2, 2)
    same = regroup(mesh, None)
    assert same is mesh and regroup(mesh, 2) is mesh
    wide = regroup(mesh, 4)
    assert dict(wide.shape) == {"slices": 2, "fsdp": 1, "tensor": 4}
    assert list(wide.devices.flat) == list(mesh.devices.flat)
    assert list(wide.devices[1, 0]) == [*mesh.devices[1, 0], *mesh.devices[1, 1]]
    assert wide.axis_types == mesh.axis_types


def test_rule_table() -> None:
    assert logical_to_spec(("layers", "embed", "q_heads", "head_dim")) == P(None, "fsdp", "tensor", None)
    assert logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert logical_to_spec(("layers", "mlp", "embed")) == P(None, "tensor", "fsdp")
    assert logical_to_spec(("batch", "seq", None)) == P(DATA_AXES, None, None)
    # A mesh axis is used once per array: embed cannot take fsdp when batch already did.
    assert logical_to_spec(("batch", "seq", "embed")) == P(DATA_AXES, None, None)


def test_indivisible_dim_is_replicated() -> None:
    mesh = make_mesh(1, 2, 4)
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 32, 2, 8), mesh) == \
        P(None, "fsdp", None, None)
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 32, 4, 8), mesh) == \
        P(None, "fsdp", "tensor", None)


def test_params_and_adam_moments_share_shardings() -> None:
    cfg = ModelConfig(**TINY_MODEL)
    mesh = make_mesh(2, 2, 2)
    abstract = M.abstract_params(cfg)
    p_sh = named_shardings(mesh, M.param_axes(cfg), abstract)
    assert p_sh["layers"]["wq"].spec == P(None, "fsdp", "tensor", None)
    assert p_sh["final_norm"].spec == P(None)
    opt = make_optimizer(OptimConfig(), total_steps=10)
    o_sh = opt_state_shardings(mesh, opt, p_sh, abstract)
    adam = o_sh[1][0]  # chain(clip, adamw) -> adamw = (scale_by_adam, ...)
    assert adam.mu["layers"]["w_up"].spec == p_sh["layers"]["w_up"].spec
    assert adam.nu["embed"].spec == p_sh["embed"].spec
    assert adam.count.spec == P()
    # The shardings are usable as jit out_shardings for a real optimizer init.
    params = jax.jit(M.init_params, static_argnums=0, out_shardings=p_sh)(cfg, jax.random.PRNGKey(0))
    state = jax.jit(opt.init, out_shardings=o_sh)(params)
    assert state[1][0].mu["layers"]["wq"].sharding == p_sh["layers"]["wq"]


def test_batch_rows_roundtrip_through_global_array() -> None:
    mesh = make_mesh(2, 2, 2)
    rows = process_rows(mesh, 8)
    assert rows == list(range(8))  # one process holds every row
    assert local_rows(batch_sharding(mesh, 2), 8) == rows
    values = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    arr = from_rows(mesh, rows, values, (8, 3))
    assert arr.sharding.spec == P(DATA_AXES, None)
    np.testing.assert_array_equal(np.asarray(arr), values)
    got = read_local_rows(arr)
    assert sorted(got) == rows and all((got[r] == values[r]).all() for r in rows)


def test_split_devices_by_slice_within_processes_or_in_order() -> None:
    """placement.mode=split's device groups: whole slices; else each process's first devices train (both groups on
    every process, as the cross-process push needs); else in (process, id) order."""
    from types import SimpleNamespace

    from trainer.base.placement import split_devices

    def devs(n_proc: int, per: int, slices: int = 1) -> list[SimpleNamespace]:
        return [SimpleNamespace(id=p * per + i, process_index=p, slice_index=p * slices // n_proc)
                for p in range(n_proc) for i in range(per)]

    ids = lambda group: [d.id for d in group]  # noqa: E731
    a, b = split_devices(devs(4, 2, slices=2), 4, 4, first_slices=1)
    assert (ids(a), ids(b)) == ([0, 1, 2, 3], [4, 5, 6, 7])  # slice 0 trains, slice 1 samples
    a, b = split_devices(devs(2, 4), 4, 4)
    assert (ids(a), ids(b)) == ([0, 1, 4, 5], [2, 3, 6, 7])
    a, b = split_devices(devs(1, 8), 6, 2)
    assert (ids(a), ids(b)) == ([0, 1, 2, 3, 4, 5], [6, 7])
    with pytest.raises(ValueError, match="each group must take whole slices"):
        split_devices(devs(4, 2, slices=2), 2, 6, first_slices=1)
