"""Host <-> global-array plumbing: each process builds and reads only the batch rows its devices hold.

Rows are prompt-major (row b is sample b % G of prompt b // G). The same code runs with one process or many:
a process fills the rows `local_rows` reports and `make_array_from_callback` hands each device its slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from trainer.model.sharding import batch_sharding, replicated
from trainer.rl import agree


def local_rows(sharding: NamedSharding, n_rows: int) -> list[int]:
    """Rows of a [n_rows, ...] array with this sharding that live on this process's devices."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((n_rows,)).values():
        assert index is not None  # typed Optional in jax, but taken from devices_indices_map (never None)
        rows.update(range(*index[0].indices(n_rows)))
    return sorted(rows)


def process_rows(mesh: Mesh, n_rows: int) -> list[int]:
    """Rows of a batch-sharded [n_rows, ...] array that this process must provide."""
    return local_rows(batch_sharding(mesh, 1), n_rows)


def from_rows(mesh: Mesh, rows: list[int], values: np.ndarray, shape: Sequence[int]) -> jax.Array:
    """Global batch-sharded array of `shape` from this process's rows (`values[i]` is row `rows[i]`)."""
    full = np.zeros(tuple(shape), values.dtype)
    if rows:
        full[rows] = values
    return jax.make_array_from_callback(tuple(shape), batch_sharding(mesh, len(shape)), lambda idx: full[idx],
                                        dtype=full.dtype)  # no shard here: a process without devices of `mesh`


def replicate(mesh: Mesh, value: np.ndarray | np.generic) -> jax.Array:
    """The same host value on every device (every process must pass the same value)."""
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, replicated(mesh), lambda idx: arr[idx], dtype=arr.dtype)


def read_local_rows(x: jax.Array) -> dict[int, np.ndarray]:
    """This process's rows of a batch-sharded array, keyed by global row index."""
    n = x.shape[0]
    out: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        data = np.asarray(shard.data)
        for i, row in enumerate(range(*shard.index[0].indices(n))):
            out.setdefault(row, data[i])
    return out


def host_values(tree: Any, mesh: Mesh) -> Any:
    """The host values of a tree of arrays replicated on `mesh`, on every process (every process must call it).

    With placement split by slice or host, a process holding no device of `mesh` holds no shard of them (jax runs a
    program on its own devices only), so the first process of `mesh` sends them to every process (trainer/rl/agree.py:
    through the coordination service, not a device program)."""
    holders = {d.process_index for d in mesh.devices.flat}
    if len(holders) == jax.process_count():
        return jax.device_get(tree)
    source = min(holders)
    return agree.broadcast(jax.device_get(tree) if jax.process_index() == source else None, source=source)
