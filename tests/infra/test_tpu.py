"""The TPU catalog: the facts GKE documents for each generation and topology."""

from __future__ import annotations

import pytest

from envspec import tpu


@pytest.mark.parametrize(
    ("tpu_type", "topology", "machine", "chips_per_host", "hosts", "accelerator"),
    [
        ("v6e", "4x4", "ct6e-standard-4t", 4, 4, "tpu-v6e-slice"),
        ("v6e", "2x2", "ct6e-standard-4t", 4, 1, "tpu-v6e-slice"),
        ("v6e", "2x4", "ct6e-standard-8t", 8, 1, "tpu-v6e-slice"),
        ("v6e", "1x1", "ct6e-standard-1t", 1, 1, "tpu-v6e-slice"),
        ("v6e", "16x16", "ct6e-standard-4t", 4, 64, "tpu-v6e-slice"),
        ("v5p", "4x4x4", "ct5p-hightpu-4t", 4, 16, "tpu-v5p-slice"),
        ("v5p", "2x2x1", "ct5p-hightpu-4t", 4, 1, "tpu-v5p-slice"),
        ("v5litepod", "2x4", "ct5lp-hightpu-8t", 8, 1, "tpu-v5-lite-podslice"),
        ("v5e", "8x8", "ct5lp-hightpu-4t", 4, 16, "tpu-v5-lite-podslice"),
        ("v4", "2x2x4", "ct4p-hightpu-4t", 4, 4, "tpu-v4-podslice"),
        ("tpu7x", "2x2x2", "tpu7x-standard-4t", 4, 2, "tpu7x"),
    ],
)
def test_slice_shapes(tpu_type: str, topology: str, machine: str, chips_per_host: int, hosts: int,
                      accelerator: str) -> None:
    shape = tpu.slice_shape(tpu_type, topology)
    assert shape.machine_type == machine
    assert shape.chips_per_host == chips_per_host
    assert shape.hosts == hosts
    assert shape.accelerator == accelerator
    assert shape.hosts * shape.chips_per_host == shape.chips


def test_every_topology_fills_whole_hosts() -> None:
    for gen in tpu.GENERATIONS.values():
        for topology in gen.topologies:
            shape = tpu.SliceShape(gen, topology)
            assert shape.chips % shape.chips_per_host == 0, shape.key
            assert shape.multi_host == (topology not in gen.single_host_machines), shape.key


def test_peak_and_memory_scale_with_chips() -> None:
    shape = tpu.slice_shape("v5p", "4x4x4")
    assert shape.chips == 64
    assert shape.peak_bf16_tflops == pytest.approx(64 * 459.0)
    assert shape.hbm_gib == 64 * 95
    assert tpu.GENERATIONS["v5p"].tensorcores_per_chip == 2
    assert tpu.GENERATIONS["v6e"].tensorcores_per_chip == 1


def test_invalid_topology_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'4x3' is not valid for v6e; allowed: 1x1, 2x2, 2x4, 4x4"):
        tpu.slice_shape("v6e", "4x3")


def test_unknown_type_lists_allowed() -> None:
    with pytest.raises(ValueError, match=r"unknown TPU type 'v9'; allowed: tpu7x, v4, v5e, v5p, v6e"):
        tpu.canonical_type("v9")
