"""Moving arrays between two disjoint device groups of one job (placement.mode=split: the trainer's, the sampler's),
device to device.

In one process `jax.device_put` onto the other group's sharding does it. Across processes jax 0.10.2 refuses that
("input and target sharding should have the same set of devices"), and one jitted program cannot take operands and
give outputs on two meshes. So there a `Bridge` runs one program over the union of both groups: the source's shards
and zeros on the other group form one array on a (group, *axes) mesh, twice as long in its first dimension (the
group is that dimension's major sharding axis, so the source's shards are its buffers as they are: `union_layout`),
and a jitted swap of its halves (a collective permute, `swap`) lands each shard on its partner, the other group's
device at the same place of the mesh (of the same process where each process holds devices of both groups, else on
another process: `_partners`), as a buffer of the shard's own shape; the landed shards, re-wrapped on that group's
devices with no copy, then take the target layout with a device_put within that device set (which jax allows
across processes). A process holding devices of one group only takes part in the permute with its
own row and gets arrays with no shard of its own for the other group (jax allows that: they are placeholders for the
programs it calls). Needs groups of equal size (bench/async_rl_push.py measures the mechanisms).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

GROUP_AXIS = "group"


def _partners(mesh: Mesh, others: list[Any]) -> np.ndarray:
    """`others` laid out in `mesh`'s device shape. Where each process holds as many devices of both groups (a split
    within each host), each at the place of a device of its own process (no hop between hosts); else (a split by slice
    or host: a process holds one group's devices) in order, the k-th of `others` in (process, id) order at the k-th
    place of `mesh` in its own (process, id) order, so that each trainer host pairs with one sampler host."""
    def by_process(devices: Any) -> dict[int, list[Any]]:
        pool: dict[int, list[Any]] = {}
        for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
            pool.setdefault(d.process_index, []).append(d)
        return pool

    out = np.empty(mesh.devices.shape, dtype=object)
    mine, theirs = by_process(mesh.devices.flat), by_process(others)
    if {p: len(v) for p, v in mine.items()} == {p: len(v) for p, v in theirs.items()}:
        for idx, d in np.ndenumerate(mesh.devices):
            out[idx] = theirs[d.process_index].pop(0)
        return out
    place = {d: i for i, d in enumerate(d for p in sorted(mine) for d in mine[p])}
    ordered = [d for p in sorted(theirs) for d in theirs[p]]
    for idx, d in np.ndenumerate(mesh.devices):
        out[idx] = ordered[place[d]]
    return out


def _spec(x: jax.Array) -> P:
    sharding = x.sharding
    assert isinstance(sharding, NamedSharding)  # the trainer lays every array out by name
    return sharding.spec


def union_layout(shape: tuple[int, ...], spec: P, union: Mesh) -> tuple[tuple[int, ...], NamedSharding]:
    """The shape and sharding on the (group, *axes) `union` mesh of an array of `shape` laid out by `spec`, with one
    copy per group: its first dimension doubled, the group its major sharding axis, so that each device's buffer is
    the shard it holds in its own group (a 0-d array: [2])."""
    if not shape:
        return (2,), NamedSharding(union, P(GROUP_AXIS))
    first = spec[0] if len(spec) else None
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return (2 * shape[0], *shape[1:]), NamedSharding(union, P((GROUP_AXIS, *axes), *spec[1:]))


def _swap(xs: list[jax.Array], shardings: tuple[NamedSharding, ...]) -> list[jax.Array]:
    """Each array's two halves (union_layout's groups) swapped, in the same layout: a collective permute."""
    out = []
    for x, sharding in zip(xs, shardings, strict=True):
        halves = x.reshape(2, x.shape[0] // 2, *x.shape[1:])
        out.append(jax.lax.with_sharding_constraint(halves[::-1].reshape(x.shape), sharding))
    return out


# Not donating: the input's buffers in the source's half are the source arrays' own. One compile per tree of shapes
# and layouts.
swap = jax.jit(_swap, static_argnums=1)


class Bridge:
    """Moves trees of arrays between `mesh` and `others` (a device group of the same size), across processes."""

    def __init__(self, mesh: Mesh, others: list[Any]) -> None:
        if len(others) != mesh.devices.size:
            raise ValueError(f"a bridge needs groups of equal size: {mesh.devices.size} and {len(others)} devices")
        self.mesh = mesh
        self.twin = Mesh(_partners(mesh, others), mesh.axis_names, axis_types=mesh.axis_types)  # `others`, shaped
        self.union = Mesh(np.stack([mesh.devices, self.twin.devices]), (GROUP_AXIS, *mesh.axis_names),
                          axis_types=(AxisType.Auto, *mesh.axis_types))

    def there(self, tree: Any, target: Any) -> Any:
        """`tree` (arrays on `mesh`) onto the other group's shardings `target`."""
        landed = self._cross(tree, self.mesh, self.twin)
        return jax.device_put(landed, target)

    def back(self, tree: Any, target: Any) -> Any:
        """`tree` (arrays on the other group) onto `target`, shardings on `mesh`."""
        on_twin = jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(self.twin, s.spec), target))
        return self._cross(on_twin, self.twin, self.mesh)

    def _cross(self, tree: Any, src: Mesh, dst: Mesh) -> Any:
        """Arrays on `src` (one row of the union) to the same spec on `dst` (the other row)."""
        leaves, treedef = jax.tree.flatten(tree)
        unions = [self._union_array(x, src) for x in leaves]
        moved = swap(unions, tuple(u.sharding for u in unions))
        dst_set = set(dst.devices.flat)
        out = []
        for x, m in zip(leaves, moved, strict=True):
            # Each landed buffer is the shard itself (a 0-d array's: of shape [1], reshaped: a scalar).
            shards = [s.data if x.ndim else s.data.reshape(()) for s in m.addressable_shards if s.device in dst_set]
            out.append(jax.make_array_from_single_device_arrays(
                x.shape, NamedSharding(dst, _spec(x)), shards, dtype=x.dtype))
        return jax.tree.unflatten(treedef, out)

    def _union_array(self, x: jax.Array, src: Mesh) -> jax.Array:
        """`x` on the union mesh (union_layout): its shards, as they are, in `src`'s half, zeros (made on the device)
        in the other."""
        shape, sharding = union_layout(x.shape, _spec(x), self.union)
        mine = {s.device: s.data if x.ndim else s.data.reshape(1) for s in x.addressable_shards}
        src_set = set(src.devices.flat)
        bufs = []
        for d, idx in sharding.addressable_devices_indices_map(shape).items():
            if d in src_set:
                bufs.append(mine[d])
            else:
                assert idx is not None  # typed Optional in jax; a device of the sharding always has an index
                piece = tuple(len(range(*i.indices(n))) for i, n in zip(idx, shape, strict=True))
                bufs.append(jnp.zeros(piece, x.dtype, device=d))
        return jax.make_array_from_single_device_arrays(shape, sharding, bufs, dtype=x.dtype)
