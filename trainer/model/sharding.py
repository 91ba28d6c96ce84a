"""Device mesh and the single logical-axis -> mesh-axis rule table.

Mesh axes: "slices" (data parallel across slices / processes, over DCN), "fsdp" (data parallel + parameter
sharding within a slice), "tensor" (attention heads / MLP / vocab). Parameters and activations name logical
axes; `RULES` alone decides where each lands, for params and optimizer state alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES: tuple[str, str, str] = ("slices", "fsdp", "tensor")
DATA_AXES: tuple[str, str] = ("slices", "fsdp")

MeshAxes = str | tuple[str, ...] | None

# Ordered: the first rule for a logical name wins. A mesh axis is used at most once per array.
RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", DATA_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    ("head_dim", None),
    ("seq", None),
    ("cache_seq", None),
    # LoRA adapters (trainer/model/lora.py): their in/out dims take the base weight's names, so they shard like it; the
    # slot stack and the rank are small and replicated.
    ("lora_slots", None),
    ("lora_rank", None),
)
# `mesh.fsdp_across_slices`: parameters (and so optimizer state) also shard over the slice axis, ZeRO-3 style
# over DCN. Halves per-chip state on 2 slices; costs a DCN all-gather of the weights every forward and backward.
RULES_ACROSS_SLICES: tuple[tuple[str, MeshAxes], ...] = (("embed", ("slices", "fsdp")), *RULES)


# `sampling.gather_weights`: the sampler's copy of the weights is replicated over fsdp (still split over tensor), so
# decode steps run data-parallel over fsdp with no per-token all-gather of the weights.
RULES_GATHERED: tuple[tuple[str, MeshAxes], ...] = (("embed", None), *RULES)


def _rule_map(rules: Sequence[tuple[str, MeshAxes]]) -> dict[str, MeshAxes]:
    out: dict[str, MeshAxes] = {}
    for name, axes in rules:
        out.setdefault(name, axes)
    return out


_RULE_MAP = _rule_map(RULES)


def make_mesh(slices: int, fsdp: int, tensor: int, devices: Sequence[Any] | None = None) -> Mesh:
    """Build the (slices, fsdp, tensor) mesh.

    Axis types are Auto on purpose: jax 0.10 defaults `make_mesh` to Explicit (sharding in the type system,
    every op must agree), while this trainer places params/inputs with NamedSharding and lets GSPMD propagate,
    nudged by `constrain` on activations. That keeps the model code free of per-op sharding annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = (slices, fsdp, tensor)
    types = (AxisType.Auto,) * 3
    if slices > 1 and len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        # TPU multislice: keep fsdp/tensor inside a slice (ICI) and only the slice axis over DCN.
        arr = mesh_utils.create_hybrid_device_mesh((1, fsdp, tensor), (slices, 1, 1), devices)
        return Mesh(arr, MESH_AXES, axis_types=types)
    # Process-major order, so on CPU/GPU multi-process the leading (slices) axis follows processes.
    devices.sort(key=lambda d: (d.process_index, d.id))
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except NotImplementedError:
        # A tensor axis no product of the torus's axes (placement.sampler tensor 8 on a 4x4 slice): the devices in
        # jax's order for (slices, fsdp x tensor), regrouped as `regroup` does (tensor over neighbouring fsdp rows).
        flat = jax.make_mesh((slices, fsdp * tensor, 1), MESH_AXES, axis_types=types, devices=devices)
        return Mesh(flat.devices.reshape(shape), MESH_AXES, axis_types=types)
    except AssertionError:
        # TPU devices that are no box of the slice's torus (placement split: some chips of every host), which
        # jax's physical-mesh ordering asserts against: laid out in that (process, id) order instead.
        return Mesh(np.array(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=types)


def regroup(mesh: Mesh, tensor: int | None) -> Mesh:
    """`mesh` with each slice's fsdp x tensor devices regrouped as (fsdp x tensor / `tensor`, `tensor`): the same
    devices in the same order, so one program may take arrays on `mesh` and reshard them onto this one. The new
    tensor axis joins whole groups of the old one across neighbouring fsdp rows (ICI neighbours on a TPU slice)."""
    s, f, t = (mesh.shape[a] for a in MESH_AXES)
    if tensor is None or tensor == t:
        return mesh
    return Mesh(mesh.devices.reshape(s, f * t // tensor, tensor), MESH_AXES, axis_types=mesh.axis_types)


class MeshJit:
    """jax.jit(fn, **kw) called and lowered under `jax.set_mesh(mesh)`, so the model's `constrain` hints see the mesh
    (set_mesh cannot be entered inside a jitted function)."""

    def __init__(self, mesh: Mesh, fn: Any, **kw: Any) -> None:
        self.mesh, self.jitted = mesh, jax.jit(fn, **kw)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.jitted(*args, **kw)

    def lower(self, *args: Any, **kw: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args, **kw)


def _mesh_size(mesh: Mesh | jax.sharding.AbstractMesh, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in names]))


def data_size(mesh: Mesh | jax.sharding.AbstractMesh) -> int:
    """Devices the batch is split over (slices x fsdp): the data-parallel groups."""
    return _mesh_size(mesh, DATA_AXES)


def kernel_shard_axes(mesh: Mesh | jax.sharding.AbstractMesh, rows: int, q_heads: int, kv_heads: int
                      ) -> tuple[MeshAxes, MeshAxes]:
    """How an attention kernel runs per shard (shard_map): rows over the data axes and heads over tensor, each only
    where it divides (else that dimension is whole on every shard)."""
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if q_heads % tensor == 0 and kv_heads % tensor == 0 else None
    return (DATA_AXES if rows % data_size(mesh) == 0 else None), heads


def logical_to_spec(
    logical: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | jax.sharding.AbstractMesh | None = None,
    rules: Sequence[tuple[str, MeshAxes]] = RULES,
) -> P:
    """Map logical axis names to a PartitionSpec via `rules` (default RULES).

    With `shape` and `mesh`, a dimension the mesh axes do not divide is replicated instead (e.g. 2 KV heads on
    tensor=4), so any model fits any mesh; the cost is only memory/compute duplication on that dim.
    """
    rule_map = _RULE_MAP if rules is RULES else _rule_map(rules)
    used: set[str] = set()
    out: list[MeshAxes] = []
    for i, name in enumerate(logical):
        axes = rule_map.get(name) if name is not None else None
        names = () if axes is None else ((axes,) if isinstance(axes, str) else axes)
        if any(a in used for a in names):
            axes, names = None, ()
        if axes is not None and shape is not None and mesh is not None and shape[i] % _mesh_size(mesh, axes):
            axes, names = None, ()
        used.update(names)
        out.append(axes)
    return P(*out)


def is_axes_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def named_shardings(
    mesh: Mesh, axes_tree: Any, shapes_tree: Any, rules: Sequence[tuple[str, MeshAxes]] = RULES
) -> Any:
    """Logical-axes tree + matching shapes (arrays or ShapeDtypeStructs) -> NamedSharding tree."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules)),
        axes_tree,
        shapes_tree,
        is_leaf=is_axes_leaf,
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading dim over the data axes, the rest replicated."""
    return NamedSharding(mesh, P(DATA_AXES, *([None] * (ndim - 1))))


def opt_state_shardings(
    mesh: Mesh, optimizer: optax.GradientTransformation, param_shardings: Any, params_shape: Any
) -> Any:
    """Optimizer-state shardings: param-shaped leaves (Adam moments) follow their param, the rest replicate.

    Some states sit in a param-structured tree without the param's shape (Adafactor's factored row/column
    statistics): those replicate too; they are O(rows + cols), not O(rows x cols).
    """
    state_shape = jax.eval_shape(optimizer.init, params_shape)
    tree = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        state_shape,
        param_shardings,
        transform_non_params=lambda _: replicated(mesh),
    )

    def fits(sharding: NamedSharding, leaf: Any) -> NamedSharding:
        ok = len(sharding.spec) == leaf.ndim and all(
            axes is None or leaf.shape[i] % _mesh_size(mesh, axes) == 0 for i, axes in enumerate(sharding.spec))
        return sharding if ok else replicated(mesh)

    return jax.tree.map(fits, tree, state_shape, is_leaf=lambda x: isinstance(x, NamedSharding))


def split_strided(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B / n, ...] with piece k = rows k, k + n, k + 2n, ...

    With rows sharded in contiguous blocks over the data devices, strided pieces are each spread over all of them
    (given B / n divides over the data axes; see config.resolve_mesh), so a loop over pieces keeps every device busy.
    """
    y = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    return constrain(y, (None, "batch", *[None] * (x.ndim - 1)))


def join_strided(x: jax.Array) -> jax.Array:
    """The inverse of `split_strided`: [n, B / n, ...] -> [B, ...]."""
    y = x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return constrain(y, ("batch", *[None] * (x.ndim - 2)))


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Sharding hint for an activation under the context mesh (`jax.set_mesh`); a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(logical, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)
