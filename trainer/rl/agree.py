"""What the processes of a job agree on (a stop signal, which checkpoint step to use, the trainer's metrics on processes
holding none of its devices) as host values through the jax.distributed coordination service: the key-value store
and barriers that `jax.distributed.initialize` starts on process 0. Never through a device program.

jax.experimental.multihost_utils (process_allgather, broadcast_one_to_all, sync_global_devices) runs a program over
every local device. On CPU, jax runs a program over several local devices of a process neither after the one-device
programs still running on those devices nor before the next ones (pjrt/cpu/cpu_client.cc orders a program with one
addressable device after its device's last one; one over several only after the previous such program), and the
helpers read device 0's part of the result while the other parts may still run. With placement split within each
host, a process holds one device of each mesh, so the helpers' all-gather groups (one per local device index) are the
trainer's and the sampler's meshes themselves, in the same order, and gloo gives them the same communicator, where
every collective of a kind has the same tag (xla/backends/cpu/collectives/gloo_communicator.cc). A sampling program
started while an agreement's part on the sampler's device was still gathering crossed its messages: "Received data
size doesn't match expected size" (issue 43). The coordination service shares nothing with the devices.

Every process makes the same calls in the same order, as for a collective. Call n writes `<PREFIX>/<n>/<process>`,
waits at barrier `<PREFIX>/<n>` and reads that folder; then each process deletes its key of call n - 1 (everyone read
it before writing call n).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import zlib
from typing import Any, Final

import jax
import numpy as np

PREFIX: Final = "gke-tpu-rl/agree"
# Processes may reach an agreement far apart: with placement split the sampler's processes wait while the trainer's
# compile and run a 70B update, and at a resume the processes holding no state wait while the others read it. A
# device collective on TPU has no deadline either. A process that died is reported much sooner: the coordination
# service's heartbeats end every process (SIGABRT, which the pod failure policy restarts).
TIMEOUT_MS: Final = 24 * 3600 * 1000

_calls = itertools.count()


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several processes but no jax.distributed client: jax.distributed.initialize first")
    return client


def _exchange(value: Any) -> list[Any]:
    """Every process's `value` (any value `encode` takes), in process order."""
    if jax.process_count() == 1:
        return [value]
    client = _client()
    n, me = next(_calls), jax.process_index()
    client.key_value_set_bytes(f"{PREFIX}/{n}/{me}", encode(value))
    client.wait_at_barrier(f"{PREFIX}/{n}", TIMEOUT_MS)
    got = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get_bytes(f"{PREFIX}/{n}/")}
    if n:
        client.key_value_delete(f"{PREFIX}/{n - 1}/{me}")
    return [decode(got[p]) for p in range(jax.process_count())]


def encode(value: Any) -> bytes:
    """`value` (None, bools, numbers, strings, arrays, and lists, tuples and string-keyed dicts of them) as JSON with
    arrays in numpy's .npy format: no pickle, since the coordination service's port is a network port."""

    def enc(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (np.ndarray, np.generic)):
            buf = io.BytesIO()
            np.save(buf, np.asarray(v), allow_pickle=False)
            return {"s" if isinstance(v, np.generic) else "a": base64.b64encode(buf.getvalue()).decode()}
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise TypeError(f"agree: dict keys must be strings, got {list(v)[:4]}")
            return {"d": {k: enc(x) for k, x in v.items()}}
        if isinstance(v, (list, tuple)):
            return {"t" if isinstance(v, tuple) else "l": [enc(x) for x in v]}
        raise TypeError(f"agree: cannot send a {type(v).__name__}")

    return json.dumps(enc(value)).encode()


def decode(data: bytes) -> Any:
    """The value `encode` wrote."""

    def dec(v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        [(kind, body)] = v.items()
        if kind in ("a", "s"):
            a = np.load(io.BytesIO(base64.b64decode(body)), allow_pickle=False)
            return a if kind == "a" else a[()]  # a numpy scalar stays one
        if kind == "d":
            return {k: dec(x) for k, x in body.items()}
        items = [dec(x) for x in body]
        return tuple(items) if kind == "t" else items

    return dec(json.loads(data))


def allgather(value: Any) -> np.ndarray:
    """Every process's `value` (an array of one shape and dtype on all), stacked in process order."""
    return np.stack([np.asarray(v) for v in _exchange(np.asarray(value))])


def broadcast(value: Any, source: int) -> Any:
    """Process `source`'s `value` (a tree of host values) on every process; the others' `value` is not sent."""
    return _exchange(value if jax.process_index() == source else None)[source]


def barrier(name: str) -> None:
    """Every process reaches this point; raises if one reached another barrier (its calls went out of step)."""
    names = allgather(np.uint32(zlib.crc32(name.encode())))
    if len(set(names.tolist())) > 1:
        raise RuntimeError(f"processes at different barriers ({names.tolist()}): this one at {name!r}")
